//! Logging set-up shared by both binaries: `--log-format plain|json`, level from `RUST_LOG`
//! (default `info`).

use clap::ValueEnum;

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Plain,
    /// One JSON object per line (for log shippers).
    Json,
}

/// Installs the global tracing subscriber. Calling it twice is harmless (the second is ignored).
pub fn init(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colour only on a terminal: logs redirected to a file or collected by the kubelet stay
    // plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    let _ = match format {
        LogFormat::Plain => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

/// Prometheus text exposition (format 0.0.4) of a registry, for a `/metrics` handler.
pub fn encode_metrics(registry: &prometheus::Registry) -> String {
    use prometheus::Encoder;
    let mut buf = Vec::new();
    if let Err(e) = prometheus::TextEncoder::new().encode(&registry.gather(), &mut buf) {
        return format!("# encoding failed: {e}\n");
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM (what Kubernetes sends a container on stop).
/// If a handler cannot be installed, that signal is simply not awaited.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
