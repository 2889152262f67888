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

/// A binary's version and the commit it was built from, for `inferencecache_build_info`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BuildInfo {
    /// The package version (`CARGO_PKG_VERSION`, e.g. `0.1.0`).
    pub version: &'static str,
    /// The full git commit hash the binary was built from (`IC_GIT_COMMIT`, set by
    /// `shared/build-commit.rs`), or `unknown` when it was built outside a git checkout without
    /// `IC_GIT_COMMIT`.
    pub commit: &'static str,
}

/// The [`BuildInfo`] of the calling crate: its `CARGO_PKG_VERSION` and the `IC_GIT_COMMIT` its
/// build script (`shared/build-commit.rs`) set. Compiles only in a package using that script.
#[macro_export]
macro_rules! build_info {
    () => {
        $crate::telemetry::BuildInfo {
            version: env!("CARGO_PKG_VERSION"),
            commit: env!("IC_GIT_COMMIT"),
        }
    };
}

/// Registers the series every binary exports besides its own metrics:
///
/// - `process_*` of this process (the prometheus crate's process collector, read from
///   `/proc/self` on each scrape): `process_cpu_seconds_total`, `process_resident_memory_bytes`,
///   `process_virtual_memory_bytes`, `process_virtual_memory_max_bytes`, `process_open_fds`,
///   `process_max_fds`, `process_start_time_seconds` (Unix seconds), `process_threads`;
/// - `inferencecache_build_info{version, commit}`: constant 1.
///
/// # Errors
/// When `registry` already holds one of these names.
pub fn register_process_and_build_info(
    registry: &prometheus::Registry,
    build: BuildInfo,
) -> Result<(), prometheus::Error> {
    #[cfg(target_os = "linux")]
    registry.register(Box::new(
        prometheus::process_collector::ProcessCollector::for_self(),
    ))?;
    let info = prometheus::IntGaugeVec::new(
        prometheus::Opts::new(
            "inferencecache_build_info",
            "Always 1: the binary's version and the git commit it was built from.",
        ),
        &["version", "commit"],
    )?;
    info.with_label_values(&[build.version, build.commit])
        .set(1);
    registry.register(Box::new(info))
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

/// An error and its causes on one line, `outer: cause: root`, each cause once: a cause whose
/// text the line already contains (an error type that prints its source in its own message, as
/// `#[error("cannot listen on {addr}: {source}")]` does) is not repeated.
pub fn error_report(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cause = c.source();
    }
    out
}

/// The exit path of both binaries' `main`: `Ok` exits 0; an error is printed once to stderr as
/// `Error: ` + [`error_report`] and exits 1.
pub fn exit_code<E: AsRef<dyn std::error::Error>>(result: Result<(), E>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {}", error_report(e.as_ref()));
            std::process::ExitCode::FAILURE
        }
    }
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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::error_report;

    #[derive(Debug, thiserror::Error)]
    enum Outer {
        #[error("cannot listen on 127.0.0.1:8080: {source}")]
        Bind {
            #[source]
            source: std::io::Error,
        },
        #[error("starting the stack")]
        Start(#[source] std::io::Error),
    }

    #[test]
    fn a_cause_already_in_the_message_is_printed_once() {
        let e = Outer::Bind {
            source: std::io::Error::new(std::io::ErrorKind::AddrInUse, "Address already in use"),
        };
        assert_eq!(
            error_report(&e),
            "cannot listen on 127.0.0.1:8080: Address already in use"
        );
    }

    #[test]
    fn a_cause_not_in_the_message_is_appended() {
        let e = Outer::Start(std::io::Error::other("no such file"));
        assert_eq!(error_report(&e), "starting the stack: no such file");
    }
}
