//! Attacks on the controller's listeners on loopback, each asserting the bound
//! (docs/security.md): an oversized `/probe` is refused before anything is allocated, silent,
//! slowloris and idle keep-alive connections are closed by the header-read deadline, the
//! connection cap refuses one connection more and keeps `/healthz` answering, the gRPC listener
//! closes connections that never speak and refuses lookups above the token cap, and the webhook
//! listener closes connections that never finish a TLS handshake.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ic_controller::adapters::Registry;
use ic_controller::admission::server::{self, ServerConfig, WebhookClient};
use ic_controller::admission::tls::{SelfSignedOptions, TlsSource};
use ic_controller::admission::{Admission, StaticBackends, UnwiredPods};
use ic_controller::standalone::{self, Running, StandaloneConfig};
use ic_controller::state::LookupPolicy;
use ic_shared::serve::ConnectionLimits;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Generous guard for "the server closes it": the deadlines under test are 1 s.
const GUARD: Duration = Duration::from_secs(20);

fn limits(max_connections: usize, header_read_timeout: Duration) -> ConnectionLimits {
    ConnectionLimits {
        max_connections,
        header_read_timeout,
        ..Default::default()
    }
}

fn config(limits: ConnectionLimits) -> StandaloneConfig {
    StandaloneConfig {
        grpc_addr: "127.0.0.1:0".parse().unwrap(),
        http_addr: "127.0.0.1:0".parse().unwrap(),
        agent_expiry: Duration::from_secs(60),
        policy: LookupPolicy::default(),
        limits,
        allow_unauthenticated_non_loopback: false,
        tokenizers: Default::default(),
    }
}

async fn stack(limits: ConnectionLimits) -> Running {
    standalone::start(config(limits), std::future::pending())
        .await
        .unwrap()
}

#[tokio::test]
async fn standalone_refuses_to_listen_beyond_loopback_unless_told() {
    // Nothing is authenticated in standalone mode: an address beyond loopback is refused…
    let mut cfg = config(ConnectionLimits::default());
    cfg.http_addr = "0.0.0.0:0".parse().unwrap();
    let err = match standalone::start(cfg.clone(), std::future::pending()).await {
        Err(e) => e.to_string(),
        Ok(_) => panic!("standalone listened on 0.0.0.0 without being told"),
    };
    assert!(
        err.contains("0.0.0.0") && err.contains("--allow-unauthenticated-non-loopback"),
        "{err}"
    );
    // …unless asked for explicitly.
    cfg.allow_unauthenticated_non_loopback = true;
    let s = standalone::start(cfg, std::future::pending())
        .await
        .unwrap();
    assert!(s.http_addr.ip().is_unspecified());
}

/// One HTTP/1.1 request on a fresh connection; (status, body).
async fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    tokio::time::timeout(GUARD, s.read_to_string(&mut out))
        .await
        .unwrap()
        .unwrap();
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .unwrap_or("")
        .to_string();
    (status, body)
}

/// Reads until the peer closes; returns what arrived. Panics past [`GUARD`].
async fn until_closed(s: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(GUARD, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return out,
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Err(_) => panic!("the server kept the connection open past {GUARD:?}"),
        }
    }
}

#[tokio::test]
async fn probe_size_parameters_over_their_caps_are_refused_with_400() {
    let s = stack(ConnectionLimits::default()).await;
    // The issue's attack: blockSize=50M allocated 50M × 4 token ids.
    let (status, body) = http(s.http_addr, "GET", "/probe?blockSize=50000000", "").await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("blockSize 50000000") && body.contains("4096"),
        "{body}"
    );
    let (status, body) = http(s.http_addr, "POST", "/probe", r#"{"blockSize": 4097}"#).await;
    assert_eq!(status, 400, "{body}");
    let long = "a".repeat(ic_shared::limits::MAX_NAME_BYTES + 1);
    let (status, body) = http(s.http_addr, "GET", &format!("/probe?tenant={long}"), "").await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("tenant"), "{body}");
    // A body above the probe's body limit is refused as well.
    let big = format!(r#"{{"tenant": "{}"}}"#, "b".repeat(64 * 1024));
    let (status, _) = http(s.http_addr, "POST", "/probe", &big).await;
    assert_eq!(status, 413);
    // Nothing of the refused probes reached the index; a probe at the cap still runs.
    assert_eq!(s.shared.index.read().replica_count(), 0);
    let (status, body) = http(s.http_addr, "GET", "/probe?blockSize=4096", "").await;
    assert_eq!(status, 200, "{body}");
    let report: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(report["ok"], true, "{report}");
    assert_eq!(s.shared.index.read().replica_count(), 0);
}

#[tokio::test]
async fn silent_slowloris_and_idle_keepalive_http_connections_are_closed() {
    let s = stack(limits(64, Duration::from_secs(1))).await;
    // Never sends a byte.
    let mut silent = TcpStream::connect(s.http_addr).await.unwrap();
    // Trickles a header and stalls.
    let mut slow = TcpStream::connect(s.http_addr).await.unwrap();
    slow.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-a: ")
        .await
        .unwrap();
    // A served request, then idle on the kept-alive connection.
    let mut idle = TcpStream::connect(s.http_addr).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    assert!(until_closed(&mut silent).await.is_empty());
    let slow_got = until_closed(&mut slow).await;
    assert!(
        !String::from_utf8_lossy(&slow_got).contains("200 OK"),
        "a slowloris request was answered"
    );
    let idle_got = String::from_utf8_lossy(&until_closed(&mut idle).await).to_string();
    assert!(idle_got.starts_with("HTTP/1.1 200"), "{idle_got}");
    assert!(s.http_stats.timed_out() >= 1);
    // The listener still answers.
    assert_eq!(http(s.http_addr, "GET", "/healthz", "").await.0, 200);
}

#[tokio::test]
async fn the_connection_cap_refuses_one_more_and_healthz_answers_once_a_slot_frees() {
    let s = stack(limits(4, Duration::from_secs(300))).await;
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut c = TcpStream::connect(s.http_addr).await.unwrap();
        // A served request proves the connection holds a slot.
        c.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 256];
        let n = tokio::time::timeout(GUARD, c.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        held.push(c);
    }
    let mut fifth = TcpStream::connect(s.http_addr).await.unwrap();
    let _ = fifth
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await;
    assert!(
        until_closed(&mut fifth).await.is_empty(),
        "a fifth connection was served"
    );
    assert_eq!(s.http_stats.refused(), 1);
    drop(held.pop());
    // The freed slot is taken by the next connection (the permit is released on close).
    let mut answered = false;
    for _ in 0..50 {
        if http(s.http_addr, "GET", "/healthz", "").await.0 == 200 {
            answered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(answered);
}

#[tokio::test]
async fn grpc_connections_that_never_speak_are_closed_and_the_cap_holds() {
    let s = stack(limits(2, Duration::from_secs(1))).await;
    let mut silent = TcpStream::connect(s.grpc_addr).await.unwrap();
    assert!(until_closed(&mut silent).await.is_empty());
    assert!(s.grpc_stats.timed_out() >= 1);
    // Two clients hold both slots; a third connection is closed at accept.
    let url = format!("http://{}", s.grpc_addr);
    let mut clients = Vec::new();
    for _ in 0..2 {
        let ch = tonic::transport::Endpoint::from_shared(url.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut c = ic_shared::proto::router_service_client::RouterServiceClient::new(ch);
        c.lookup_route(ic_shared::proto::LookupRouteRequest {
            token_ids: (0..32).collect(),
            ..Default::default()
        })
        .await
        .unwrap();
        clients.push(c);
    }
    let mut third = TcpStream::connect(s.grpc_addr).await.unwrap();
    assert!(until_closed(&mut third).await.is_empty());
    assert_eq!(s.grpc_stats.refused(), 1);
}

#[tokio::test]
async fn lookups_above_the_token_cap_are_refused() {
    let s = stack(ConnectionLimits::default()).await;
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", s.grpc_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut c = ic_shared::proto::router_service_client::RouterServiceClient::new(ch)
        .max_encoding_message_size(64 * 1024 * 1024);
    let over = ic_shared::limits::MAX_LOOKUP_TOKENS as u32 + 1;
    let err = c
        .lookup_route(ic_shared::proto::LookupRouteRequest {
            token_ids: (0..over).collect(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    assert!(err.message().contains("1048576"), "{err}");
    let ok = c
        .lookup_route(ic_shared::proto::LookupRouteRequest {
            token_ids: (0..over - 1).collect(),
            ..Default::default()
        })
        .await
        .unwrap();
    // At the cap the lookup runs (an empty index: NO_HINT).
    assert_eq!(
        ok.into_inner().decision,
        ic_shared::proto::Decision::NoHint as i32
    );
}

#[tokio::test]
async fn webhook_connections_that_never_finish_tls_are_closed_and_the_cap_holds() {
    let admission = Arc::new(Admission::new(
        Arc::new(Registry::builtin()),
        Arc::new(StaticBackends::default()),
        Arc::new(UnwiredPods),
    ));
    let mut cfg = ServerConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        TlsSource::SelfSigned(SelfSignedOptions {
            subject_alt_names: vec!["127.0.0.1".into()],
            write_dir: None,
        }),
    );
    cfg.limits = limits(2, Duration::from_secs(1));
    let running = server::start(admission.clone(), cfg.clone()).await.unwrap();
    let mut silent = TcpStream::connect(running.local_addr).await.unwrap();
    assert!(until_closed(&mut silent).await.is_empty());
    assert!(running.stats.timed_out() >= 1);
    // A handshake that stalls half-way (a ClientHello fragment) is closed the same way.
    let mut stalled = TcpStream::connect(running.local_addr).await.unwrap();
    stalled
        .write_all(&[0x16, 0x03, 0x01, 0x02, 0x00])
        .await
        .unwrap();
    assert!(until_closed(&mut stalled).await.is_empty());

    // Two TLS connections hold both slots; a third is closed at accept.
    cfg.limits = limits(2, Duration::from_secs(300));
    let running = server::start(admission, cfg).await.unwrap();
    let ca = running.ca_pem.clone().unwrap();
    let client = WebhookClient::new(running.local_addr, &ca, "127.0.0.1").unwrap();
    let mut a = client.connect().await.unwrap();
    let mut b = client.connect().await.unwrap();
    assert_eq!(a.get("/healthz").await.unwrap().0, 200);
    assert_eq!(b.get("/healthz").await.unwrap().0, 200);
    let mut third = TcpStream::connect(running.local_addr).await.unwrap();
    assert!(until_closed(&mut third).await.is_empty());
    assert_eq!(running.stats.refused(), 1);
}
