//! State shared by the controller's services: the prefix index, the node registry, metrics.

use parking_lot::{Mutex, RwLock};

use crate::index::PrefixIndex;
use crate::ingest::registry::NodeRegistry;
use crate::metrics::ControllerMetrics;

/// Lookup defaults until a CachePolicy says otherwise (spec 000: CachePolicy.spec).
#[derive(Debug, Clone, Copy, Default)]
pub struct LookupPolicy {
    /// Matches shorter than this answer NO_HINT.
    pub minimum_prefix_tokens: u32,
}

/// Everything the gRPC and HTTP services share. Cheap to share behind an `Arc`.
pub struct Shared {
    /// The KV-prefix index.
    pub index: RwLock<PrefixIndex>,
    /// Connected agents and their reports.
    pub nodes: Mutex<NodeRegistry>,
    /// Metrics registry.
    pub metrics: ControllerMetrics,
    /// Lookup defaults.
    pub policy: LookupPolicy,
    /// Set to true when the controller shuts down: open agent streams end with `Unavailable`
    /// so servers can drain.
    pub stopping: tokio::sync::watch::Sender<bool>,
    /// Bumped whenever an agent connects, disconnects or reports checks; the CacheNode and
    /// advisory writers wake on it ([`Shared::node_changes`]).
    pub node_events: tokio::sync::watch::Sender<u64>,
}

impl Shared {
    /// Empty state with fresh metrics.
    pub fn new(policy: LookupPolicy) -> Result<Self, prometheus::Error> {
        Ok(Shared {
            index: RwLock::new(PrefixIndex::new()),
            nodes: Mutex::new(NodeRegistry::default()),
            metrics: ControllerMetrics::new()?,
            policy,
            stopping: tokio::sync::watch::Sender::new(false),
            node_events: tokio::sync::watch::Sender::new(0),
        })
    }

    /// Signals that node state changed (connect, disconnect, check report).
    pub fn notify_node_change(&self) {
        self.node_events.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A receiver that changes on every [`Shared::notify_node_change`].
    pub fn node_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.node_events.subscribe()
    }

    /// Refreshes the index gauges (call after a write).
    pub fn update_index_gauges(&self, index: &PrefixIndex) {
        self.metrics.index_entries.set(index.entry_count() as i64);
        self.metrics.index_blocks.set(index.block_count() as i64);
        self.metrics
            .index_replicas
            .set(index.replica_count() as i64);
        for (state, n) in index.coverage_counts() {
            self.metrics
                .index_replicas_by_coverage
                .with_label_values(&[state.as_str()])
                .set(n as i64);
        }
    }
}

pub use ic_shared::now_unix_ms;
