//! State shared by the controller's services: the prefix index, the node registry, metrics.

use std::ops::{Deref, DerefMut};
use std::time::Instant;

use parking_lot::{Mutex, RwLock, RwLockUpgradableReadGuard, RwLockWriteGuard};

use crate::index::PrefixIndex;
use crate::ingest::host_tier::HostTierReadings;
use crate::ingest::registry::NodeRegistry;
use crate::metrics::ControllerMetrics;
use crate::tokenize::Tokenizers;

/// Longest a lookup tries the index read lock without parking ([`Shared::index_read_for_lookup`]):
/// about one resync slice's write hold (0.1–0.2 ms typically). A lookup that parks instead waits
/// for a core to wake it on; trying this long at most costs ≤ 0.25 ms of CPU per lookup (a
/// 1 ms spin measured a similar gain but lengthened storms by competing with the slice holder
/// for the cores; docs/scaling.md, issue 41 item 3).
pub const LOOKUP_SPIN: std::time::Duration = std::time::Duration::from_micros(250);

/// Lookup defaults until a CachePolicy says otherwise (spec 000: CachePolicy.spec), and the
/// index's own bounds.
#[derive(Debug, Clone, Copy, Default)]
pub struct LookupPolicy {
    /// Matches shorter than this answer NO_HINT.
    pub minimum_prefix_tokens: u32,
    /// Most blocks one stream may hold (`--max-blocks-per-stream`); `None`: no cap.
    pub max_blocks_per_stream: Option<usize>,
    /// Agent resyncs read and applied at once (`--resync-turns`, `ingest::turns`); `None`:
    /// [`crate::ingest::turns::ResyncTurns::for_this_machine`].
    pub resync_turns: Option<usize>,
    /// How long a session holding a resync turn may receive nothing before the turn goes to
    /// the next session (`--resync-turn-idle-ms`, `ingest::turns`); `None`:
    /// [`crate::ingest::turns::TURN_IDLE`]. Never longer than the resync chunk gap (10 s).
    pub resync_turn_idle: Option<std::time::Duration>,
    /// How long an agent that sends coverage heartbeats may stay unheard before its replicas
    /// read Unknown / `HeartbeatMissed` and are not routed (`--coverage-heartbeat-bound-ms`,
    /// the agent ingest's heartbeat watcher); `None`: [`DEFAULT_COVERAGE_HEARTBEAT_BOUND`].
    pub coverage_heartbeat_bound: Option<std::time::Duration>,
    /// Most distinct streams one reporter (a node agent, a per-pod subscriber) may register in
    /// one resync (`--max-streams-per-reporter`); `None`: [`DEFAULT_MAX_STREAMS_PER_REPORTER`].
    pub max_streams_per_reporter: Option<usize>,
    /// Most block entries one resync (all its chunks together) may carry
    /// (`--max-resync-entries`); `None`: [`DEFAULT_MAX_RESYNC_ENTRIES`].
    pub max_resync_entries: Option<usize>,
    /// Most `AgentService.Connect` streams one source address may have awaiting their Hello at
    /// once (`--agent-max-pending-hellos-per-source`); `None`:
    /// [`crate::ingest::handshake::DEFAULT_MAX_PENDING_HELLOS_PER_SOURCE`].
    pub max_pending_hellos_per_source: Option<usize>,
    /// Budget of a lookup whose tenant has no CachePolicy `lookupTimeoutMs`
    /// (`--lookup-timeout-ms`); `None`: [`DEFAULT_LOOKUP_TIMEOUT`].
    pub lookup_timeout: Option<std::time::Duration>,
}

/// Default of `--max-resync-entries`, the most block entries one reporter's resync may carry
/// (all its chunks together): 2 Mi, twice the largest node we plan for (1 M blocks). Chunks are
/// assembled only while their session holds a resync turn, so at most `--resync-turns` resyncs
/// are assembled at once; docs/security.md "Streams, handshakes and idle connections" has the
/// measured peak of one maximal resync against the chart's 512 Mi memory limit.
pub const DEFAULT_MAX_RESYNC_ENTRIES: usize = 2 * 1024 * 1024;

/// Default of `--max-streams-per-reporter`: 256 streams (a node of 8 engines × 8
/// data-parallel ranks needs 64).
pub const DEFAULT_MAX_STREAMS_PER_REPORTER: usize = 256;

/// Default of `--lookup-timeout-ms`: 1 s. A lookup past it answers NO_HINT / `LookupTimeout`
/// (fail open); issue 38 item 5 measured 8.6 s for one 1 M-token lookup without a budget.
pub const DEFAULT_LOOKUP_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(1000);

impl LookupPolicy {
    /// [`Self::max_streams_per_reporter`] or its default (at least 1).
    pub fn streams_per_reporter(&self) -> usize {
        self.max_streams_per_reporter
            .unwrap_or(DEFAULT_MAX_STREAMS_PER_REPORTER)
            .max(1)
    }

    /// [`Self::max_resync_entries`] or its default (at least 1).
    pub fn resync_entries(&self) -> usize {
        self.max_resync_entries
            .unwrap_or(DEFAULT_MAX_RESYNC_ENTRIES)
            .max(1)
    }

    /// [`Self::max_pending_hellos_per_source`] or its default (at least 1).
    pub fn pending_hellos_per_source(&self) -> usize {
        self.max_pending_hellos_per_source
            .unwrap_or(crate::ingest::handshake::DEFAULT_MAX_PENDING_HELLOS_PER_SOURCE)
            .max(1)
    }

    /// [`Self::coverage_heartbeat_bound`] or its default.
    pub fn heartbeat_bound(&self) -> std::time::Duration {
        self.coverage_heartbeat_bound
            .unwrap_or(DEFAULT_COVERAGE_HEARTBEAT_BOUND)
    }

    /// [`Self::lookup_timeout`] or its default.
    pub fn default_lookup_timeout(&self) -> std::time::Duration {
        self.lookup_timeout.unwrap_or(DEFAULT_LOOKUP_TIMEOUT)
    }
}

/// Default of `--coverage-heartbeat-bound-ms`: 5 s, five agent heartbeat intervals
/// (docs/kv-events.md "Coverage age").
pub const DEFAULT_COVERAGE_HEARTBEAT_BOUND: std::time::Duration = std::time::Duration::from_secs(5);

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
    /// Per-model tokenizers of LookupRoute `prompt_text` (none by default).
    pub tokenizers: std::sync::Arc<Tokenizers>,
    /// The engines' current SGLang HiCache host-tier readings, by stream (always taken after
    /// `index` when both are held).
    pub host_tier: RwLock<HostTierReadings>,
    /// Turns of agent resyncs: how many are read and applied at once (`ingest::turns`).
    pub resync_turns: crate::ingest::turns::ResyncTurns,
    /// True from [`Shared::await_plans`] (in cluster, at start) until this replica first
    /// derived node plans (`reconcile::nodes::record_derived_plans`): meanwhile the index does
    /// not know which streams to expect, so every LookupRoute answer says `IndexIncomplete`.
    pub plans_pending: std::sync::atomic::AtomicBool,
}

impl Shared {
    /// Empty state with fresh metrics.
    pub fn new(policy: LookupPolicy) -> Result<Self, prometheus::Error> {
        let mut index = PrefixIndex::new();
        index.set_max_blocks_per_stream(policy.max_blocks_per_stream.unwrap_or(usize::MAX));
        Ok(Shared {
            index: RwLock::new(index),
            nodes: Mutex::new(NodeRegistry::default()),
            metrics: ControllerMetrics::new()?,
            policy,
            stopping: tokio::sync::watch::Sender::new(false),
            node_events: tokio::sync::watch::Sender::new(0),
            tokenizers: std::sync::Arc::default(),
            host_tier: RwLock::new(HostTierReadings::default()),
            resync_turns: {
                let turns = match policy.resync_turns {
                    Some(n) => crate::ingest::turns::ResyncTurns::new(n),
                    None => crate::ingest::turns::ResyncTurns::for_this_machine(),
                };
                match policy.resync_turn_idle {
                    Some(idle) => turns.with_turn_idle(idle),
                    None => turns,
                }
            },
            plans_pending: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Marks the node plans as not derived yet ([`Shared::plans_pending`]): in cluster the
    /// plans say which streams the index must expect, and until the first derivation a NO_HINT
    /// may be a node whose agent has not resynced.
    pub fn await_plans(self) -> Self {
        self.plans_pending
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self
    }

    /// The same state with other resync turns (tests: one turn, short timings).
    pub fn with_resync_turns(mut self, turns: crate::ingest::turns::ResyncTurns) -> Self {
        self.resync_turns = turns;
        self
    }

    /// The same state with `tokenizers` for LookupRoute `prompt_text`.
    pub fn with_tokenizers(mut self, tokenizers: std::sync::Arc<Tokenizers>) -> Self {
        self.tokenizers = tokenizers;
        self
    }

    /// Signals that node state changed (connect, disconnect, check report).
    pub fn notify_node_change(&self) {
        self.node_events.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A receiver that changes on every [`Shared::notify_node_change`].
    pub fn node_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.node_events.subscribe()
    }

    /// Takes the index write lock for `what`; the hold is timed into
    /// `index_write_hold_seconds{what}` when the returned guard drops (see [`IndexWrite`]).
    pub fn index_write(&self, what: WriteHold) -> IndexWrite<'_> {
        IndexWrite::held(self.index.write(), &self.metrics, what)
    }

    /// The index read lock for a lookup: tried without parking for up to [`LOOKUP_SPIN`] (or
    /// until `deadline`, if sooner), then waited for until `deadline` (`None`: no bound).
    /// `None` when the deadline passed first. A lookup that parks is woken only when a core is
    /// free to run it; one that keeps trying takes the lock the moment a resync slice lets it
    /// go, ahead of writers still parked (docs/scaling.md, issue 41 item 3).
    pub fn index_read_for_lookup(
        &self,
        deadline: Option<Instant>,
    ) -> Option<parking_lot::RwLockReadGuard<'_, PrefixIndex>> {
        let now = Instant::now();
        let spin_until = match deadline {
            Some(d) => d.min(now + LOOKUP_SPIN),
            None => now + LOOKUP_SPIN,
        };
        loop {
            if let Some(g) = self.index.try_read() {
                return Some(g);
            }
            if Instant::now() >= spin_until {
                break;
            }
            for _ in 0..32 {
                std::hint::spin_loop();
            }
        }
        match deadline {
            Some(d) => self.index.try_read_until(d),
            None => Some(self.index.read()),
        }
    }

    /// Upgrades an upgradable read of the index to its write lock for `what`, timed like
    /// [`Shared::index_write`] from the moment the upgrade returns.
    pub fn index_upgrade<'a>(
        &'a self,
        read: RwLockUpgradableReadGuard<'a, PrefixIndex>,
        what: WriteHold,
    ) -> IndexWrite<'a> {
        IndexWrite::held(
            RwLockUpgradableReadGuard::upgrade(read),
            &self.metrics,
            what,
        )
    }

    /// Refreshes the index heap gauge (`index_heap_bytes`) from [`PrefixIndex::heap_bytes`]:
    /// O(replicas) under the read lock, so it runs per `/metrics` scrape, not per write.
    pub fn update_heap_gauges(&self) {
        let h = self.index.read().heap_bytes();
        let g = &self.metrics.index_heap_bytes;
        for (part, v) in [
            ("slots", h.table_slots),
            ("slots_used", h.table_slots_used),
            ("holder_lists", h.holder_lists),
            ("key_vectors", h.key_vectors),
            ("key_vectors_used", h.key_vectors_used),
        ] {
            g.with_label_values(&[part])
                .set(i64::try_from(v).unwrap_or(i64::MAX));
        }
    }

    /// Refreshes the index gauges (call after a write).
    pub fn update_index_gauges(&self, index: &PrefixIndex) {
        self.metrics.index_entries.set(index.entry_count() as i64);
        self.metrics.index_blocks.set(index.block_count() as i64);
        self.metrics
            .index_replicas
            .set(index.replica_count() as i64);
        self.metrics
            .index_planned_streams_absent
            .set(index.planned_streams_absent() as i64);
        for (state, n) in index.coverage_counts() {
            self.metrics
                .index_replicas_by_coverage
                .with_label_values(&[state.as_str()])
                .set(n as i64);
        }
        // The index counts monotonically; the counters follow by the difference.
        for (tenant, n) in index.quota_evictions() {
            let c = self
                .metrics
                .index_quota_evictions_total
                .with_label_values(&[tenant.as_str()]);
            c.inc_by(n.saturating_sub(c.get()));
        }
        let c = &self.metrics.index_stream_cap_refusals_total;
        c.inc_by(index.stream_cap_refusals().saturating_sub(c.get()));
    }
}

pub use ic_shared::now_unix_ms;

pub use crate::metrics::labels::WriteHold;

/// The index write lock, held for one [`WriteHold`]. Dereferences to the index; when it drops,
/// the time since the lock was granted is observed into `index_write_hold_seconds{what}` and
/// the lock is released. A lookup arriving meanwhile waits for the rest of the hold.
pub struct IndexWrite<'a> {
    guard: RwLockWriteGuard<'a, PrefixIndex>,
    held: Instant,
    metrics: &'a ControllerMetrics,
    what: WriteHold,
}

impl<'a> IndexWrite<'a> {
    fn held(
        guard: RwLockWriteGuard<'a, PrefixIndex>,
        metrics: &'a ControllerMetrics,
        what: WriteHold,
    ) -> Self {
        IndexWrite {
            guard,
            held: Instant::now(),
            metrics,
            what,
        }
    }
}

impl Deref for IndexWrite<'_> {
    type Target = PrefixIndex;
    fn deref(&self) -> &PrefixIndex {
        &self.guard
    }
}

impl DerefMut for IndexWrite<'_> {
    fn deref_mut(&mut self) -> &mut PrefixIndex {
        &mut self.guard
    }
}

impl Drop for IndexWrite<'_> {
    fn drop(&mut self) {
        // Observed just before the guard field releases the lock.
        self.metrics
            .index_write_hold_seconds
            .with_label_values(&[self.what.as_str()])
            .observe(self.held.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ic_shared::proto;

    fn desc(tenant: &str, pod: &str) -> proto::StreamDescriptor {
        proto::StreamDescriptor {
            stream_id: format!("{tenant}/{pod}#0"),
            replica: pod.into(),
            tenant: tenant.into(),
            model: "m".into(),
            hash_scheme: "vllm".into(),
            ..Default::default()
        }
    }

    #[test]
    fn quota_evictions_and_cap_refusals_reach_the_metrics() {
        let shared = Shared::new(LookupPolicy {
            minimum_prefix_tokens: 0,
            max_blocks_per_stream: Some(3),
            ..Default::default()
        })
        .unwrap();
        let mut ix = shared.index.write();
        ix.resync_node(
            "n",
            &[proto::StreamSnapshot {
                stream: Some(desc("t", "p")),
                coverage: proto::Coverage::Exact as i32,
                entries: (1..=5)
                    .map(|k| proto::BlockEntry {
                        block_size: 16,
                        content_key: k,
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }],
        );
        ix.set_tenant_quotas(std::collections::HashMap::from([("t".to_string(), 1)]));
        shared.update_index_gauges(&ix);
        // Twice: the counters follow the index, they do not add it up again.
        shared.update_index_gauges(&ix);
        drop(ix);
        let text = shared.metrics.render();
        assert!(
            text.contains("inferencecache_controller_index_stream_cap_refusals_total 2"),
            "{text}"
        );
        assert!(
            text.contains("inferencecache_controller_index_quota_evictions_total{tenant=\"t\"} 2"),
            "{text}"
        );
    }

    #[test]
    fn a_lookup_read_gives_up_at_its_deadline_and_takes_the_lock_once_a_writer_lets_go() {
        let shared = std::sync::Arc::new(Shared::new(LookupPolicy::default()).unwrap());
        // Free: the lock at once, with or without a deadline.
        assert!(shared.index_read_for_lookup(None).is_some());
        assert!(shared
            .index_read_for_lookup(Some(Instant::now() + std::time::Duration::from_millis(5)))
            .is_some());
        let write = shared.index_write(WriteHold::Probe);
        // Held past the deadline (shorter than the spin): nothing, and the writer still holds it.
        let t0 = Instant::now();
        let deadline = t0 + LOOKUP_SPIN / 4;
        assert!(shared.index_read_for_lookup(Some(deadline)).is_none());
        assert!(Instant::now() >= deadline);
        // Held past the deadline (longer than the spin: the park after it times out too).
        assert!(shared
            .index_read_for_lookup(Some(Instant::now() + 3 * LOOKUP_SPIN))
            .is_none());
        // A lookup without a deadline waits — through the spin and the park — for the writer.
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = {
            let shared = shared.clone();
            std::thread::spawn(move || {
                let got = shared.index_read_for_lookup(None).is_some();
                tx.send(got).ok();
            })
        };
        assert!(
            rx.recv_timeout(4 * LOOKUP_SPIN).is_err(),
            "a reader got in while the writer held the lock"
        );
        drop(write);
        assert_eq!(
            rx.recv_timeout(std::time::Duration::from_secs(10)),
            Ok(true)
        );
        reader.join().unwrap();
    }

    #[test]
    fn each_index_write_hold_is_observed_once_under_its_label() {
        let shared = Shared::new(LookupPolicy::default()).unwrap();
        let count = |w: WriteHold| {
            shared
                .metrics
                .index_write_hold_seconds
                .with_label_values(&[w.as_str()])
                .get_sample_count()
        };
        assert!(WriteHold::ALL.iter().all(|w| count(*w) == 0));
        {
            let mut ix = shared.index_write(WriteHold::Probe);
            ix.remove_node("n");
        }
        let read = shared.index.upgradable_read();
        drop(shared.index_upgrade(read, WriteHold::ResyncSlice));
        drop(shared.index_write(WriteHold::Probe));
        for w in WriteHold::ALL {
            let want = match w {
                WriteHold::Probe => 2,
                WriteHold::ResyncSlice => 1,
                _ => 0,
            };
            assert_eq!(count(w), want, "{w:?}");
        }
        // Released: a reader gets the lock.
        assert!(shared.index.try_read().is_some());
        // Every label exists from the start (a dashboard reads 0, not "No data").
        let text = shared.metrics.render();
        for w in WriteHold::ALL {
            assert!(
                text.contains(&format!(
                    "index_write_hold_seconds_count{{what=\"{}\"}}",
                    w.as_str()
                )),
                "{w:?}"
            );
        }
    }
}
