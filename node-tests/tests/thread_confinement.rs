//! The agent's threads without capabilities cannot read another pod's projected
//! service-account token (issue 38 item 7; docs/security.md "The agent mounts only what its
//! checks read").
//!
//! The "pod" is a process in its own mount namespace (this test binary re-executed as
//! `pod_child` under `unshare -m`) with a projected-token-like tmpfs at
//! `…/var/run/secrets/kubernetes.io/serviceaccount/token`, running as uid 0 with every
//! capability dropped (`setpriv --bounding-set=-all`), as a pod with `capabilities: {drop: [ALL]}`
//! and no `runAsNonRoot` does. The agent's threads are uid 0 too: the kernel's ptrace read check
//! on `/proc/<pid>/root` passes for the same uid when the target's permitted set (empty) is a
//! subset of the caller's, so a thread that only drops its capabilities — what every tokio
//! thread of `ic-agent run` did before — opens the token. A thread set up by
//! `ic_agent::privilege::drop_all_and_confine_or_warn` — the function the runtime's
//! `on_thread_start` and the main thread run — is refused (`EACCES`), and still reads the agent's
//! own files. The checks thread, which keeps `CAP_SYS_PTRACE`, still reaches it: the documented
//! residual, asserted so that a change to it is seen.
//!
//! Recorded as skipped when not root or when the kernel has no Landlock (the agent then runs
//! unconfined and says so); fails, naming scripts/setup.sh, when `unshare` or `setpriv` is
//! missing.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::ErrorKind;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use ic_agent::privilege::{self, Capability, Confinement};
use support::{have, is_root, skip, FakePod, SETUP};

/// Where `pod_child` mounts its token volume (set by the test).
const ENV_POD_DIR: &str = "IC_CONFINEMENT_POD_DIR";
const TOKEN: &str = "eyJhbGciOiJSUzI1NiJ9.another-pods-projected-token";
const TOKEN_DIR: &str = "var/run/secrets/kubernetes.io/serviceaccount";
const POD_UID: &str = "5a4d1b0c-0000-4000-8000-0000000c0f1e";

/// The pod: mounts its token volume in its own mount namespace, then becomes a root process
/// without capabilities that prints `READY` and waits until its stdin closes. A no-op unless
/// run by the test with [`ENV_POD_DIR`].
#[test]
fn pod_child() {
    let Some(dir) = std::env::var_os(ENV_POD_DIR) else {
        return;
    };
    let script = format!(
        r#"set -e
T="$1/{TOKEN_DIR}"
mkdir -p "$T"
mount -t tmpfs -o size=1m,mode=0755 projected-token "$T"
printf '%s' '{TOKEN}' > "$T/token"
chmod 0644 "$T/token"
exec setpriv --bounding-set=-all --inh-caps=-all -- sh -c 'echo READY; grep CapPrm /proc/self/status; cat >/dev/null'
"#
    );
    let e = std::process::Command::new("sh")
        .args(["-c", &script, "sh"])
        .arg(&dir)
        .exec();
    panic!("cannot run the pod's script: {e}");
}

/// Reads `path` on a new thread after `setup` ran there.
fn read_on_thread(
    path: &Path,
    setup: impl FnOnce() -> Option<Confinement> + Send + 'static,
) -> (
    Option<Confinement>,
    std::io::Result<String>,
    std::io::Result<String>,
) {
    let path = path.to_path_buf();
    std::thread::spawn(move || {
        let c = setup();
        let token = std::fs::read_to_string(&path);
        // The agent's own files stay readable.
        let own = std::fs::read_to_string("/proc/thread-self/status");
        (c, token, own)
    })
    .join()
    .unwrap()
}

#[test]
fn threads_without_capabilities_cannot_read_another_pods_token() {
    let name = "thread_confinement::threads_without_capabilities_cannot_read_another_pods_token";
    if !is_root() {
        skip(
            name,
            "needs root (a mount namespace, /proc/<pid>/root of another process)",
        );
        return;
    }
    for tool in ["unshare", "setpriv", "mount"] {
        assert!(have(tool), "{tool} is missing: run {SETUP}");
    }
    let dir = tempfile::tempdir().unwrap();
    let pod = FakePod::start(
        "pod_child",
        &["-m", "--propagation", "private"],
        &[(ENV_POD_DIR, dir.path().display().to_string())],
        POD_UID,
    );
    assert!(
        pod.ready.iter().any(|w| w == "READY"),
        "the pod did not start: {:?}",
        pod.ready
    );
    let status = std::fs::read_to_string(format!("/proc/{}/status", pod.pid)).unwrap();
    assert!(
        status.contains("CapPrm:\t0000000000000000"),
        "the pod must run without capabilities:\n{status}"
    );
    let token: PathBuf = format!(
        "/proc/{}/root{}/{TOKEN_DIR}/token",
        pod.pid,
        dir.path().display()
    )
    .into();

    // The checks thread's capabilities (the DaemonSet's): the residual route.
    let (_, checks, _) = read_on_thread(&token, || {
        privilege::keep_only(&[
            Capability::CAP_SYS_PTRACE,
            Capability::CAP_SYS_ADMIN,
            Capability::CAP_DAC_READ_SEARCH,
        ])
        .unwrap();
        None
    });
    assert_eq!(checks.as_deref().ok(), Some(TOKEN), "{checks:?}");

    // Capabilities dropped only: uid 0 reads a capability-less root pod's token.
    let (_, dropped, _) = read_on_thread(&token, || {
        privilege::drop_all().unwrap();
        None
    });
    assert_eq!(
        dropped.as_deref().ok(),
        Some(TOKEN),
        "a thread without capabilities reads the pod's token unless confined: {dropped:?}"
    );

    // What every tokio thread and the main thread of `ic-agent run` do.
    let (confinement, confined, own) = read_on_thread(&token, || {
        privilege::drop_all_and_confine_or_warn();
        Some(privilege::confine_to_own_mount_tree().unwrap())
    });
    if let Some(Confinement::Off(why)) = &confinement {
        skip(name, &format!("the kernel has no Landlock: {why}"));
        return;
    }
    let e = confined.expect_err("a confined thread read another pod's token");
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    let own = own.unwrap();
    assert!(own.contains("NoNewPrivs:\t1"), "{own}");
    assert!(own.contains("CapEff:\t0000000000000000"), "{own}");
    pod.stop();
}
