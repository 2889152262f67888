//! `ic-agent qualify`: the storage qualification run of spec 004 "Qualification" (issue 8
//! deliverable 5; issue 17 item 7), whose report an operator cites when enabling a provider in
//! the capability catalog (`docs/model-cache.md`).
//!
//! Given the path where a **writer** volume is mounted read-write and the path where a **reader**
//! volume (the static reader PV of another namespace, on the same data) is mounted, it proves:
//!
//! 1. **Data survives the writer's mount.** A separate writer process (this binary re-executed
//!    with the hidden `--write-payload` flag, or any [`WriterLauncher`]) writes a pseudo-random
//!    payload (default 16 MiB, generated from a fresh seed) into `<writer>/ic-qualify-<id>/`,
//!    fsyncs it and exits. Then the writer's mount must be **gone** — the payload no longer
//!    reachable through the writer path (the writer pod was deleted and its volume unmounted,
//!    or the writer ran in a mount namespace of its own that went with it); the run waits up to
//!    `--writer-teardown-seconds` for that — and only then is the payload read back, through the
//!    reader path, with the expected SHA-256. A volume whose data lives only as long as the
//!    writer's mount (a tmpfs) fails: either its mount never goes away, or the data goes with it.
//! 2. **The reader, on a distinct mount, sees identical bytes.** The reader path must be on
//!    another mount than the writer path (`/proc/self/mountinfo`, as they were before the writer
//!    ran): one mount seen twice proves nothing about another namespace's reader. Its SHA-256
//!    must equal the payload's (polled up to `--reader-wait-seconds`, for attribute caches).
//! 3. **Every write from the reader is refused with `EROFS`**: create, append, rename, chmod,
//!    truncate, unlink (delete) and mkdir, with the agent's reader-volume probes
//!    ([`crate::checks::mounts::probes::write_probes`]; anything a probe changes is undone at
//!    once). A `ro` mount flag alone is not proof, and neither is `EACCES`/`EPERM`.
//!    (`ftruncate` is shown but proves nothing: it fails with `EINVAL` on a read-only
//!    descriptor on any mount.)
//! 4. **Reclaim policy is `Retain`**: the `--reclaim-policy` the operator read from the PV
//!    (`kubectl get pv <pv> -o jsonpath='{.spec.persistentVolumeReclaimPolicy}'`). The agent
//!    has no API access, so the report states that the policy, `--provisioner` and
//!    `--storage-class` were **typed**, not read from the cluster.
//!
//! The report records the provisioner, the class, the payload's SHA-256 and both mounts.
//! Afterwards the run directory is removed by the writer launcher run once more in removal mode
//! (`--keep` leaves it); where that cannot reach the volume any more (the writer pod is gone) a
//! warning names the directory to remove. Exit status: 0 qualified, 1 not qualified, 2 the run
//! could not be made (a path is not a directory, the writer could not start).

use std::ffi::OsString;
use std::fs::OpenOptions;
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;
use thiserror::Error;

use crate::checks::mounts::probes::{write_probes, ProbeOutcome};
use crate::checks::mounts::samples::sha256_file;
use crate::checks::shm::{find_mount, parse_mountinfo};

/// Default payload size: 16 MiB, as in the spec's measurements.
pub const DEFAULT_PAYLOAD_BYTES: u64 = 16 << 20;
/// Name of the payload file inside the run directory.
pub const PAYLOAD_FILE: &str = "payload.bin";
/// Environment variable handing the writer process its run directory.
pub const ENV_WRITE_DIR: &str = "IC_QUALIFY_WRITE_DIR";
/// Environment variable handing the writer process the payload seed (hex).
pub const ENV_SEED: &str = "IC_QUALIFY_SEED";
/// Environment variable handing the writer process the payload size in bytes.
pub const ENV_BYTES: &str = "IC_QUALIFY_BYTES";
/// Environment variable (`1`) that makes the writer process remove its run directory instead
/// of writing (the clean-up after the proofs).
pub const ENV_REMOVE: &str = "IC_QUALIFY_REMOVE";
/// Default `--writer-teardown-seconds`: time to delete the writer pod after the payload is
/// written.
pub const DEFAULT_WRITER_TEARDOWN_SECONDS: u64 = 600;
/// What the report says about the reclaim policy, provisioner and class: the operator typed
/// them (`ic-agent` has no API access and reads nothing from the cluster).
pub const FACTS_TYPED: &str =
    "typed by the operator (--reclaim-policy, --provisioner, --storage-class); not read from the cluster";
/// The probes that must be refused with `EROFS` (spec 004: create, append, rename, chmod,
/// truncate, delete; plus mkdir).
pub const REQUIRED_PROBES: [&str; 7] = [
    "create", "append", "rename", "chmod", "truncate", "unlink", "mkdir",
];

/// `ic-agent qualify` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct QualifyArgs {
    /// Required. Where the writer volume is mounted read-write (e.g. the kubelet's
    /// /var/lib/kubelet/pods/<writer-pod-uid>/volumes/kubernetes.io~csi/<pv>/mount).
    #[arg(
        long,
        env = "IC_QUALIFY_WRITER_PATH",
        required_unless_present = "write_payload"
    )]
    pub writer_path: Option<PathBuf>,
    /// Required. Where the reader volume (a reader PV of another namespace on the same data) is
    /// mounted.
    #[arg(
        long,
        env = "IC_QUALIFY_READER_PATH",
        required_unless_present = "write_payload"
    )]
    pub reader_path: Option<PathBuf>,
    /// The writer PV's persistentVolumeReclaimPolicy as read from the API (proof 4 passes only
    /// for Retain). Recorded as typed.
    #[arg(long, env = "IC_QUALIFY_RECLAIM_POLICY")]
    pub reclaim_policy: Option<String>,
    /// The class's exact provisioner (`kubectl get sc <class> -o jsonpath='{.provisioner}'`),
    /// recorded in the report as typed.
    #[arg(long, env = "IC_QUALIFY_PROVISIONER")]
    pub provisioner: Option<String>,
    /// The StorageClass the writer claim was provisioned from, recorded in the report as typed.
    #[arg(long, env = "IC_QUALIFY_STORAGE_CLASS")]
    pub storage_class: Option<String>,
    /// Seconds to wait, after the payload is written, for the writer's mount to go away (delete
    /// the writer pod then) before proof 1 reads the payload back through the reader.
    #[arg(long, env = "IC_QUALIFY_WRITER_TEARDOWN_SECONDS", default_value_t = DEFAULT_WRITER_TEARDOWN_SECONDS)]
    pub writer_teardown_seconds: u64,
    /// Payload size in bytes (default 16 MiB).
    #[arg(long, env = "IC_QUALIFY_PAYLOAD_BYTES", default_value_t = DEFAULT_PAYLOAD_BYTES)]
    pub payload_bytes: u64,
    /// Seconds to wait for the payload to appear in the reader (attribute caches).
    #[arg(long, env = "IC_QUALIFY_READER_WAIT_SECONDS", default_value_t = 30)]
    pub reader_wait_seconds: u64,
    /// Leave the run directory on the writer volume.
    #[arg(long)]
    pub keep: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Internal: act as the writer process (reads IC_QUALIFY_WRITE_DIR, _SEED, _BYTES).
    #[arg(long, hide = true)]
    pub write_payload: bool,
}

/// What a run needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QualifyOptions {
    /// Writer mount (read-write).
    pub writer_path: PathBuf,
    /// Reader mount.
    pub reader_path: PathBuf,
    /// The writer PV's reclaim policy, as the operator read it.
    pub reclaim_policy: Option<String>,
    /// The class's provisioner, as the operator read it.
    pub provisioner: Option<String>,
    /// The StorageClass, as the operator read it.
    pub storage_class: Option<String>,
    /// Payload size, bytes.
    pub payload_bytes: u64,
    /// How long to wait for the payload in the reader.
    pub reader_wait: Duration,
    /// How long to wait for the writer's mount to go away after the writer exited.
    pub writer_teardown_wait: Duration,
    /// Keep the run directory.
    pub keep: bool,
}

/// How the writer process is started. It gets [`ENV_WRITE_DIR`], [`ENV_SEED`] and
/// [`ENV_BYTES`] in its environment and must call [`write_payload_from_env`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriterLauncher {
    /// Run `program args…` (the CLI runs its own executable with `qualify --write-payload`; a
    /// launcher may run it in a mount namespace of its own, e.g. under `unshare -m`).
    Exec {
        /// Executable.
        program: PathBuf,
        /// Arguments.
        args: Vec<OsString>,
    },
    /// Write from this process (unit tests: the "writer" does not exit and its mount stays, so
    /// proof 1 cannot pass).
    InProcess,
}

/// Why a run could not be made at all.
#[derive(Debug, Error)]
pub enum QualifyError {
    /// A path is not a directory.
    #[error("{which} path {path} is not a directory")]
    NotADirectory {
        /// `writer` or `reader`.
        which: &'static str,
        /// The path.
        path: String,
    },
    /// No randomness for the seed.
    #[error("no randomness for the payload seed")]
    Random,
    /// The writer process could not be started.
    #[error("cannot start the writer process {program}: {source}")]
    Spawn {
        /// Executable.
        program: String,
        /// Error.
        source: io::Error,
    },
    /// The writer process's environment is incomplete (`--write-payload` outside a run).
    #[error("writer process: {0}")]
    WriterEnv(String),
    /// Writing the payload failed.
    #[error("writing the payload into {path}: {source}")]
    Write {
        /// Run directory.
        path: String,
        /// Error.
        source: io::Error,
    },
}

/// One of the four proofs.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Proof {
    /// 1–4.
    pub number: u8,
    /// What it proves.
    pub title: &'static str,
    /// Passed.
    pub passed: bool,
    /// Evidence, as a sentence.
    pub detail: String,
}

/// A qualification report.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct QualifyReport {
    /// Writer mount.
    pub writer_path: String,
    /// Reader mount.
    pub reader_path: String,
    /// Run directory name (`ic-qualify-<id>`).
    pub run_id: String,
    /// Payload size, bytes.
    pub payload_bytes: u64,
    /// SHA-256 of the payload as generated (the payload hash the run proves).
    pub expected_sha256: String,
    /// SHA-256 read through the reader path after the writer's mount went away.
    pub reader_sha256: Option<String>,
    /// Mount point (this process's mountinfo) containing the writer path before the writer ran.
    pub writer_mount: Option<String>,
    /// Mount point containing the reader path.
    pub reader_mount: Option<String>,
    /// The writer's mount was seen gone (the payload unreachable through the writer path)
    /// before the read-back.
    pub writer_mount_gone: bool,
    /// The class's provisioner, as typed.
    pub provisioner: Option<String>,
    /// The StorageClass, as typed.
    pub storage_class: Option<String>,
    /// Where the reclaim policy, provisioner and class came from ([`FACTS_TYPED`]).
    pub facts_source: String,
    /// `(probe, outcome)` of every write probe on the reader, outcome as `EROFS`, `EACCES`,
    /// `succeeded(undone)`, …
    pub probes: Vec<(String, String)>,
    /// Reclaim policy given.
    pub reclaim_policy: Option<String>,
    /// The four proofs.
    pub proofs: Vec<Proof>,
    /// True when all four passed.
    pub qualified: bool,
    /// Problems cleaning up (the run directory could not be removed).
    pub warnings: Vec<String>,
}

impl QualifyReport {
    /// Exit status: 0 qualified, 1 not.
    pub fn exit_code(&self) -> i32 {
        if self.qualified {
            0
        } else {
            1
        }
    }

    /// The report as JSON (the struct's camelCase fields).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or_else(|e| json!({"error": e.to_string()}))
    }

    /// The human report to paste into a commit that enables a provider.
    pub fn render_text(&self) -> String {
        let mut s = String::new();
        s.push_str(
            "ic-agent qualify: storage qualification (docs/model-cache.md \"Enabling a provider\")\n",
        );
        s.push_str(&format!("writer path:  {}\n", self.writer_path));
        s.push_str(&format!("reader path:  {}\n", self.reader_path));
        let or_unknown =
            |v: &Option<String>| v.clone().unwrap_or_else(|| "(not given)".to_string());
        s.push_str(&format!(
            "mounts:       writer on {}, reader on {}\n",
            or_unknown(&self.writer_mount),
            or_unknown(&self.reader_mount)
        ));
        s.push_str(&format!(
            "provisioner:  {}\nclass:        {}\nreclaim:      {}\n",
            or_unknown(&self.provisioner),
            or_unknown(&self.storage_class),
            or_unknown(&self.reclaim_policy)
        ));
        s.push_str(&format!("facts:        {}\n", self.facts_source));
        s.push_str(&format!(
            "payload:      {} bytes, sha256 {}\n",
            self.payload_bytes, self.expected_sha256
        ));
        s.push_str(&format!("run:          {}\n\n", self.run_id));
        s.push_str(&format!("{:<46} {:<6} DETAIL\n", "PROOF", "RESULT"));
        for p in &self.proofs {
            s.push_str(&format!(
                "{:<46} {:<6} {}\n",
                format!("{} {}", p.number, p.title),
                if p.passed { "PASS" } else { "FAIL" },
                p.detail
            ));
        }
        for w in &self.warnings {
            s.push_str(&format!("warning: {w}\n"));
        }
        s.push('\n');
        if self.qualified {
            s.push_str("verdict: QUALIFIED. Set the catalog entry's accessModes to what this run proved, nothing more, and cite this report.\n");
        } else {
            s.push_str("verdict: NOT QUALIFIED. Do not list these access modes in the catalog.\n");
        }
        s
    }
}

/// Generates the payload of `seed` (`bytes` long: SHA-256(seed ‖ counter) blocks) into `out`;
/// returns its SHA-256 (hex). With `out = io::sink()` it only computes the digest.
pub fn generate_payload(seed: &[u8], bytes: u64, out: &mut dyn Write) -> io::Result<String> {
    let mut whole = ring::digest::Context::new(&ring::digest::SHA256);
    let mut buf = Vec::with_capacity(1 << 16);
    let mut counter: u64 = 0;
    let mut left = bytes;
    while left > 0 {
        let mut block = ring::digest::Context::new(&ring::digest::SHA256);
        block.update(seed);
        block.update(&counter.to_le_bytes());
        let d = block.finish();
        let take = usize::try_from(left.min(32)).unwrap_or(32);
        buf.extend_from_slice(&d.as_ref()[..take]);
        left -= take as u64;
        counter += 1;
        if buf.len() >= (1 << 16) || left == 0 {
            whole.update(&buf);
            out.write_all(&buf)?;
            buf.clear();
        }
    }
    Ok(hex::encode(whole.finish().as_ref()))
}

/// Writes the payload of `seed` into `dir/payload.bin` (creating `dir`), fsyncs file and
/// directory, and returns its SHA-256. What the writer process does.
pub fn write_payload(dir: &Path, seed: &[u8], bytes: u64) -> io::Result<String> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join(PAYLOAD_FILE);
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(&path)?;
    let mut w = io::BufWriter::with_capacity(1 << 20, &mut f);
    let digest = generate_payload(seed, bytes, &mut w)?;
    w.flush()?;
    drop(w);
    f.sync_all()?;
    std::fs::File::open(dir)?.sync_all()?;
    Ok(digest)
}

/// The writer process's entry: reads [`ENV_WRITE_DIR`], [`ENV_SEED`], [`ENV_BYTES`] and
/// writes the payload; with [`ENV_REMOVE`]`=1` removes the run directory instead (returns "").
pub fn write_payload_from_env() -> Result<String, QualifyError> {
    let var =
        |k: &str| std::env::var(k).map_err(|_| QualifyError::WriterEnv(format!("{k} is not set")));
    let dir = PathBuf::from(var(ENV_WRITE_DIR)?);
    if std::env::var(ENV_REMOVE).is_ok_and(|v| v == "1") {
        return std::fs::remove_dir_all(&dir)
            .map(|()| String::new())
            .map_err(|source| QualifyError::Write {
                path: dir.display().to_string(),
                source,
            });
    }
    let seed = hex::decode(var(ENV_SEED)?)
        .map_err(|e| QualifyError::WriterEnv(format!("{ENV_SEED}: {e}")))?;
    let bytes: u64 = var(ENV_BYTES)?
        .parse()
        .map_err(|e| QualifyError::WriterEnv(format!("{ENV_BYTES}: {e}")))?;
    write_payload(&dir, &seed, bytes).map_err(|source| QualifyError::Write {
        path: dir.display().to_string(),
        source,
    })
}

fn check_dir(which: &'static str, p: &Path) -> Result<(), QualifyError> {
    if p.is_dir() {
        Ok(())
    } else {
        Err(QualifyError::NotADirectory {
            which,
            path: p.display().to_string(),
        })
    }
}

/// Runs the writer; `Ok(detail)` when it exited successfully.
fn run_writer(
    launcher: &WriterLauncher,
    dir: &Path,
    seed_hex: &str,
    bytes: u64,
    remove: bool,
) -> Result<Result<String, String>, QualifyError> {
    match launcher {
        WriterLauncher::InProcess if remove => Ok(std::fs::remove_dir_all(dir)
            .map(|()| "removed in process".to_string())
            .map_err(|e| format!("removing {} failed: {e}", dir.display()))),
        WriterLauncher::InProcess => {
            let seed = hex::decode(seed_hex).map_err(|_| QualifyError::Random)?;
            Ok(write_payload(dir, &seed, bytes)
                .map(|_| "written in process (no separate writer)".to_string())
                .map_err(|e| format!("writing the payload failed: {e}")))
        }
        WriterLauncher::Exec { program, args } => {
            let child = std::process::Command::new(program)
                .args(args)
                .env(ENV_WRITE_DIR, dir)
                .env(ENV_SEED, seed_hex)
                .env(ENV_BYTES, bytes.to_string())
                .env(ENV_REMOVE, if remove { "1" } else { "0" })
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .map_err(|source| QualifyError::Spawn {
                    program: program.display().to_string(),
                    source,
                })?;
            let pid = child.id();
            let out = child
                .wait_with_output()
                .map_err(|source| QualifyError::Spawn {
                    program: program.display().to_string(),
                    source,
                })?;
            if out.status.success() {
                Ok(Ok(format!("writer pid {pid} exited 0")))
            } else {
                let err = String::from_utf8_lossy(&out.stderr);
                let tail: String = err.lines().rev().take(3).collect::<Vec<_>>().join(" | ");
                Ok(Err(format!(
                    "writer pid {pid} failed ({}): {tail}",
                    out.status
                )))
            }
        }
    }
}

fn wait_for(path: &Path, bytes: u64, wait: Duration) -> bool {
    let start = Instant::now();
    loop {
        if std::fs::metadata(path).is_ok_and(|m| m.len() == bytes) {
            return true;
        }
        if start.elapsed() >= wait {
            return false;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Runs the four proofs. Errors only when the run cannot be made ([`QualifyError`]); every
/// failed proof is in the report.
pub fn qualify(
    opts: &QualifyOptions,
    launcher: &WriterLauncher,
) -> Result<QualifyReport, QualifyError> {
    check_dir("writer", &opts.writer_path)?;
    check_dir("reader", &opts.reader_path)?;
    let mut seed = [0u8; 16];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut seed)
        .map_err(|_| QualifyError::Random)?;
    let seed_hex = hex::encode(seed);
    let run_id = format!("ic-qualify-{}", &seed_hex[..12]);
    let expected = generate_payload(&seed, opts.payload_bytes, &mut io::sink()).map_err(|e| {
        QualifyError::Write {
            path: "(memory)".to_string(),
            source: e,
        }
    })?;
    let writer_dir = opts.writer_path.join(&run_id);
    let reader_dir = opts.reader_path.join(&run_id);
    let (writer_mount, reader_mount) = mounts_of(&opts.writer_path, &opts.reader_path);
    let mut report = QualifyReport {
        writer_path: opts.writer_path.display().to_string(),
        reader_path: opts.reader_path.display().to_string(),
        run_id: run_id.clone(),
        payload_bytes: opts.payload_bytes,
        expected_sha256: expected.clone(),
        reader_sha256: None,
        writer_mount: writer_mount.clone(),
        reader_mount: reader_mount.clone(),
        writer_mount_gone: false,
        provisioner: opts.provisioner.clone(),
        storage_class: opts.storage_class.clone(),
        facts_source: FACTS_TYPED.to_string(),
        probes: Vec::new(),
        reclaim_policy: opts.reclaim_policy.clone(),
        proofs: Vec::new(),
        qualified: false,
        warnings: Vec::new(),
    };

    // The writer process writes and exits; then its mount must go away before the read-back.
    let writer = run_writer(launcher, &writer_dir, &seed_hex, opts.payload_bytes, false)?;
    let writer_payload = writer_dir.join(PAYLOAD_FILE);
    if writer.is_ok() && writer_payload.exists() && !opts.writer_teardown_wait.is_zero() {
        eprintln!(
            "ic-agent qualify: the payload is written ({run_id}); delete the writer pod now — waiting up to {}s for its mount of {} to go away",
            opts.writer_teardown_wait.as_secs(),
            opts.writer_path.display()
        );
    }
    report.writer_mount_gone = wait_gone(&writer_payload, opts.writer_teardown_wait);

    let reader_file = reader_dir.join(PAYLOAD_FILE);
    let visible = wait_for(&reader_file, opts.payload_bytes, opts.reader_wait);
    let reader_hash = sha256_file(&reader_file);
    if let Ok(h) = &reader_hash {
        report.reader_sha256 = Some(h.clone());
    }
    let read_back = match &reader_hash {
        Ok(h) if *h == expected => Ok(()),
        Ok(h) => Err(format!("sha256 {h}, not the payload's {expected}")),
        Err(e) => Err(format!(
            "{} {}: {e}",
            if visible {
                "cannot read"
            } else {
                "no payload at"
            },
            reader_file.display()
        )),
    };

    // 1. Data survives the writer's mount.
    let title1 = "data survives the writer's mount";
    let proof1 = match (&writer, report.writer_mount_gone, &read_back) {
        (Err(detail), _, _) => Proof {
            number: 1,
            title: title1,
            passed: false,
            detail: detail.clone(),
        },
        (Ok(exited), false, _) => Proof {
            number: 1,
            title: title1,
            passed: false,
            detail: format!(
                "{exited}, but after {}s the payload is still reachable through the writer path: the writer's mount is still there, so persistence past it is not shown (delete the writer pod, or run the writer in a mount namespace of its own)",
                opts.writer_teardown_wait.as_secs()
            ),
        },
        (Ok(exited), true, Ok(())) => Proof {
            number: 1,
            title: title1,
            passed: true,
            detail: format!(
                "{exited}; its mount is gone and the reader reads the payload back with the expected sha256"
            ),
        },
        (Ok(exited), true, Err(why)) => Proof {
            number: 1,
            title: title1,
            passed: false,
            detail: format!(
                "{exited}; after its mount went away the payload did not survive: {why} (a volume that lives with its mount, like a tmpfs, does not persist)"
            ),
        },
    };
    report.proofs.push(proof1);

    // 2. Identical bytes in a reader on another mount.
    let title2 = "identical bytes in a distinct reader mount";
    let same_mount = writer_mount.is_some() && writer_mount == reader_mount;
    let proof2 = if same_mount {
        Proof {
            number: 2,
            title: title2,
            passed: false,
            detail: format!(
                "the reader path is on the writer's own mount ({}): one mount seen twice shows nothing about a reader in another namespace",
                writer_mount.clone().unwrap_or_default()
            ),
        }
    } else {
        match &read_back {
            Ok(()) => Proof {
                number: 2,
                title: title2,
                passed: true,
                detail: format!(
                    "reader mount {} differs from the writer's {}; sha256 {expected} matches",
                    reader_mount.clone().unwrap_or_default(),
                    writer_mount.clone().unwrap_or_default()
                ),
            },
            Err(why) => Proof {
                number: 2,
                title: title2,
                passed: false,
                detail: format!("{why} (a reader on a new, empty volume sees nothing)"),
            },
        }
    };
    report.proofs.push(proof2);

    // 3. Every write from the reader is refused with EROFS.
    let probe_dir = if reader_dir.is_dir() {
        reader_dir.clone()
    } else {
        opts.reader_path.clone()
    };
    let file = reader_file.is_file().then_some(reader_file.as_path());
    let probes = write_probes(&probe_dir, file);
    let mut bad = Vec::new();
    for (name, outcome) in &probes {
        report.probes.push((name.to_string(), outcome.to_string()));
        if REQUIRED_PROBES.contains(name) && *outcome != ProbeOutcome::Refused(libc::EROFS) {
            bad.push(format!("{name}={outcome}"));
        }
    }
    let listing = probes
        .iter()
        .map(|(n, o)| {
            if REQUIRED_PROBES.contains(n) {
                format!("{n}={o}")
            } else {
                format!("({n}={o}, informational)")
            }
        })
        .collect::<Vec<_>>()
        .join(" ");
    report.proofs.push(Proof {
        number: 3,
        title: "reader writes refused with EROFS",
        passed: bad.is_empty(),
        detail: if bad.is_empty() {
            listing
        } else {
            format!("not refused with EROFS: {}; all: {listing}", bad.join(", "))
        },
    });

    // 4. Reclaim policy Retain (typed).
    let proof4 = match opts.reclaim_policy.as_deref() {
        Some("Retain") => Proof {
            number: 4,
            title: "reclaim policy Retain",
            passed: true,
            detail: "Retain (typed with --reclaim-policy; not read from the cluster)".to_string(),
        },
        Some(other) => Proof {
            number: 4,
            title: "reclaim policy Retain",
            passed: false,
            detail: format!("{other} (typed): a cache class must Retain (create a Retain class)"),
        },
        None => Proof {
            number: 4,
            title: "reclaim policy Retain",
            passed: false,
            detail: "not given: pass --reclaim-policy from kubectl get pv <pv> -o jsonpath='{.spec.persistentVolumeReclaimPolicy}'".to_string(),
        },
    };
    report.proofs.push(proof4);
    report.qualified = report.proofs.iter().all(|p| p.passed);

    if !opts.keep {
        let removed = if writer_dir.exists() {
            std::fs::remove_dir_all(&writer_dir).map_err(|e| e.to_string())
        } else {
            match run_writer(launcher, &writer_dir, &seed_hex, opts.payload_bytes, true)? {
                Ok(_) => Ok(()),
                Err(e) => Err(e),
            }
        };
        if let Err(e) = removed {
            report.warnings.push(format!(
                "the run directory {run_id} is left on the volume ({e}); remove it from a pod that mounts the claim read-write"
            ));
        }
    }
    Ok(report)
}

/// Mount points (this process's `/proc/self/mountinfo`) containing `writer` and `reader`;
/// `None` where unknown.
fn mounts_of(writer: &Path, reader: &Path) -> (Option<String>, Option<String>) {
    let Ok(text) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return (None, None);
    };
    let mounts = parse_mountinfo(&text);
    let of = |p: &Path| {
        let p = std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
        find_mount(&mounts, &p).map(|m| m.mount_point.display().to_string())
    };
    (of(writer), of(reader))
}

/// Waits up to `wait` until `path` no longer exists; true when it is gone.
fn wait_gone(path: &Path, wait: Duration) -> bool {
    let start = Instant::now();
    loop {
        if !path.exists() {
            return true;
        }
        if start.elapsed() >= wait {
            return false;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `ic-agent qualify`: runs the proofs with this executable as the writer process and prints
/// the report. Returns the exit status (0 qualified, 1 not, 2 could not run).
pub fn run_cli(args: QualifyArgs) -> i32 {
    if args.write_payload {
        return match write_payload_from_env() {
            Ok(_) => 0,
            Err(e) => {
                eprintln!("ic-agent qualify --write-payload: {e}");
                2
            }
        };
    }
    let (Some(writer_path), Some(reader_path)) = (args.writer_path, args.reader_path) else {
        eprintln!("ic-agent qualify: --writer-path and --reader-path are required");
        return 2;
    };
    let program = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("ic-agent qualify: cannot find this executable: {e}");
            return 2;
        }
    };
    let launcher = WriterLauncher::Exec {
        program,
        args: vec!["qualify".into(), "--write-payload".into()],
    };
    let opts = QualifyOptions {
        writer_path,
        reader_path,
        reclaim_policy: args.reclaim_policy,
        provisioner: args.provisioner,
        storage_class: args.storage_class,
        payload_bytes: args.payload_bytes,
        reader_wait: Duration::from_secs(args.reader_wait_seconds),
        writer_teardown_wait: Duration::from_secs(args.writer_teardown_seconds),
        keep: args.keep,
    };
    match qualify(&opts, &launcher) {
        Ok(report) => {
            let text = if args.json {
                let mut json = serde_json::to_string_pretty(&report.to_json()).unwrap_or_default();
                json.push('\n');
                json
            } else {
                report.render_text()
            };
            if let Err(e) = crate::write_stdout(&text) {
                eprintln!("ic-agent qualify: cannot write the report: {e}");
                return 2;
            }
            report.exit_code()
        }
        Err(e) => {
            eprintln!("ic-agent qualify: {e}");
            2
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn payload_is_deterministic_and_sized() {
        let mut a = Vec::new();
        let ha = generate_payload(b"seed", 1000, &mut a).unwrap();
        let hb = generate_payload(b"seed", 1000, &mut io::sink()).unwrap();
        assert_eq!(a.len(), 1000);
        assert_eq!(ha, hb);
        assert_ne!(
            ha,
            generate_payload(b"other", 1000, &mut io::sink()).unwrap()
        );
        let direct = ring::digest::digest(&ring::digest::SHA256, &a);
        assert_eq!(ha, hex::encode(direct.as_ref()));
    }

    fn options(writer: &Path, reader: &Path, reclaim: Option<&str>) -> QualifyOptions {
        QualifyOptions {
            writer_path: writer.to_path_buf(),
            reader_path: reader.to_path_buf(),
            reclaim_policy: reclaim.map(str::to_string),
            provisioner: Some("csi.example.com".into()),
            storage_class: Some("cache-retain".into()),
            payload_bytes: 4096,
            reader_wait: Duration::from_secs(1),
            writer_teardown_wait: Duration::ZERO,
            keep: false,
        }
    }

    /// One directory as writer and reader: the writer's mount never goes away (proof 1), the
    /// reader is the writer's own mount (proof 2), and it is writable (proof 3).
    #[test]
    fn one_writable_mount_for_both_fails_proofs_one_to_three_and_nothing_is_left() {
        let dir = tempfile::tempdir().unwrap();
        let opts = options(dir.path(), dir.path(), Some("Retain"));
        let r = qualify(&opts, &WriterLauncher::InProcess).unwrap();
        assert_eq!(
            r.proofs.iter().map(|p| p.passed).collect::<Vec<_>>(),
            vec![false, false, false, true],
            "{r:#?}"
        );
        assert!(!r.writer_mount_gone);
        assert!(r.proofs[0]
            .detail
            .contains("still reachable through the writer path"));
        assert!(
            r.proofs[1].detail.contains("the writer's own mount"),
            "{}",
            r.proofs[1].detail
        );
        // The bytes were there; that alone proves neither.
        assert_eq!(r.reader_sha256.as_deref(), Some(r.expected_sha256.as_str()));
        assert_eq!(r.provisioner.as_deref(), Some("csi.example.com"));
        assert_eq!(r.storage_class.as_deref(), Some("cache-retain"));
        assert_eq!(r.facts_source, FACTS_TYPED);
        let text = r.render_text();
        assert!(text.contains("csi.example.com") && text.contains("cache-retain"));
        assert!(text.contains("not read from the cluster"));
        assert!(!r.qualified);
        assert_eq!(r.exit_code(), 1);
        assert!(r.render_text().contains("NOT QUALIFIED"));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn missing_paths_and_policy() {
        let dir = tempfile::tempdir().unwrap();
        let opts = QualifyOptions {
            writer_path: dir.path().join("nope"),
            reader_wait: Duration::ZERO,
            payload_bytes: 10,
            ..options(dir.path(), dir.path(), None)
        };
        assert!(matches!(
            qualify(&opts, &WriterLauncher::InProcess),
            Err(QualifyError::NotADirectory {
                which: "writer",
                ..
            })
        ));
        let opts = QualifyOptions {
            writer_path: dir.path().to_path_buf(),
            ..opts
        };
        let r = qualify(&opts, &WriterLauncher::InProcess).unwrap();
        assert!(!r.proofs[3].passed);
        assert!(r.proofs[3].detail.contains("--reclaim-policy"));
        assert_eq!(r.to_json()["proofs"][3]["passed"], json!(false));
    }
}
