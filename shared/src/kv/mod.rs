//! Engine KV-cache events and our content keys (`shared/spec/kv-event-wire.md`,
//! `docs/kv-events.md`).
//!
//! - [`decode`]: the msgpack payload of one vLLM/SGLang event batch → [`decode::EventBatch`],
//!   tolerant of every shape the engines have shipped.
//! - [`content_key`]: our own chained hash over a block's token ids, the key of the cluster index.
//!   The agent derives it from engine events, the controller's router from raw prompt tokens.

pub mod content_key;
pub mod decode;

pub use content_key::{block_key, chain, ROOT};
pub use decode::{decode_batch, BlockRemoved, BlockStored, DecodeError, EventBatch, KvEvent};
