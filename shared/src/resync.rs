//! Resyncs of any size over `AgentService.Connect` (`docs/grpc.md` "Resync chunks").
//!
//! gRPC refuses a message above the receiver's limit (4 MiB by default) and the stream then ends
//! with nothing applied — one 8-GPU node's HBM cache is ≈ 280 000 entries, about that size. So
//! the agent splits a large resync with [`chunk_resync`] into `ResyncChunk` messages of at most
//! [`CHUNK_BUDGET_BYTES`] encoded each (a stream larger than that is split across chunks), and
//! the controller puts them back together with [`ResyncAssembler`], applying them as one resync
//! when the last arrives. Both sides use this one definition.

use std::collections::BTreeMap;

use prost::Message;
use thiserror::Error;

use crate::proto::{agent_message::Msg, AgentMessage, Resync, ResyncChunk, StreamSnapshot};

/// Most encoded bytes of entries per chunk (64 KiB, ≈ 4 000 entries). Well under gRPC's default
/// 4 MiB message limit (the controller accepts 8 MiB), and small on purpose: tonic's decoder keeps, per connection, a buffer as large as
/// the largest message it has read, for the connection's life — with 2 MiB chunks a controller
/// holding 5 000 agents kept ≈ 2 GiB of such buffers after their opening resyncs
/// (docs/scaling.md "Memory"); with 64 KiB it is ≈ 0.3 GiB. The per-chunk cost (a descriptor
/// and one message decode) is negligible at this size.
pub const CHUNK_BUDGET_BYTES: usize = 64 * 1024;

/// The messages that carry `streams`: one `Resync` when it fits in [`CHUNK_BUDGET_BYTES`], else
/// `ResyncChunk`s numbered from 0, the last one flagged.
pub fn chunk_resync(streams: Vec<StreamSnapshot>) -> Vec<AgentMessage> {
    chunk_resync_with(streams, CHUNK_BUDGET_BYTES)
}

/// [`chunk_resync`] with an explicit budget (tests).
pub fn chunk_resync_with(streams: Vec<StreamSnapshot>, budget: usize) -> Vec<AgentMessage> {
    let total: usize = streams.iter().map(Message::encoded_len).sum();
    if total <= budget {
        return vec![AgentMessage {
            msg: Some(Msg::Resync(Resync { streams })),
        }];
    }
    let mut chunks: Vec<Vec<StreamSnapshot>> = vec![Vec::new()];
    let mut used = 0usize;
    for mut snap in streams {
        let entries = std::mem::take(&mut snap.entries);
        let head = snap.encoded_len();
        if used > 0 && used + head > budget {
            chunks.push(Vec::new());
            used = 0;
        }
        // The descriptor alone, then entries until the budget is spent; the rest goes on as
        // further pieces of the same stream in later chunks.
        let mut piece = snap.clone();
        used += head;
        for e in entries {
            let n = e.encoded_len() + 2;
            if used + n > budget && !piece.entries.is_empty() {
                if let Some(c) = chunks.last_mut() {
                    c.push(std::mem::replace(&mut piece, snap.clone()));
                }
                chunks.push(Vec::new());
                used = head;
            }
            used += n;
            piece.entries.push(e);
        }
        if let Some(c) = chunks.last_mut() {
            c.push(piece);
        }
    }
    let n = chunks.len();
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, streams)| AgentMessage {
            msg: Some(Msg::ResyncChunk(ResyncChunk {
                chunk: i as u32,
                last: i + 1 == n,
                streams,
            })),
        })
        .collect()
}

/// Why a chunk was refused; the partial resync is discarded.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum AssembleError {
    /// A chunk number other than the next one (a chunk was lost or the agent restarted).
    #[error("resync chunk {got} arrived, expected {expected}")]
    OutOfOrder {
        /// Next chunk number expected.
        expected: u32,
        /// Chunk number received.
        got: u32,
    },
    /// More entries than the controller accepts for one node.
    #[error("resync larger than {max} entries")]
    TooLarge {
        /// The limit.
        max: usize,
    },
}

/// Puts `ResyncChunk`s back together (controller side). Pieces of one stream are merged.
#[derive(Debug)]
pub struct ResyncAssembler {
    next: u32,
    entries: usize,
    max_entries: usize,
    order: Vec<String>,
    streams: BTreeMap<String, StreamSnapshot>,
}

impl ResyncAssembler {
    /// An empty assembler that refuses resyncs of more than `max_entries` entries in all.
    pub fn new(max_entries: usize) -> Self {
        ResyncAssembler {
            next: 0,
            entries: 0,
            max_entries,
            order: Vec::new(),
            streams: BTreeMap::new(),
        }
    }

    /// True while chunks of an unfinished resync are held.
    pub fn in_progress(&self) -> bool {
        self.next > 0
    }

    /// Discards a partial resync.
    pub fn reset(&mut self) {
        self.next = 0;
        self.entries = 0;
        self.order.clear();
        self.streams.clear();
    }

    /// Takes one chunk: `Ok(Some(streams))` when it was the last (the whole resync, streams in
    /// the order they first appeared), `Ok(None)` while more are due.
    ///
    /// # Errors
    /// [`AssembleError`]; the partial resync is discarded.
    pub fn push(
        &mut self,
        chunk: ResyncChunk,
    ) -> Result<Option<Vec<StreamSnapshot>>, AssembleError> {
        if chunk.chunk != self.next {
            let expected = self.next;
            self.reset();
            return Err(AssembleError::OutOfOrder {
                expected,
                got: chunk.chunk,
            });
        }
        self.next += 1;
        for s in chunk.streams {
            self.entries = self.entries.saturating_add(s.entries.len());
            if self.entries > self.max_entries {
                self.reset();
                return Err(AssembleError::TooLarge {
                    max: self.max_entries,
                });
            }
            let id = s
                .stream
                .as_ref()
                .map(|d| d.stream_id.clone())
                .unwrap_or_default();
            match self.streams.get_mut(&id) {
                Some(have) => have.entries.extend(s.entries),
                None => {
                    self.order.push(id.clone());
                    self.streams.insert(id, s);
                }
            }
        }
        if !chunk.last {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(self.order.len());
        for id in std::mem::take(&mut self.order) {
            if let Some(s) = self.streams.remove(&id) {
                out.push(s);
            }
        }
        self.reset();
        Ok(Some(out))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::proto::{BlockEntry, StreamDescriptor};

    fn snap(id: &str, n: u64) -> StreamSnapshot {
        StreamSnapshot {
            stream: Some(StreamDescriptor {
                stream_id: id.into(),
                ..Default::default()
            }),
            seq: 3,
            entries: (0..n)
                .map(|k| BlockEntry {
                    adapter: String::new(),
                    block_size: 16,
                    content_key: k,
                    tier: 1,
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn small_resyncs_stay_one_message_and_large_ones_round_trip() {
        let one = chunk_resync(vec![snap("a", 10)]);
        assert!(matches!(
            one[..],
            [AgentMessage {
                msg: Some(Msg::Resync(_))
            }]
        ));

        // 1 M entries on one node: every chunk within the budget, all of it back in order.
        let streams = vec![snap("a", 700_000), snap("b", 300_000)];
        let msgs = chunk_resync(streams.clone());
        assert!(msgs.len() > 4);
        let mut asm = ResyncAssembler::new(2_000_000);
        let mut done = None;
        for m in msgs {
            assert!(
                m.encoded_len() <= CHUNK_BUDGET_BYTES + 1024,
                "{}",
                m.encoded_len()
            );
            let Some(Msg::ResyncChunk(c)) = m.msg else {
                panic!("expected chunks")
            };
            done = asm.push(c).unwrap();
        }
        assert_eq!(done.unwrap(), streams);
        assert!(!asm.in_progress());
    }

    #[test]
    fn out_of_order_and_oversized_chunks_are_refused() {
        let msgs = chunk_resync_with(vec![snap("a", 100)], 200);
        let chunks: Vec<ResyncChunk> = msgs
            .into_iter()
            .filter_map(|m| match m.msg {
                Some(Msg::ResyncChunk(c)) => Some(c),
                _ => None,
            })
            .collect();
        assert!(chunks.len() >= 3);
        let mut asm = ResyncAssembler::new(1_000);
        asm.push(chunks[0].clone()).unwrap();
        assert_eq!(
            asm.push(chunks[2].clone()),
            Err(AssembleError::OutOfOrder {
                expected: 1,
                got: 2
            })
        );
        assert!(!asm.in_progress());
        let mut small = ResyncAssembler::new(5);
        assert!(matches!(
            small.push(chunks[0].clone()),
            Err(AssembleError::TooLarge { max: 5 })
        ));
    }
}
