//! Engine KV-cache events and our content keys (`docs/kv-event-wire.md`,
//! `docs/kv-events.md`).
//!
//! - [`decode`]: the msgpack payload of one vLLM/SGLang event batch → [`decode::EventBatch`],
//!   tolerant of every shape the engines have shipped.
//! - [`content_key`]: our own chained hash over a block's token ids, the key of the cluster index.
//!   The agent derives it from engine events, the controller's router from raw prompt tokens.
//! - [`coverage`]: how far a replica's entries can be trusted (Exact, Healing, Partial, …).

pub mod content_key;
pub mod coverage;
pub mod decode;

pub use content_key::{block_key, chain, ROOT};
pub use coverage::{Coverage, CoverageState};
pub use decode::{decode_batch, BlockRemoved, BlockStored, DecodeError, EventBatch, KvEvent};
