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
//! - A file is used only if its format, stream id and *spec fingerprint* (endpoint, replay
//!   endpoint, topic, identity and plan facts) match the planned stream; anything else — a
//!   changed plan, another version, a corrupt or oversized file — is discarded with a WARN and
//!   the stream starts fresh (Partial `BootstrapIncomplete` if the engine is older than its
//!   buffer).
//! - Files are written every [`SAVE_INTERVAL`] for streams that changed (so `kill -9` loses at
//!   most that much, which the replay from the kept seq recovers), and for every stream on
//!   shutdown (SIGTERM). A stream the plan drops has its file deleted.
//! - Bounded: a file larger than [`MAX_FILE_BYTES`] is neither written nor read.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64;

use super::stream::{PersistedState, StreamState};
use super::subscriber::StreamSpec;

/// Version of [`StateFile`]; files of another version are discarded.
pub const FORMAT_VERSION: u32 = 1;
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
    /// [`fingerprint`] of the spec the state belongs to.
    pub fingerprint: u64,
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

/// A fingerprint of everything that makes a stream what it is: a kept state is valid only for
/// the same spec.
pub fn fingerprint(spec: &StreamSpec) -> u64 {
    xxh3_64(format!("{spec:?}").as_bytes())
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
        let why = if file.format != FORMAT_VERSION {
            Some(format!(
                "format {} (this agent reads {FORMAT_VERSION})",
                file.format
            ))
        } else if file.stream_id != spec.descriptor.stream_id {
            Some(format!("belongs to stream {}", file.stream_id))
        } else if file.fingerprint != fingerprint(spec) {
            Some(
                "kept for another plan of this stream (endpoint, topic or plan facts changed)"
                    .into(),
            )
        } else {
            None
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
            fingerprint: fingerprint(spec),
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
        assert!(matches!(
            sd.load(&spec("tcp://127.0.0.1:9")),
            Err(PersistError::Mismatch { .. })
        ));
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
