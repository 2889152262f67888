//! No thread of the agent's own process can read another pod's projected service-account token
//! (issue 38 item 7; docs/security.md "The agent mounts only what its checks read").
//!
//! The "pod" is a process in its own mount namespace (this test binary re-executed as
//! `pod_child` under `unshare -m`) with a projected-token-like tmpfs at
//! `…/var/run/secrets/kubernetes.io/serviceaccount/token`, running as uid 0 with every
//! capability dropped (`setpriv --bounding-set=-all`), as a pod with `capabilities: {drop: [ALL]}`
//! and no `runAsNonRoot` does. The agent's threads are uid 0 too: the kernel's ptrace read check
//! on `/proc/<pid>/root` passes for the same uid when the target's permitted set (empty) is a
//! subset of the caller's, so a thread that only drops its capabilities opens the token. A
//! thread set up by `ic_agent::privilege::drop_all_and_confine_or_warn` — what the main thread
//! and every tokio thread of `ic-agent run` run — is refused (`EACCES`), and still reads the
//! agent's own files. A thread with the DaemonSet's three capabilities reaches the token: that
//! is what the checks need, and why they run in processes of their own
//! (`ic_agent::checks_worker`).
//!
//! `the_running_agent_holds_capabilities_only_in_its_checks_processes` runs the real `ic-agent
//! run` binary under the DaemonSet's three capabilities with the pod in its plan: every thread of
//! the agent's process holds none and is confined, the checks supervisor and worker — its child
//! and grandchild — hold exactly the three, the checks still inspect the pod; a worker killed
//! (SIGKILL) or hung (SIGSTOP past `--checks-pass-timeout-seconds`) is one ChecksUnavailable
//! pass, then a new worker answers and `inferencecache_agent_checks_worker_restarts_total`
//! counts it. The binary is `$IC_AGENT_BIN`, else `target/debug/ic-agent` (`cargo build -p
//! ic-agent --bin ic-agent`; `cargo test --workspace` builds it).
//!
//! Recorded as skipped when not root or when the kernel has no Landlock (the agent then runs
//! unconfined and says so); fails, naming scripts/setup.sh, when `unshare` or `setpriv` is
//! missing.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{ErrorKind, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ic_agent::checks_worker::{SUPERVISOR_COMM, WORKER_COMM};
use ic_agent::privilege::{self, Capability, Confinement};
use ic_shared::plan::{EnginePlan, NodePlan};
use support::{have, is_root, skip, FakePod, SETUP};

/// Where `pod_child` mounts its token volume (set by the test).
const ENV_POD_DIR: &str = "IC_CONFINEMENT_POD_DIR";
const TOKEN: &str = "eyJhbGciOiJSUzI1NiJ9.another-pods-projected-token";
const TOKEN_DIR: &str = "var/run/secrets/kubernetes.io/serviceaccount";
const POD_UID: &str = "5a4d1b0c-0000-4000-8000-0000000c0f1e";
/// The pod of the running-agent test (its own cgroups: the tests run in parallel).
const AGENT_POD_UID: &str = "5a4d1b0c-0000-4000-8000-0000000c0f2a";

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

    // The DaemonSet's capabilities, which only the checks processes hold: the route the checks
    // need, and why they are processes of their own.
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

/// CAP_DAC_READ_SEARCH (2), CAP_SYS_PTRACE (19) and CAP_SYS_ADMIN (21), as `/proc/<pid>/status`
/// prints a set holding exactly them.
const THREE_CAPS: &str = "0000000000280004";
const ZERO: &str = "0000000000000000";

/// The `ic-agent` binary under test.
fn agent_bin() -> PathBuf {
    let bin = std::env::var_os("IC_AGENT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            // target/debug/deps/<this test> → target/debug/ic-agent
            let exe = std::env::current_exe().unwrap();
            exe.parent().unwrap().parent().unwrap().join("ic-agent")
        });
    assert!(
        bin.is_file(),
        "{} is missing: build it with `cargo build -p ic-agent --bin ic-agent` (or set \
         IC_AGENT_BIN)",
        bin.display()
    );
    bin
}

/// One thread as the kernel shows it: `(tid, comm, CapEff, CapPrm, NoNewPrivs)`.
type ThreadCaps = (String, String, String, String, String);

/// Every thread of `pid`.
fn threads(pid: u32) -> Vec<ThreadCaps> {
    let mut out = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for t in tasks.flatten() {
        let dir = t.path();
        let (Ok(comm), Ok(status)) = (
            std::fs::read_to_string(dir.join("comm")),
            std::fs::read_to_string(dir.join("status")),
        ) else {
            continue;
        };
        let field = |k: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(k))
                .map(|v| v.trim().to_string())
                .unwrap_or_default()
        };
        out.push((
            t.file_name().to_string_lossy().into_owned(),
            comm.trim().to_string(),
            field("CapEff:"),
            field("CapPrm:"),
            field("NoNewPrivs:"),
        ));
    }
    out
}

/// The pid of the live child of `parent` whose comm is `comm`.
fn child_named(parent: u32, comm: &str) -> Option<u32> {
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let rest: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        if rest.len() > 1
            && rest[0] != "Z"
            && rest[1] == parent.to_string()
            && &stat[open + 1..close] == comm
        {
            return Some(pid);
        }
    }
    None
}

/// The body of `GET <path>` on `port` (HTTP/1.1, connection closed), or `None`.
fn http_get(port: u16, path: &str) -> Option<String> {
    let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    c.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        c,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    c.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_string())
}

/// One check result as the test reads it: `(name, subject, reason, message, observed pid)`.
type Reported = (String, String, String, String, String);

/// `/v1/report`'s checks.
fn report(port: u16) -> Option<Vec<Reported>> {
    let doc: serde_json::Value = serde_json::from_str(&http_get(port, "/v1/report")?).ok()?;
    Some(
        doc["checks"]
            .as_array()?
            .iter()
            .map(|c| {
                let s = |k: &str| c[k].as_str().unwrap_or_default().to_string();
                (
                    s("name"),
                    s("subject"),
                    s("reason"),
                    s("message"),
                    c["observed"]["pid"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                )
            })
            .collect(),
    )
}

/// The value of the sample `name` (no labels) on `/metrics`.
fn metric(port: u16, name: &str) -> Option<f64> {
    let text = http_get(port, "/metrics")?;
    text.lines().find_map(|l| {
        l.strip_prefix(name)
            .and_then(|v| v.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    })
}

/// Polls `what` every 200 ms for up to 60 s until it returns `Some`.
fn wait_for<T>(agent: &mut Child, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            agent.try_wait().unwrap().is_none(),
            "ic-agent run exited while waiting for {what}"
        );
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Kills the agent on drop (a failed assertion must not leave it running).
struct Agent(Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_running_agent_holds_capabilities_only_in_its_checks_processes() {
    let name =
        "thread_confinement::the_running_agent_holds_capabilities_only_in_its_checks_processes";
    if !is_root() {
        skip(name, "needs root (capability sets, a mount namespace)");
        return;
    }
    for tool in ["unshare", "setpriv", "mount"] {
        assert!(have(tool), "{tool} is missing: run {SETUP}");
    }
    let bin = agent_bin();
    let dir = tempfile::tempdir().unwrap();
    let pod = FakePod::start(
        "pod_child",
        &["-m", "--propagation", "private"],
        &[(ENV_POD_DIR, dir.path().display().to_string())],
        AGENT_POD_UID,
    );
    let plan = NodePlan {
        engines: vec![EnginePlan {
            namespace: "team-a".into(),
            pod: "engine-0".into(),
            pod_uid: Some(AGENT_POD_UID.into()),
            ..EnginePlan::default()
        }],
        ..NodePlan::default()
    };
    let plan_file = dir.path().join("plan.json");
    std::fs::write(&plan_file, serde_json::to_vec(&plan).unwrap()).unwrap();
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    // The DaemonSet's securityContext: uid 0 with exactly the three capabilities.
    let mut agent = Agent(
        Command::new("setpriv")
            .args([
                "--bounding-set=-all,+sys_ptrace,+sys_admin,+dac_read_search",
                "--inh-caps=-all",
                "--",
            ])
            .arg(&bin)
            .args(["run", "--plan"])
            .arg(&plan_file)
            .arg("--proc-root")
            .arg(&pod.proc_root)
            .args([
                "--http-addr",
                &format!("127.0.0.1:{port}"),
                "--check-interval-seconds",
                "1",
                "--t2-scrape-interval-seconds",
                "0",
                "--checks-pass-timeout-seconds",
                "4",
                "--node",
                "confinement-test",
            ])
            .env("IC_NVML_LIBRARY", dir.path().join("no-nvml.so"))
            .env("IC_HOST_NETNS", "/proc/self/net")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let pid = agent.0.id();
    let pod_pid = pod.pid.to_string();
    // The checks still inspect the pod through /proc/<pid>/root: its shm result names its pid.
    let pod_inspected = |port| {
        report(port).filter(|r| {
            r.iter()
                .any(|c| c.0 == "shm" && c.1 == "team-a/engine-0" && c.4 == pod_pid)
        })
    };
    let first = wait_for(&mut agent.0, "a pass that inspects the pod", || {
        pod_inspected(port)
    });
    assert!(
        first.iter().all(|c| c.2 != "ChecksUnavailable"),
        "{first:?}"
    );
    let supervisor = child_named(pid, SUPERVISOR_COMM).expect("no checks supervisor child");
    let worker = child_named(supervisor, WORKER_COMM).expect("no checks worker");

    // Every thread of the agent's process: no capability, effective or permitted, and
    // no_new_privs (set with its Landlock domain).
    let own = threads(pid);
    assert!(own.len() >= 3, "{own:?}");
    for (tid, comm, eff, prm, nnp) in &own {
        assert_eq!(
            (eff.as_str(), prm.as_str(), nnp.as_str()),
            (ZERO, ZERO, "1"),
            "agent thread {tid} ({comm}): {own:?}"
        );
    }
    // The checks processes: exactly the three, on every thread.
    for (who, p) in [("supervisor", supervisor), ("worker", worker)] {
        let seen = threads(p);
        assert!(!seen.is_empty(), "{who}");
        for (tid, comm, eff, prm, _) in &seen {
            assert_eq!(
                (eff.as_str(), prm.as_str()),
                (THREE_CAPS, THREE_CAPS),
                "{who} thread {tid} ({comm}): {seen:?}"
            );
        }
    }
    let confined = metric(port, "inferencecache_agent_threads_confined");
    assert_eq!(
        metric(port, "inferencecache_agent_checks_worker_restarts_total"),
        Some(0.0)
    );

    // The worker killed: a ChecksUnavailable pass or the new worker's, then real passes again
    // from a new worker, counted.
    support::signal(worker, "KILL");
    wait_for(&mut agent.0, "the restart counted", || {
        metric(port, "inferencecache_agent_checks_worker_restarts_total").filter(|v| *v >= 1.0)
    });
    wait_for(&mut agent.0, "real passes after the restart", || {
        pod_inspected(port)
    });
    let second = child_named(supervisor, WORKER_COMM).expect("no new checks worker");
    assert_ne!(second, worker);
    assert_eq!(threads(second)[0].2, THREE_CAPS);

    // The worker hung past --checks-pass-timeout-seconds: that pass reads ChecksUnavailable
    // saying so, the worker is killed, a new one answers later.
    support::signal(second, "STOP");
    let hung = wait_for(&mut agent.0, "the hung pass", || {
        report(port).and_then(|r| {
            r.into_iter()
                .find(|c| c.2 == "ChecksUnavailable" && c.3.contains("took longer than 4 s"))
        })
    });
    println!("hung pass: {}", hung.3);
    wait_for(&mut agent.0, "the second restart counted", || {
        metric(port, "inferencecache_agent_checks_worker_restarts_total").filter(|v| *v >= 2.0)
    });
    wait_for(&mut agent.0, "real passes after the second restart", || {
        pod_inspected(port)
    });
    let third = child_named(supervisor, WORKER_COMM).expect("no third checks worker");
    assert!(third != second && third != worker);

    // The agent gone, its checks processes go too (stdin closed, PR_SET_PDEATHSIG).
    drop(agent);
    let live = |p: u32| {
        std::fs::read_to_string(format!("/proc/{p}/stat"))
            .map(|s| {
                !s.rsplit(')')
                    .next()
                    .unwrap_or("")
                    .trim_start()
                    .starts_with('Z')
            })
            .unwrap_or(false)
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while live(supervisor) || live(third) {
        assert!(
            Instant::now() < deadline,
            "the checks processes outlived the agent"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    pod.stop();
    if confined != Some(1.0) {
        skip(
            name,
            &format!(
                "the kernel has no Landlock (inferencecache_agent_threads_confined {confined:?}): \
                 the agent's threads hold no capability but are not confined"
            ),
        );
    }
}
