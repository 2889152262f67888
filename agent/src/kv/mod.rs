//! Engine KV-event subscribers: ZMQ SUB per engine publisher (pod × data-parallel rank), gap
//! detection and replay, and aggregation of engine events into index deltas keyed by our content
//! keys (`docs/kv-events.md`).
//!
//! - [`hub`]: [`KvHub`], what the link and the HTTP endpoints use.
//! - [`stream`]: the pure per-stream state machine (events → ops).
//! - [`subscriber`]: the socket tasks (SUB reader, processor, replay client).
//! - [`publish`]: a stand-in publisher replaying golden fixture frames (`ic-agent kv publish`).
//! - [`tail`]: follow one publisher and print decoded batches, gaps and replays (`ic-agent kv tail`).
//! - [`inspect`]: read captured frames (hex, JSON, ZMTP dumps) and decode them to JSON
//!   (`ic-agent kv decode`).
//! - [`persist`]: stream state kept on the node across agent restarts.
//! - [`metrics`]: the `inferencecache_agent_kv_*` metric families.
//! - [`zmtp_guard`]: the bounded ZMTP transport every engine connection goes through (frame and
//!   message size limits the `zeromq` crate does not enforce).

pub mod hub;
pub mod inspect;
pub mod metrics;
pub mod persist;
pub mod publish;
pub mod stream;
pub mod subscriber;
pub mod tail;
pub mod zmtp_guard;

pub use hub::{KvHub, StreamStatus};
pub use publish::{
    publish_fixture, publish_fixture_until, Fixture, PublishError, PublishOptions, PublishReport,
};
pub use stream::{StreamConfig, StreamState};
pub use subscriber::SubscriberOptions;
