//! `ic-controller lookup` as a user runs it against a live standalone controller.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use ic_controller::standalone::{self, StandaloneConfig};

async fn lookup(controller: String) -> std::process::Output {
    lookup_with(controller, &["--tokens", "0..32"]).await
}

async fn lookup_with(controller: String, args: &[&str]) -> std::process::Output {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_ic-controller"))
            .arg("lookup")
            .args(&args)
            .args(["--controller", &controller])
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
    let running = standalone::start(StandaloneConfig::ephemeral(), async move {
        let _ = stopped.await;
    })
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
    // Prompt text for a model without a tokenizer: NO_HINT with the reason, exit 0.
    let out = lookup_with(grpc.to_string(), &["--text", "Hello", "--model", "m"]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    let answer: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(answer["reason"], "NoTokenizerForModel", "{stdout}");
    assert_eq!(answer["promptTokens"], 0, "{stdout}");
    // Ids and text together are refused by the CLI itself.
    let out = lookup_with(grpc.to_string(), &["--text", "Hello", "--tokens", "1"]).await;
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    // Neither: the message names both ways, not --tokens alone.
    let out = lookup_with(grpc.to_string(), &[]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        stderr.contains("--tokens") && stderr.contains("--text"),
        "{stderr}"
    );
    // A range written with a dash: the error shows the range syntax.
    let out = lookup_with(grpc.to_string(), &["--tokens", "0-32"]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{out:?}");
    assert!(stderr.contains("a range is 0..32"), "{stderr}");
    // The HTTP port instead of the gRPC port: said so, with the port to use.
    let out = lookup(running.http_addr.to_string()).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{out:?}");
    assert!(
        stderr.contains("answered plain HTTP, not gRPC") && stderr.contains("gRPC port"),
        "{stderr}"
    );
    let _ = stop.send(());
    running.wait().await.unwrap();
}
