//! One view of a planned reader mount judged: `ro` in the mount table, every write probe refused
//! with `EROFS`, every sample's digest the writer's (`ReaderVolumeReadOnly`,
//! `ReaderVolumeWritable`, `ReaderVolumeDigestMismatch`, …). Pure: the view is read elsewhere.

use ic_shared::check::{CheckResult, CheckStatus};
use ic_shared::plan::ReaderMount;

use super::super::shm::MountEntry;

use super::probes::ProbeOutcome;
use super::samples::SampleState;
use super::NAME;

/// What one container shows of a planned mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountView {
    /// Process the view was taken through (`None`: the agent itself).
    pub pid: Option<u32>,
    /// The mountinfo entry whose mount point is the planned path (`None`: not mounted there).
    pub mount: Option<MountEntry>,
    /// Why mountinfo could not be read, if it could not.
    pub mountinfo_error: Option<String>,
    /// Why the mounted volume's root could not be opened, if it could not (the mount is there,
    /// its state is not known).
    pub open_error: Option<String>,
    /// Write probes (empty when the volume is missing or not expected read-only).
    pub probes: Vec<(&'static str, ProbeOutcome)>,
    /// Planned samples: (relative path, expected digest, state).
    pub samples: Vec<(String, String, SampleState)>,
}

/// The pure decision for one planned mount from one container's view.
pub fn evaluate_view(subject: &str, plan: &ReaderMount, view: &MountView) -> CheckResult {
    let path = &plan.path;
    let who = format!("pod {}/{}", plan.namespace, plan.pod);
    let binding = if plan.binding.is_empty() {
        String::new()
    } else {
        format!(" (model cache {})", plan.binding)
    };
    let r = |status, reason: &str, message: String| {
        let mut r = CheckResult::new(NAME, subject, status, reason, message)
            .with("path", path)
            .with("expectReadOnly", plan.expect_read_only);
        if let Some(uid) = &plan.pod_uid {
            r = r.with("podUid", uid);
        }
        if let Some(pid) = view.pid {
            r = r.with("pid", pid);
        }
        if let Some(e) = &view.mountinfo_error {
            r = r.with("mountinfoError", e);
        }
        r
    };
    if view.mount.is_none() {
        if let Some(e) = &view.mountinfo_error {
            return r(
                CheckStatus::Unknown,
                "ReaderVolumeUnobservable",
                format!(
                    "cannot read the mount table of {who}{binding} ({e}), so whether {path} is \
                     mounted is unknown."
                ),
            );
        }
    }
    if let (Some(_), Some(e)) = (&view.mount, &view.open_error) {
        return r(
            CheckStatus::Unknown,
            "ReaderVolumeUnreadable",
            format!(
                "{path} is mounted in {who}{binding}, but the agent cannot open it ({e}): whether \
                 it is read-only and what it holds are unknown. An agent without \
                 CAP_DAC_READ_SEARCH, or a network filesystem that squashes root, refuses it: \
                 grant the capability in agent.securityContext.capabilities.add, or make the \
                 volume root world-searchable."
            ),
        )
        .with("openError", e);
    }
    let Some(m) = &view.mount else {
        return r(
            CheckStatus::Critical,
            "ReaderVolumeMissing",
            format!(
                "nothing is mounted at {path} in {who}{binding}; the engine would load the model \
                 from the container image or fail. Check the pod's volumeMounts."
            ),
        );
    };
    let mut findings: Vec<(CheckStatus, &str, String)> = Vec::new();
    let writable: Vec<String> = view
        .probes
        .iter()
        .filter(|(p, o)| o.shows_writable(p))
        .map(|(p, o)| format!("{p} {o}"))
        .collect();
    let not_undone = view
        .probes
        .iter()
        .any(|(_, o)| matches!(o, ProbeOutcome::Succeeded { undo: Err(_) }));
    if plan.expect_read_only && (!m.read_only() || !writable.is_empty()) {
        let flag = if m.read_only() {
            "is mounted read-only".to_string()
        } else {
            format!("is mounted read-write ({})", m.mount_options)
        };
        let probes = if writable.is_empty() {
            String::new()
        } else {
            format!(
                " and accepts writes ({}{})",
                writable.join(", "),
                if not_undone {
                    "; some changes could NOT be undone"
                } else {
                    "; every change was undone"
                }
            )
        };
        findings.push((
            CheckStatus::Critical,
            "ReaderVolumeWritable",
            format!(
                "{path} in {who}{binding} {flag}{probes}; a reader can corrupt the shared model \
                 cache for every pod. Mount it with readOnly: true."
            ),
        ));
    }
    let bad: Vec<String> = view
        .samples
        .iter()
        .filter_map(|(file, want, got)| match got {
            SampleState::Digest(d) if d.eq_ignore_ascii_case(want) => None,
            SampleState::Digest(d) => {
                Some(format!("{file} has SHA-256 {d}, the writer's is {want}"))
            }
            SampleState::Unreadable(e) => Some(format!("{file} cannot be read ({e})")),
            SampleState::Denied(_) => None,
        })
        .collect();
    let denied: Vec<String> = view
        .samples
        .iter()
        .filter_map(|(file, _, got)| match got {
            SampleState::Denied(e) => Some(format!("{file} ({e})")),
            _ => None,
        })
        .collect();
    if !bad.is_empty() {
        findings.push((
            CheckStatus::Critical,
            "ReaderVolumeDigestMismatch",
            format!(
                "{path} in {who}{binding} does not hold what the writer wrote: {}; the volume is \
                 stale, partial or another one. Re-run the writer or fix the binding.",
                bad.join("; ")
            ),
        ));
    }
    if !denied.is_empty() {
        // Permissions, not content: Unknown, and which capability would read it.
        let advice =
            crate::privilege::lacking_clause(&[crate::privilege::Capability::CAP_DAC_READ_SEARCH])
                .unwrap_or_else(|| "the file's permissions refuse the agent".to_string());
        findings.push((
            CheckStatus::Unknown,
            "ReaderVolumeSampleUnreadable",
            format!(
                "{path} in {who}{binding}: the agent may not read {}, so the digests cannot \
                 be compared; {advice}.",
                denied.join(", ")
            ),
        ));
    }
    let (status, reason, message) = if findings.is_empty() {
        let checked = if view.samples.is_empty() {
            String::new()
        } else {
            format!(
                ", and its {} sample file(s) match the writer's digests",
                view.samples.len()
            )
        };
        if plan.expect_read_only {
            (
                CheckStatus::Ok,
                "ReaderVolumeReadOnly",
                format!(
                    "{path} in {who}{binding} is mounted read-only ({} {}) and every write probe \
                     was refused{checked}.",
                    m.fs_type, m.source
                ),
            )
        } else {
            (
                CheckStatus::Ok,
                "ReaderVolumeMounted",
                format!(
                    "{path} in {who}{binding} is mounted ({} {}){checked}.",
                    m.fs_type, m.source
                ),
            )
        }
    } else {
        let status = CheckStatus::worst(findings.iter().map(|f| f.0));
        let reason = findings
            .iter()
            .find(|f| f.0 == status)
            .map(|f| f.1)
            .unwrap_or("ReaderVolumeWritable");
        let message = findings
            .iter()
            .map(|f| f.2.as_str())
            .collect::<Vec<_>>()
            .join(" ");
        (status, reason, message)
    };
    let mut result = r(status, reason, message)
        .with("fsType", &m.fs_type)
        .with("mountSource", &m.source)
        .with("mountOptions", &m.mount_options)
        .with("readOnlyFlag", m.read_only());
    if !view.probes.is_empty() {
        result = result.with(
            "probes",
            view.probes
                .iter()
                .map(|(p, o)| format!("{p}={o}"))
                .collect::<Vec<_>>()
                .join(","),
        );
    }
    if !view.samples.is_empty() {
        let ok = view
            .samples
            .iter()
            .filter(|(_, want, got)| matches!(got, SampleState::Digest(d) if d.eq_ignore_ascii_case(want)))
            .count();
        result = result
            .with("samples", view.samples.len())
            .with("samplesMatching", ok);
    }
    result
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::super::probes::PROBES;
    use super::*;
    use ic_shared::plan::SampleDigest;
    use std::path::PathBuf;

    fn ro_mount() -> MountEntry {
        MountEntry {
            mount_point: PathBuf::from("/models"),
            fs_type: "ext4".into(),
            source: "/dev/loop3".into(),
            mount_options: "ro,relatime".into(),
            super_options: "rw".into(),
        }
    }

    fn refused_all() -> Vec<(&'static str, ProbeOutcome)> {
        PROBES
            .iter()
            .map(|p| {
                let e = if *p == "ftruncate" {
                    libc::EINVAL
                } else {
                    libc::EROFS
                };
                (*p, ProbeOutcome::Refused(e))
            })
            .collect()
    }

    fn plan() -> ReaderMount {
        ReaderMount {
            namespace: "team-a".into(),
            pod: "reader-0".into(),
            path: "/models".into(),
            samples: vec![SampleDigest {
                file: "config.json".into(),
                sha256: "AA".into(),
            }],
            ..ReaderMount::default()
        }
    }

    #[test]
    fn verdict_table() {
        use CheckStatus::*;
        let good = MountView {
            pid: Some(42),
            mount: Some(ro_mount()),
            mountinfo_error: None,
            open_error: None,
            probes: refused_all(),
            samples: vec![(
                "config.json".into(),
                "AA".into(),
                SampleState::Digest("aa".into()),
            )],
        };
        type Case = (
            Box<dyn Fn(&mut MountView, &mut ReaderMount)>,
            CheckStatus,
            &'static str,
        );
        let cases: Vec<Case> = vec![
            (Box::new(|_, _| {}), Ok, "ReaderVolumeReadOnly"),
            (
                Box::new(|v, _| v.mount = None),
                Critical,
                "ReaderVolumeMissing",
            ),
            (
                // the mount table could not be read: not "missing"
                Box::new(|v, _| {
                    v.mount = None;
                    v.mountinfo_error = Some("/proc/42/mountinfo: No such process".into());
                }),
                Unknown,
                "ReaderVolumeUnobservable",
            ),
            (
                // mounted, but the agent may not open its root (EACCES, root_squash)
                Box::new(|v, _| {
                    v.open_error = Some("/proc/42/root/models: Permission denied".into());
                    v.probes.clear();
                    v.samples.clear();
                }),
                Unknown,
                "ReaderVolumeUnreadable",
            ),
            (
                Box::new(|v, _| {
                    if let Some(m) = v.mount.as_mut() {
                        m.mount_options = "rw,relatime".into();
                    }
                }),
                Critical,
                "ReaderVolumeWritable",
            ),
            (
                Box::new(|v, _| {
                    v.probes[2].1 = ProbeOutcome::Succeeded {
                        undo: Result::Ok(()),
                    }
                }),
                Critical,
                "ReaderVolumeWritable",
            ),
            (
                Box::new(|v, _| v.probes[6].1 = ProbeOutcome::Refused(libc::ENOENT)),
                Critical,
                "ReaderVolumeWritable",
            ),
            (
                // a non-root agent: inconclusive, the ro flag decides
                Box::new(|v, _| v.probes[0].1 = ProbeOutcome::Refused(libc::EACCES)),
                Ok,
                "ReaderVolumeReadOnly",
            ),
            (
                Box::new(|v, _| v.samples[0].2 = SampleState::Digest("bb".into())),
                Critical,
                "ReaderVolumeDigestMismatch",
            ),
            (
                Box::new(|v, _| v.samples[0].2 = SampleState::Unreadable("ENOENT".into())),
                Critical,
                "ReaderVolumeDigestMismatch",
            ),
            (
                // refused by the file's permissions: says nothing about the content
                Box::new(|v, _| v.samples[0].2 = SampleState::Denied("EACCES".into())),
                Unknown,
                "ReaderVolumeSampleUnreadable",
            ),
            (
                // a wrong digest beside a refused one still reads Critical
                Box::new(|v, _| {
                    v.samples[0].2 = SampleState::Denied("EACCES".into());
                    v.samples
                        .push(("b".into(), "AA".into(), SampleState::Digest("cc".into())));
                }),
                Critical,
                "ReaderVolumeDigestMismatch",
            ),
            (
                Box::new(|v, p| {
                    p.expect_read_only = false;
                    v.probes.clear();
                    if let Some(m) = v.mount.as_mut() {
                        m.mount_options = "rw".into();
                    }
                }),
                Ok,
                "ReaderVolumeMounted",
            ),
            (
                // writable and wrong content: both sentences, reason of the first
                Box::new(|v, _| {
                    v.probes[0].1 = ProbeOutcome::Succeeded {
                        undo: Result::Ok(()),
                    };
                    v.samples[0].2 = SampleState::Digest("bb".into());
                }),
                Critical,
                "ReaderVolumeWritable",
            ),
        ];
        for (i, (mutate, status, reason)) in cases.into_iter().enumerate() {
            let mut v = good.clone();
            let mut p = plan();
            mutate(&mut v, &mut p);
            let r = evaluate_view("team-a/reader-0:/models", &p, &v);
            assert_eq!(
                (r.status, r.reason.as_str()),
                (status, reason),
                "case {i}: {r:?}"
            );
        }
        let r = evaluate_view("s", &plan(), &good);
        assert_eq!(
            r.observed["probes"],
            "create=EROFS,append=EROFS,chmod=EROFS,truncate=EROFS,ftruncate=EINVAL,rename=EROFS,unlink=EROFS,mkdir=EROFS"
        );
        assert_eq!(r.observed["samplesMatching"], "1");
        assert_eq!(r.observed["readOnlyFlag"], "true");
    }
}
