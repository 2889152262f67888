//! `ic-controller lookup` as a user runs it against a live standalone controller.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use ic_controller::standalone::{self, StandaloneConfig};
use ic_controller::state::LookupPolicy;

async fn lookup(controller: String) -> std::process::Output {
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_ic-controller"))
            .args(["lookup", "--tokens", "0..32", "--controller", &controller])
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

/// An empty index answers NO_HINT; the controller is reachable as `http://HOST:PORT` and as a
/// bare `HOST:PORT` (what `ic-agent subscribe --controller` also accepts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookup_reaches_the_router_by_url_or_bare_address() {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = standalone::start(
        StandaloneConfig {
            grpc_addr: "127.0.0.1:0".parse().unwrap(),
            http_addr: "127.0.0.1:0".parse().unwrap(),
            agent_expiry: Duration::from_secs(60),
            policy: LookupPolicy::default(),
            limits: Default::default(),
            allow_unauthenticated_non_loopback: false,
            tokenizers: Default::default(),
        },
        async move {
            let _ = stopped.await;
        },
    )
    .await
    .unwrap();
    let grpc = running.grpc_addr;
    for controller in [format!("http://{grpc}"), grpc.to_string()] {
        let out = lookup(controller.clone()).await;
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{controller}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("NO_HINT"), "{controller}: {stdout}");
    }
    let _ = stop.send(());
    running.wait().await.unwrap();
}
