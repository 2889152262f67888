//! Stream state that survives the agent (`docs/kv-events.md` "Agent restarts").
//!
//! A DaemonSet rolling upgrade restarts every agent while its engines keep running — usually for
//! longer than the engines' replay buffers reach back. So the agent keeps each stream's state
//! (engine hash → content key, copies per block, parked blocks, last seq and its payload digest,
//! coverage facts) in a node-local directory (`--state-dir`; the chart mounts a hostPath under
//! `/var/lib/inference-cache`) and, when it starts again, resumes each stream from there: the
//! first connection replays from the kept last seq, whose digest proves the engine is still the
//! same incarnation, and applies only what happened since.
//!
//! - One file per stream, `<xxh3 of the stream id, hex>.kvstate`: CBOR of [`StateFile`]
//!   (format [`FORMAT_VERSION`]), written to a temporary file, fsynced, then renamed over the
//!   old one (a crash leaves the old or the new file, never half of one).
//! - A file is used only if its stream id and *identity* ([`StreamIdentity`], versioned and
//!   explicit: the descriptor's identity fields, endpoint, replay endpoint, topic and the plan
//!   facts that change what is indexed) match the planned stream; anything else — a changed plan,
//!   an unknown format, a corrupt or oversized file — is discarded with a WARN naming what
//!   differs, and the stream starts fresh (Partial `BootstrapIncomplete` if the engine is older
//!   than its buffer). Fields of the spec outside the identity (limits, the backend name, fields a
//!   later build adds) do not discard a kept state. Files of format 1 (agents before the
//!   identity: a hash of the spec's debug text) are still read, checked against that hash, and
//!   written back as format 2.
//! - Files are written every [`SAVE_INTERVAL`] for streams that changed (so `kill -9` loses at
//!   most that much, which the replay from the kept seq recovers), and for every stream on
//!   shutdown (SIGTERM). A stream the plan drops has its file deleted.
//! - Bounded: a file larger than [`MAX_FILE_BYTES`] is neither written nor read.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64;

use super::stream::persisted::PersistedState;
use super::stream::StreamState;
use super::subscriber::StreamSpec;

/// Version of [`StateFile`] written: 2, with an explicit [`StreamIdentity`]. Format 1 files
/// ([`LEGACY_FORMAT`]) are read too; any other version is discarded.
pub const FORMAT_VERSION: u32 = 2;
/// The format of agents before [`StreamIdentity`]: the spec was identified by
/// [`legacy_fingerprint`].
pub const LEGACY_FORMAT: u32 = 1;
/// Version of [`StreamIdentity`]'s meaning; a file kept under another is discarded. Bump it only
/// when a field's meaning changes (a new field with a serde default does not need it).
pub const IDENTITY_VERSION: u32 = 1;
/// Most bytes a state file may have (1 GiB; a 1 M-block stream is ≈ 60 MB).
pub const MAX_FILE_BYTES: u64 = 1 << 30;
/// How often changed streams are saved.
pub const SAVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// One stream's file.
#[derive(Debug, Serialize, Deserialize)]
pub struct StateFile {
    /// [`FORMAT_VERSION`].
    pub format: u32,
    /// The stream id (`<namespace>/<pod>#<rank>`).
    pub stream_id: String,
    /// Format 1 only: [`legacy_fingerprint`] of the spec the state belongs to (0 in format 2).
    #[serde(default)]
    pub fingerprint: u64,
    /// Format 2: the identity of the stream the state belongs to.
    #[serde(default)]
    pub identity: Option<StreamIdentity>,
    /// Unix ms of the save.
    pub saved_unix_ms: i64,
    /// The state.
    pub state: PersistedState,
}

/// Why a state file could not be used or written.
#[derive(Debug, Error)]
pub enum PersistError {
    /// Reading, writing or renaming failed.
    #[error("{path}: {source}")]
    Io {
        /// File.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The file is not CBOR of a [`StateFile`].
    #[error("{path}: not a state file: {message}")]
    Corrupt {
        /// File.
        path: PathBuf,
        /// Decoder message.
        message: String,
    },
    /// The file belongs to another format, stream or plan.
    #[error("{path}: {why}")]
    Mismatch {
        /// File.
        path: PathBuf,
        /// What differs.
        why: String,
    },
    /// Larger than [`MAX_FILE_BYTES`].
    #[error("{path}: {bytes} bytes, more than {MAX_FILE_BYTES}")]
    TooLarge {
        /// File.
        path: PathBuf,
        /// Its size.
        bytes: u64,
    },
}

/// What makes a kept state valid for a planned stream: the same engine publisher followed the
/// same way. Explicit fields (never a debug rendering), so a field added to [`StreamSpec`] does
/// not discard every node's kept state at the next upgrade; a field added here needs a serde
/// default that reads an older file as it was meant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamIdentity {
    /// [`IDENTITY_VERSION`] when written.
    pub version: u32,
    /// `<namespace>/<pod>#<rank>`.
    pub stream_id: String,
    /// Replica id in routing answers.
    pub replica: String,
    /// Tenant (the pod's namespace).
    pub tenant: String,
    /// Model of the index partition.
    pub model: String,
    /// `vllm` or `sglang`: how engine hashes and events are read.
    pub hash_scheme: String,
    /// The descriptor's data-parallel rank.
    pub dp_rank: u32,
    /// PUB endpoint.
    pub endpoint: String,
    /// Replay ROUTER endpoint.
    pub replay_endpoint: Option<String>,
    /// Topic prefix subscribed to.
    pub topic: String,
    /// GPU removals demote to T2 (plan `keepsL2`): changes the tiers held.
    pub keeps_l2: bool,
    /// The plan's block size, tokens: changes what is indexed.
    pub block_size: u32,
    /// The plan's rank batches are checked against.
    pub plan_dp_rank: Option<u32>,
}

impl StreamIdentity {
    /// The identity of `spec` (version [`IDENTITY_VERSION`]).
    pub fn of(spec: &StreamSpec) -> Self {
        let d = &spec.descriptor;
        StreamIdentity {
            version: IDENTITY_VERSION,
            stream_id: d.stream_id.clone(),
            replica: d.replica.clone(),
            tenant: d.tenant.clone(),
            model: d.model.clone(),
            hash_scheme: d.hash_scheme.clone(),
            dp_rank: d.dp_rank,
            endpoint: spec.endpoint.clone(),
            replay_endpoint: spec.replay_endpoint.clone(),
            topic: spec.topic.clone(),
            keeps_l2: spec.config.keeps_l2,
            block_size: spec.config.block_size,
            plan_dp_rank: spec.config.dp_rank,
        }
    }

    /// The first field in which `self` (kept) differs from `planned`, with both values.
    pub fn differs(&self, planned: &StreamIdentity) -> Option<String> {
        macro_rules! field {
            ($($f:ident),*) => {
                $(if self.$f != planned.$f {
                    return Some(format!(
                        "{} kept as {:?}, planned as {:?}",
                        stringify!($f),
                        self.$f,
                        planned.$f
                    ));
                })*
            };
        }
        field!(
            version,
            stream_id,
            replica,
            tenant,
            model,
            hash_scheme,
            dp_rank,
            endpoint,
            replay_endpoint,
            topic,
            keeps_l2,
            block_size,
            plan_dp_rank
        );
        None
    }
}

/// How agents before [`StreamIdentity`] (format 1) identified a spec: xxh3 of its debug text,
/// as that build rendered it. The text is rendered from [`format1`]'s frozen copy of the
/// format-1 types, so a field added to today's spec, descriptor or config (e.g.
/// `StreamDescriptor.offload_chunk_tokens`) does not make an older agent's file unreadable.
pub fn legacy_fingerprint(spec: &StreamSpec) -> u64 {
    xxh3_64(format!("{:?}", format1::StreamSpec::from(spec)).as_bytes())
}

/// The spec types as the format-1 agent (commit 7a5d494) declared them: same names, fields and
/// order, so their derived `Debug` text is that agent's. Never add a field here.
// The fields are read only by the derived `Debug`, which the dead-code lint does not count.
#[allow(dead_code)]
mod format1 {
    #[derive(Debug)]
    pub struct StreamSpec<'a> {
        pub descriptor: StreamDescriptor<'a>,
        pub endpoint: &'a str,
        pub replay_endpoint: Option<&'a str>,
        pub topic: &'a str,
        pub config: StreamConfig,
    }

    #[derive(Debug)]
    pub struct StreamDescriptor<'a> {
        pub stream_id: &'a str,
        pub replica: &'a str,
        pub dp_rank: u32,
        pub tenant: &'a str,
        pub model: &'a str,
        pub hash_scheme: &'a str,
        pub backend: &'a str,
        pub node: &'a str,
    }

    #[derive(Debug)]
    pub struct StreamConfig {
        pub keeps_l2: bool,
        pub block_size: u32,
        pub max_orphans: usize,
        pub max_tombstones: usize,
        pub max_pending_keys: usize,
        pub dp_rank: Option<u32>,
    }

    impl<'a> From<&'a super::StreamSpec> for StreamSpec<'a> {
        fn from(s: &'a super::StreamSpec) -> Self {
            let d = &s.descriptor;
            let c = &s.config;
            StreamSpec {
                descriptor: StreamDescriptor {
                    stream_id: &d.stream_id,
                    replica: &d.replica,
                    dp_rank: d.dp_rank,
                    tenant: &d.tenant,
                    model: &d.model,
                    hash_scheme: &d.hash_scheme,
                    backend: &d.backend,
                    node: &d.node,
                },
                endpoint: &s.endpoint,
                replay_endpoint: s.replay_endpoint.as_deref(),
                topic: &s.topic,
                config: StreamConfig {
                    keeps_l2: c.keeps_l2,
                    block_size: c.block_size,
                    max_orphans: c.max_orphans,
                    max_tombstones: c.max_tombstones,
                    max_pending_keys: c.max_pending_keys,
                    dp_rank: c.dp_rank,
                },
            }
        }
    }
}

/// The agent's state directory.
#[derive(Debug, Clone)]
pub struct StateDir {
    dir: PathBuf,
}

impl StateDir {
    /// Uses (and creates, mode 0700) `dir`.
    ///
    /// # Errors
    /// When the directory cannot be created.
    pub fn open(dir: &Path) -> Result<Self, PersistError> {
        std::fs::create_dir_all(dir).map_err(|source| PersistError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
        }
        Ok(StateDir {
            dir: dir.to_path_buf(),
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The file of `stream_id`.
    pub fn file_of(&self, stream_id: &str) -> PathBuf {
        self.dir
            .join(format!("{:016x}.kvstate", xxh3_64(stream_id.as_bytes())))
    }

    /// Loads the kept state of `spec`'s stream. `Ok(None)` when there is none.
    ///
    /// # Errors
    /// A file that exists but cannot be used ([`PersistError`]); the caller discards it.
    pub fn load(&self, spec: &StreamSpec) -> Result<Option<StreamState>, PersistError> {
        let path = self.file_of(&spec.descriptor.stream_id);
        let meta = match std::fs::metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(PersistError::Io { path, source }),
        };
        if meta.len() > MAX_FILE_BYTES {
            return Err(PersistError::TooLarge {
                path,
                bytes: meta.len(),
            });
        }
        let bytes = std::fs::read(&path).map_err(|source| PersistError::Io {
            path: path.clone(),
            source,
        })?;
        let file: StateFile =
            ciborium::from_reader(bytes.as_slice()).map_err(|e| PersistError::Corrupt {
                path: path.clone(),
                message: e.to_string(),
            })?;
        let why = if file.stream_id != spec.descriptor.stream_id {
            Some(format!("belongs to stream {}", file.stream_id))
        } else if file.format == LEGACY_FORMAT {
            (file.fingerprint != legacy_fingerprint(spec)).then(|| {
                "kept by an older agent (format 1) for another plan of this stream, or one whose \
                 spec it rendered differently"
                    .to_string()
            })
        } else if file.format == FORMAT_VERSION {
            match &file.identity {
                None => Some("format 2 without an identity".into()),
                Some(kept) => kept
                    .differs(&StreamIdentity::of(spec))
                    .map(|d| format!("kept for another plan of this stream: {d}")),
            }
        } else {
            Some(format!(
                "format {} (this agent reads {LEGACY_FORMAT} and {FORMAT_VERSION})",
                file.format
            ))
        };
        if let Some(why) = why {
            return Err(PersistError::Mismatch { path, why });
        }
        StreamState::from_persisted(spec.config.clone(), file.state)
            .map(Some)
            .ok_or_else(|| PersistError::Corrupt {
                path,
                message: "records contradict each other (unknown adapters, or an anchor that is not the last seq)".into(),
            })
    }

    /// Writes `state` as `spec`'s kept state (atomically). Returns the bytes written.
    ///
    /// # Errors
    /// I/O errors, or a state above [`MAX_FILE_BYTES`].
    pub fn save(&self, spec: &StreamSpec, state: PersistedState) -> Result<u64, PersistError> {
        let path = self.file_of(&spec.descriptor.stream_id);
        let file = StateFile {
            format: FORMAT_VERSION,
            stream_id: spec.descriptor.stream_id.clone(),
            fingerprint: 0,
            identity: Some(StreamIdentity::of(spec)),
            saved_unix_ms: ic_shared::now_unix_ms(),
            state,
        };
        let mut bytes = Vec::new();
        ciborium::into_writer(&file, &mut bytes).map_err(|e| PersistError::Corrupt {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let n = bytes.len() as u64;
        if n > MAX_FILE_BYTES {
            return Err(PersistError::TooLarge { path, bytes: n });
        }
        let tmp = path.with_extension("kvstate.tmp");
        let io = |source| PersistError::Io {
            path: tmp.clone(),
            source,
        };
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        f.write_all(&bytes).map_err(io)?;
        f.sync_all().map_err(io)?;
        drop(f);
        std::fs::rename(&tmp, &path).map_err(|source| PersistError::Io {
            path: path.clone(),
            source,
        })?;
        Ok(n)
    }

    /// Deletes the kept state of `stream_id` (the plan dropped the stream, or it is unusable).
    pub fn remove(&self, stream_id: &str) {
        let _ = std::fs::remove_file(self.file_of(stream_id));
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::kv::stream::StreamConfig;
    use ic_shared::kv::decode::{BlockStored, EventBatch, KvEvent};
    use ic_shared::proto::StreamDescriptor;

    fn spec(endpoint: &str) -> StreamSpec {
        StreamSpec {
            descriptor: StreamDescriptor {
                stream_id: "ns/pod#0".into(),
                ..Default::default()
            },
            endpoint: endpoint.into(),
            replay_endpoint: Some("tcp://127.0.0.1:2".into()),
            topic: String::new(),
            config: StreamConfig::default(),
        }
    }

    fn stored(h: &[u64], parent: Option<u64>, t: std::ops::Range<u32>, lora: &str) -> KvEvent {
        KvEvent::BlockStored(BlockStored {
            block_hashes: h.to_vec(),
            parent_block_hash: parent,
            token_ids: t.collect(),
            block_size: 16,
            lora_name: (!lora.is_empty()).then(|| lora.to_string()),
            ..BlockStored::default()
        })
    }

    #[test]
    fn a_kept_state_resumes_exactly_and_refuses_another_plan() {
        let dir = tempfile::tempdir().unwrap();
        let sd = StateDir::open(dir.path()).unwrap();
        let sp = spec("tcp://127.0.0.1:1");
        let mut st = StreamState::new(sp.config.clone());
        let batch = EventBatch {
            ts: 1.0,
            events: vec![
                stored(&[1, 2], None, 0..32, ""),
                stored(&[1], None, 0..16, ""),
                stored(&[9], Some(77), 0..16, "sql"),
                stored(&[5], None, 100..116, "sql"),
            ],
            data_parallel_rank: None,
            skipped: vec![],
        };
        st.apply(41, &batch, 0);
        st.record_digest(41, 0xabc);
        st.take_delta();
        sd.save(&sp, st.to_persisted()).unwrap();

        let mut back = sd.load(&sp).unwrap().unwrap();
        assert_eq!(
            back.to_persisted().blocks.len(),
            st.to_persisted().blocks.len()
        );
        assert_eq!(back.snapshot().1, st.snapshot().1);
        assert_eq!(back.last_digest(), Some((41, 0xabc)));
        assert_eq!(back.orphans(), 1);
        // The resumed state counts copies as before: block 1 has two, so one removal keeps it.
        let rm = EventBatch {
            ts: 2.0,
            events: vec![KvEvent::BlockRemoved(ic_shared::kv::decode::BlockRemoved {
                block_hashes: vec![1],
                ..Default::default()
            })],
            data_parallel_rank: None,
            skipped: vec![],
        };
        back.apply(42, &rm, 0);
        assert_eq!(back.blocks_held(), 3);
        // And the parked block still resolves when its parent arrives.
        back.apply(
            43,
            &EventBatch {
                events: vec![stored(&[77], None, 200..216, "sql")],
                ..rm.clone()
            },
            0,
        );
        assert_eq!(back.orphans(), 0);

        // Another endpoint: another stream as far as the kept state goes.
        match sd.load(&spec("tcp://127.0.0.1:9")) {
            Err(PersistError::Mismatch { why, .. }) => assert!(why.contains("endpoint"), "{why}"),
            other => panic!("{other:?}"),
        }
        // A state whose anchor is not its last seq would replay what it holds: refused.
        let mut torn = st.to_persisted();
        torn.last_digest = Some((40, 0xabc));
        sd.save(&sp, torn).unwrap();
        assert!(matches!(sd.load(&sp), Err(PersistError::Corrupt { .. })));
        // Garbage is refused, not trusted.
        std::fs::write(sd.file_of("ns/pod#0"), b"not cbor").unwrap();
        assert!(matches!(sd.load(&sp), Err(PersistError::Corrupt { .. })));
        sd.remove("ns/pod#0");
        assert!(sd.load(&sp).unwrap().is_none());
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod identity_tests {
    use super::*;
    use crate::kv::stream::StreamConfig;
    use ic_shared::proto::StreamDescriptor;

    /// The spec `testdata/kv-state/format-1.kvstate` was written for (by the agent of commit
    /// 7a5d494, format 1): blocks 1, 2 (tokens 0..32) indexed, block 9 (adapter `sql`) parked
    /// under the unknown parent 77, last seq 41 with digest 0xabc.
    fn fixture_spec() -> StreamSpec {
        StreamSpec {
            descriptor: StreamDescriptor {
                stream_id: "default/vllm-0#0".into(),
                replica: "vllm-0".into(),
                dp_rank: 0,
                tenant: "default".into(),
                model: "m".into(),
                hash_scheme: "vllm".into(),
                backend: "default/cb".into(),
                node: String::new(),
                offload_chunk_tokens: 0,
            },
            endpoint: "tcp://127.0.0.1:5557".into(),
            replay_endpoint: Some("tcp://127.0.0.1:5558".into()),
            topic: String::new(),
            config: StreamConfig {
                keeps_l2: false,
                block_size: 16,
                dp_rank: Some(0),
                ..StreamConfig::default()
            },
        }
    }

    fn fixture_dir() -> (tempfile::TempDir, StateDir) {
        let dir = tempfile::tempdir().unwrap();
        let sd = StateDir::open(dir.path()).unwrap();
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../testdata/kv-state/format-1.kvstate");
        std::fs::copy(&fixture, sd.file_of("default/vllm-0#0")).unwrap();
        (dir, sd)
    }

    #[test]
    fn an_older_agents_state_file_is_resumed_and_rewritten_with_its_identity() {
        let (_dir, sd) = fixture_dir();
        let sp = fixture_spec();
        let st = sd.load(&sp).unwrap().expect("the format 1 file resumes");
        assert_eq!(st.last_digest(), Some((41, 0xabc)));
        assert_eq!(st.blocks_held(), 2);
        assert_eq!(st.orphans(), 1);
        // Saved again, it carries the explicit identity (format 2) and still resumes.
        sd.save(&sp, st.to_persisted()).unwrap();
        let bytes = std::fs::read(sd.file_of("default/vllm-0#0")).unwrap();
        let file: StateFile = ciborium::from_reader(bytes.as_slice()).unwrap();
        assert_eq!(file.format, FORMAT_VERSION);
        assert_eq!(file.identity, Some(StreamIdentity::of(&sp)));
        let back = sd.load(&sp).unwrap().unwrap();
        // Held blocks come out of a map in no fixed order; the set is what must survive.
        let blocks_sorted = |mut p: PersistedState| {
            p.blocks.sort_unstable();
            p
        };
        assert_eq!(
            blocks_sorted(back.to_persisted()),
            blocks_sorted(st.to_persisted())
        );
        // An older agent's file for another plan is refused.
        let (_dir2, sd2) = fixture_dir();
        let mut moved = fixture_spec();
        moved.endpoint = "tcp://127.0.0.1:6000".into();
        assert!(matches!(
            sd2.load(&moved),
            Err(PersistError::Mismatch { .. })
        ));
    }

    #[test]
    fn a_kept_state_survives_changes_outside_the_streams_identity() {
        let dir = tempfile::tempdir().unwrap();
        let sd = StateDir::open(dir.path()).unwrap();
        let sp = fixture_spec();
        let mut st = StreamState::new(sp.config.clone());
        let empty = ic_shared::kv::decode::EventBatch {
            ts: 1.0,
            events: vec![],
            data_parallel_rank: None,
            skipped: vec![],
        };
        st.apply(7, &empty, 0);
        st.record_digest(7, 0x77);
        sd.save(&sp, st.to_persisted()).unwrap();
        // A later build: other limits, another backend name — the same engine stream.
        let mut next = fixture_spec();
        next.config.max_orphans = 1024;
        next.config.max_pending_keys = 10;
        next.descriptor.backend = "default/other".into();
        let back = sd.load(&next).unwrap().expect("resumed");
        assert_eq!(back.last_digest(), Some((7, 0x77)));
        // What changes what the state means is refused, naming the field.
        for (field, change) in [
            (
                "block_size",
                Box::new(|s: &mut StreamSpec| s.config.block_size = 32)
                    as Box<dyn Fn(&mut StreamSpec)>,
            ),
            (
                "keeps_l2",
                Box::new(|s: &mut StreamSpec| s.config.keeps_l2 = true),
            ),
            (
                "topic",
                Box::new(|s: &mut StreamSpec| s.topic = "kv@x".into()),
            ),
            (
                "replay_endpoint",
                Box::new(|s: &mut StreamSpec| s.replay_endpoint = None),
            ),
            (
                "hash_scheme",
                Box::new(|s: &mut StreamSpec| s.descriptor.hash_scheme = "sglang".into()),
            ),
        ] {
            let mut other = fixture_spec();
            change(&mut other);
            match sd.load(&other) {
                Err(PersistError::Mismatch { why, .. }) => {
                    assert!(why.contains(field), "{field}: {why}")
                }
                r => panic!("{field}: {r:?}"),
            }
        }
        // An unknown format is refused.
        let bytes = std::fs::read(sd.file_of("default/vllm-0#0")).unwrap();
        let mut file: StateFile = ciborium::from_reader(bytes.as_slice()).unwrap();
        file.format = 9;
        let mut out = Vec::new();
        ciborium::into_writer(&file, &mut out).unwrap();
        std::fs::write(sd.file_of("default/vllm-0#0"), out).unwrap();
        assert!(matches!(sd.load(&sp), Err(PersistError::Mismatch { .. })));
    }
}
