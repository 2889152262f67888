//! What the `gpu` check remembers about the node's GPUs: the **expected-GPU inventory** and the
//! **latched fatal XIDs**, kept in `<state-dir>/gpu-state.json` across agent restarts
//! (`--state-dir`; in memory only without one).
//!
//! - **Inventory**: the UUIDs of the first healthy enumeration (every GPU opened and named by
//!   its UUID). A GPU that appears later is added; a UUID of the inventory that NVML no longer
//!   enumerates is a missing GPU (`GpuMissing`, `Critical`, subject = its UUID). After a reboot
//!   (the kernel's boot id changed) the first healthy enumeration with at least as many GPUs
//!   re-takes the inventory: a GPU replaced while the node was down is not reported missing
//!   forever. With fewer GPUs the old inventory stays and the absent ones are missing.
//! - **Latched fatal XIDs**: every XID the policy makes `Critical`, per GPU UUID, until the GPU
//!   is reset or the node reboots. A reset is seen where NVML exposes the GPU's recovery action
//!   (`NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`, R550+ drivers): an action other than `NONE`
//!   followed by `NONE` is the reset having happened, and clears the GPU's latched XIDs. A
//!   reboot (a new boot id) clears all of them. Without either (an older driver and a
//!   `nvidia-smi -r` without a reboot) the operator clears them by deleting the file and
//!   restarting the agent (`docs/troubleshooting.md`, `GpuXidFatal`).
//!
//! The file is JSON (`version` 1), written atomically (a temporary file renamed over it) only
//! when its content changes. A file that cannot be read or parsed is set aside (renamed
//! `gpu-state.json.bad`) and the check starts from an empty memory, saying so in the log.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use super::xid::XidEvent;

/// The file in the state directory.
pub const GPU_STATE_FILE: &str = "gpu-state.json";

/// The file format version this agent writes and reads.
pub const GPU_STATE_VERSION: u32 = 1;

/// One fatal XID kept for a GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LatchedXid {
    /// The XID (`None`: an XID event without a value).
    pub xid: Option<u64>,
    /// When it was received, Unix ms.
    pub at_unix_ms: u64,
    /// MIG GPU instance id, when it came from one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_instance: Option<u32>,
    /// MIG compute instance id, when it came from one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_instance: Option<u32>,
    /// MIG device UUID of that GPU instance, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_uuid: Option<String>,
}

impl LatchedXid {
    /// From an event of the NVML thread.
    pub fn of(e: &XidEvent) -> Self {
        LatchedXid {
            xid: e.xid,
            at_unix_ms: unix_ms(e.at),
            gpu_instance: e.gpu_instance,
            compute_instance: e.compute_instance,
            mig_uuid: e.mig_uuid.clone(),
        }
    }

    /// Back to an event (millisecond precision).
    pub fn event(&self) -> XidEvent {
        XidEvent {
            xid: self.xid,
            at: SystemTime::UNIX_EPOCH + Duration::from_millis(self.at_unix_ms),
            gpu_instance: self.gpu_instance,
            compute_instance: self.compute_instance,
            mig_uuid: self.mig_uuid.clone(),
        }
    }
}

/// One GPU of the inventory.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KnownGpu {
    /// NVML index it had when last enumerated.
    pub index: u32,
    /// Product name, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Fatal XIDs not yet cleared by a reset or reboot, oldest first (at most
    /// [`MAX_LATCHED`]: the oldest dropped first).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fatal_xids: Vec<LatchedXid>,
    /// NVML reported a recovery action other than `NONE` since the last reset.
    #[serde(default)]
    pub recovery_action_seen: bool,
    /// When a reset was last seen (Unix ms): XID events received before it no longer count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset_at_unix_ms: Option<u64>,
}

/// Fatal XIDs kept per GPU.
pub const MAX_LATCHED: usize = 16;

/// The document in [`GPU_STATE_FILE`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuStateDoc {
    /// [`GPU_STATE_VERSION`].
    pub version: u32,
    /// The kernel's boot id when the document was written (`/proc/sys/kernel/random/boot_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_id: Option<String>,
    /// The expected GPUs by UUID.
    #[serde(default)]
    pub gpus: BTreeMap<String, KnownGpu>,
}

/// The `gpu` check's memory (module docs).
#[derive(Debug)]
pub struct GpuMemory {
    /// Where it is kept; `None`: in memory only.
    pub path: Option<PathBuf>,
    /// The document.
    pub doc: GpuStateDoc,
    /// The last document written (or read), to write only on change.
    saved: GpuStateDoc,
    /// A reboot was seen at load: the next healthy enumeration may re-take the inventory.
    pub rebooted: bool,
}

/// Unix ms of a time (0 before the epoch).
pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

fn read_boot_id(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

impl GpuMemory {
    /// Loads `<state_dir>/gpu-state.json` (or starts empty), then applies a reboot: when the
    /// boot id read from `boot_id_path` differs from the document's, every latched XID is
    /// cleared (a reboot resets every GPU) and the inventory may be re-taken.
    pub fn load(state_dir: Option<&Path>, boot_id_path: &Path) -> Self {
        let path = state_dir.map(|d| d.join(GPU_STATE_FILE));
        let mut doc = GpuStateDoc::default();
        if let Some(p) = &path {
            match std::fs::read(p) {
                Ok(bytes) => match serde_json::from_slice::<GpuStateDoc>(&bytes) {
                    Ok(d) if d.version == GPU_STATE_VERSION => doc = d,
                    Ok(d) => set_aside(
                        p,
                        &format!("version {} is not {GPU_STATE_VERSION}", d.version),
                    ),
                    Err(e) => set_aside(p, &e.to_string()),
                },
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(path = %p.display(), error = %e, "cannot read the GPU state file; starting without it")
                }
            }
        }
        let saved = doc.clone();
        let boot = read_boot_id(boot_id_path);
        let mut rebooted = false;
        if let (Some(old), Some(new)) = (&doc.boot_id, &boot) {
            if old != new {
                rebooted = true;
                for g in doc.gpus.values_mut() {
                    g.fatal_xids.clear();
                    g.recovery_action_seen = false;
                    g.reset_at_unix_ms = None;
                }
            }
        }
        if boot.is_some() {
            doc.boot_id = boot;
        }
        doc.version = GPU_STATE_VERSION;
        GpuMemory {
            path,
            doc,
            saved,
            rebooted,
        }
    }

    /// Records one enumeration: `(index, uuid, name)` of every GPU NVML listed, and whether
    /// every GPU opened and had a UUID (`healthy`). Takes or extends the inventory (module
    /// docs). Returns the UUIDs of the inventory that are not in `seen`, with what is known of
    /// them, ordered by their last index.
    pub fn enumerate(
        &mut self,
        seen: &[(u32, String, Option<String>)],
        healthy: bool,
    ) -> Vec<(String, KnownGpu)> {
        if healthy && !seen.is_empty() {
            let retake =
                self.doc.gpus.is_empty() || (self.rebooted && seen.len() >= self.doc.gpus.len());
            if retake {
                let mut gpus = BTreeMap::new();
                for (i, uuid, name) in seen {
                    let mut g = self.doc.gpus.get(uuid).cloned().unwrap_or_default();
                    g.index = *i;
                    g.name = name.clone().or(g.name);
                    gpus.insert(uuid.clone(), g);
                }
                self.doc.gpus = gpus;
                self.rebooted = false;
            }
        }
        for (i, uuid, name) in seen {
            let g = self.doc.gpus.entry(uuid.clone()).or_default();
            g.index = *i;
            if name.is_some() {
                g.name = name.clone();
            }
        }
        let mut missing: Vec<(String, KnownGpu)> = self
            .doc
            .gpus
            .iter()
            .filter(|(u, _)| !seen.iter().any(|(_, s, _)| s == *u))
            .map(|(u, g)| (u.clone(), g.clone()))
            .collect();
        missing.sort_by_key(|(_, g)| g.index);
        missing
    }

    /// Latches the fatal events of GPU `uuid` (received after its last reset) and returns the
    /// events to judge it by: its latched XIDs not in `events`, then `events` from after the
    /// last reset.
    pub fn latch(
        &mut self,
        uuid: &str,
        events: &[XidEvent],
        is_fatal: impl Fn(&XidEvent) -> bool,
    ) -> Vec<XidEvent> {
        let g = self.doc.gpus.entry(uuid.to_string()).or_default();
        let after_reset = |e: &XidEvent| g.reset_at_unix_ms.is_none_or(|r| unix_ms(e.at) > r);
        let live: Vec<XidEvent> = events.iter().filter(|e| after_reset(e)).cloned().collect();
        for e in live.iter().filter(|e| is_fatal(e)) {
            let l = LatchedXid::of(e);
            if !g.fatal_xids.contains(&l) {
                g.fatal_xids.push(l);
            }
        }
        if g.fatal_xids.len() > MAX_LATCHED {
            let extra = g.fatal_xids.len() - MAX_LATCHED;
            g.fatal_xids.drain(..extra);
        }
        let mut out: Vec<XidEvent> = g
            .fatal_xids
            .iter()
            .filter(|l| !live.iter().any(|e| LatchedXid::of(e) == **l))
            .map(LatchedXid::event)
            .collect();
        out.extend(live);
        out
    }

    /// Applies NVML's recovery action of GPU `uuid` (`None`: not exposed by this driver): an
    /// action other than `NONE` is remembered; `NONE` after one is a reset, which clears the
    /// GPU's latched XIDs as of `now`. Returns true when it cleared them.
    pub fn recovery_action(&mut self, uuid: &str, action: Option<u32>, now: SystemTime) -> bool {
        let Some(a) = action else { return false };
        let g = self.doc.gpus.entry(uuid.to_string()).or_default();
        if a != RECOVERY_NONE {
            g.recovery_action_seen = true;
            false
        } else if g.recovery_action_seen {
            g.recovery_action_seen = false;
            g.fatal_xids.clear();
            g.reset_at_unix_ms = Some(unix_ms(now));
            true
        } else {
            false
        }
    }

    /// Writes the document when it changed since the last write (no-op without a state
    /// directory). Errors are logged: the check's verdicts do not depend on the file.
    pub fn save(&mut self) {
        let Some(p) = &self.path else { return };
        if self.doc == self.saved {
            return;
        }
        match write_atomically(p, &self.doc) {
            Ok(()) => self.saved = self.doc.clone(),
            Err(e) => {
                tracing::warn!(path = %p.display(), error = %e, "cannot write the GPU state file")
            }
        }
    }
}

/// `NVML_GPU_RECOVERY_ACTION_NONE`.
pub const RECOVERY_NONE: u32 = 0;

fn write_atomically(p: &Path, doc: &GpuStateDoc) -> std::io::Result<()> {
    let bytes = serde_json::to_vec_pretty(doc).map_err(std::io::Error::other)?;
    let tmp = p.with_extension("json.tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, p)
}

fn set_aside(p: &Path, why: &str) {
    let bad = p.with_extension("json.bad");
    tracing::warn!(path = %p.display(), why, "the GPU state file is not usable; set aside, starting without it");
    let _ = std::fs::rename(p, bad);
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn ev(xid: u64, ms: u64) -> XidEvent {
        XidEvent {
            xid: Some(xid),
            at: SystemTime::UNIX_EPOCH + Duration::from_millis(ms),
            gpu_instance: None,
            compute_instance: None,
            mig_uuid: None,
        }
    }

    fn seen(n: u32) -> Vec<(u32, String, Option<String>)> {
        (0..n).map(|i| (i, format!("GPU-{i}"), None)).collect()
    }

    #[test]
    fn inventory_latches_reboot_and_reset() {
        let dir = tempfile::tempdir().unwrap();
        let boot = dir.path().join("boot_id");
        std::fs::write(&boot, "b1\n").unwrap();
        let mut m = GpuMemory::load(Some(dir.path()), &boot);
        assert!(m.enumerate(&seen(8), true).is_empty());
        let judged = m.latch("GPU-3", &[ev(79, 1000), ev(13, 1001)], |e| {
            e.xid == Some(79)
        });
        assert_eq!(judged.len(), 2);
        m.save();
        // an agent restart: same boot, 7 of 8 GPUs
        let mut m = GpuMemory::load(Some(dir.path()), &boot);
        let missing = m.enumerate(&seen(7), true);
        assert_eq!(missing.len(), 1);
        assert_eq!(missing[0].0, "GPU-7");
        let judged = m.latch("GPU-3", &[], |_| true);
        assert_eq!(judged, vec![ev(79, 1000)]);
        // a reset seen through the recovery action clears the latch
        assert!(!m.recovery_action("GPU-3", Some(1), SystemTime::now()));
        assert!(m.recovery_action("GPU-3", Some(RECOVERY_NONE), SystemTime::now()));
        assert!(m.latch("GPU-3", &[ev(79, 1000)], |_| true).is_empty());
        // a reboot clears every latch and re-takes the inventory
        let mut m = GpuMemory::load(Some(dir.path()), &boot);
        m.latch("GPU-1", &[ev(48, 5)], |_| true);
        m.save();
        std::fs::write(&boot, "b2\n").unwrap();
        let mut m = GpuMemory::load(Some(dir.path()), &boot);
        assert!(m.latch("GPU-1", &[], |_| true).is_empty());
        let mut replaced = seen(7);
        replaced.push((7, "GPU-new".into(), None));
        assert!(m.enumerate(&replaced, true).is_empty());
        assert!(!m.doc.gpus.contains_key("GPU-7"));
        // a broken file is set aside, not a panic
        m.save();
        std::fs::write(dir.path().join(GPU_STATE_FILE), "{not json").unwrap();
        let m = GpuMemory::load(Some(dir.path()), &boot);
        assert!(m.doc.gpus.is_empty());
        assert!(dir.path().join("gpu-state.json.bad").exists());
    }
}
