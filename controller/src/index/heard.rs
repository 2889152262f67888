//! When the controller last heard from each reporter (a node agent's stream, or a per-pod
//! subscriber's), on its own monotonic clock: the age of every replica's coverage
//! (docs/kv-events.md "Coverage age", issue 37 item 2).
//!
//! Coverage travels only when it changes, so an agent that hangs (SIGSTOP, a stuck runtime, a
//! wedged node) would leave its replicas Exact for as long as the HTTP/2 keep-alive takes to give
//! up. Agents that announce [`HEARTBEAT_CAPABILITY`] send a `CoverageHeartbeat` every second;
//! each message of a stream stamps its reporter's [`Heard`] (lock-free, no index write). The
//! ingest's watcher (`ingest::heartbeat`) marks a reporter *silent* when it has not been heard
//! for the bound ([`PrefixIndex::heartbeat_transitions`], [`PrefixIndex::set_node_silent`]):
//! its replicas then read Unknown / [`HEARTBEAT_MISSED`] and are not routed, until it is heard
//! again.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use super::PrefixIndex;

/// The `Hello.capabilities` entry of an agent that sends `CoverageHeartbeat`s: only such an
/// agent's replicas are held to the heartbeat bound (an older agent sends none and would read
/// silent whenever its engines are idle).
pub const HEARTBEAT_CAPABILITY: &str = ic_shared::link::COVERAGE_HEARTBEAT;

/// The coverage reason of a silent reporter's replicas (Unknown, not routed).
pub const HEARTBEAT_MISSED: &str = ic_shared::kv::coverage::HEARTBEAT_MISSED;

/// Milliseconds on the controller's monotonic clock (since the first call in this process,
/// plus one so that 0 never names an instant). Never goes back, whatever the wall clock does.
pub fn mono_ms() -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    let base = *BASE.get_or_init(Instant::now);
    u64::try_from(base.elapsed().as_millis())
        .unwrap_or(u64::MAX)
        .saturating_add(1)
}

/// One reporter's "last heard" cell, shared by its ingest session (which stamps it on every
/// message) and the index (which reads it for ages and silence).
#[derive(Debug, Default)]
pub struct Heard {
    /// [`mono_ms`] of the last message; 0 = never.
    at_ms: AtomicU64,
    /// The current stream announced [`HEARTBEAT_CAPABILITY`]: the bound applies.
    enforced: AtomicBool,
    /// The session holds or waits for a resync turn (`ingest::turns`): it reads nothing of the
    /// stream meanwhile (the controller's own doing), so the bound is suspended until
    /// [`Heard::resume`].
    paused: AtomicBool,
    /// Mirror of the index's silent flag for this reporter (written under the index write lock),
    /// so a session learns without a lock that its first message after a silence must lift it.
    silent: AtomicBool,
}

impl Heard {
    /// A new stream of the reporter opened (its Hello is a message): stamps now and records
    /// whether the stream is held to the heartbeat bound.
    pub fn open(&self, enforced: bool) {
        self.enforced.store(enforced, Ordering::Relaxed);
        self.paused.store(false, Ordering::Relaxed);
        self.touch();
    }

    /// The session stops reading the stream to wait for, or apply, a resync turn.
    pub fn pause(&self) {
        self.paused.store(true, Ordering::Relaxed);
    }

    /// The session reads the stream again: the bound runs from now.
    pub fn resume(&self) {
        self.touch();
        self.paused.store(false, Ordering::Relaxed);
    }

    /// A message arrived: stamps [`mono_ms`].
    pub fn touch(&self) {
        self.at_ms.store(mono_ms(), Ordering::Relaxed);
    }

    /// [`mono_ms`] of the last message, `None` before the first.
    pub fn at_ms(&self) -> Option<u64> {
        Some(self.at_ms.load(Ordering::Relaxed)).filter(|t| *t > 0)
    }

    /// Milliseconds since the last message at `now_ms`, `None` before the first.
    pub fn age_ms(&self, now_ms: u64) -> Option<u64> {
        self.at_ms().map(|t| now_ms.saturating_sub(t))
    }

    /// Whether the reporter's stream announced the capability (is held to the bound).
    pub fn enforced(&self) -> bool {
        self.enforced.load(Ordering::Relaxed)
    }

    /// Whether the index reads the reporter's replicas as silent.
    pub fn silent(&self) -> bool {
        self.silent.load(Ordering::Relaxed)
    }

    /// Whether the reporter is past `bound` at `now_ms`: held to the bound, its session
    /// reading, heard before, and not since `bound`.
    fn overdue(&self, now_ms: u64, bound: Duration) -> bool {
        let bound_ms = u64::try_from(bound.as_millis()).unwrap_or(u64::MAX);
        self.enforced()
            && !self.paused.load(Ordering::Relaxed)
            && self.age_ms(now_ms).is_some_and(|age| age > bound_ms)
    }
}

/// A reporter's cell and whether the index reads it silent.
#[derive(Debug, Default)]
pub(super) struct NodeHeard {
    pub(super) cell: Arc<Heard>,
    pub(super) silent: bool,
}

impl PrefixIndex {
    /// The "last heard" cell of reporter `node` (a node name, or a subscriber's
    /// `<node>/<namespace>/<pod>`), created on first use. Its ingest session stamps it.
    pub fn heard_cell(&mut self, node: &str) -> Arc<Heard> {
        self.heard.entry(node.to_string()).or_default().cell.clone()
    }

    /// The reporters whose silence should change at `now_ms` ([`mono_ms`]) under `bound`:
    /// `(node, true)` for one overdue and not yet silent, `(node, false)` for one silent and
    /// heard since (or no longer held to the bound). O(reporters), atomics only: called under
    /// the read lock by the watcher, which applies them with [`Self::set_node_silent`].
    pub fn heartbeat_transitions(&self, now_ms: u64, bound: Duration) -> Vec<(String, bool)> {
        self.heard
            .iter()
            .filter_map(|(node, h)| {
                let overdue = h.cell.overdue(now_ms, bound);
                (overdue != h.silent).then(|| (node.clone(), overdue))
            })
            .collect()
    }

    /// Reads every replica of reporter `node` silent (Unknown / [`HEARTBEAT_MISSED`], not
    /// routed) or lifts that. `silent = true` is re-checked against `bound` at `now_ms` (the
    /// reporter may have been heard since the watcher looked) and is then a no-op. Returns the
    /// number of replicas whose reading changed.
    pub fn set_node_silent(
        &mut self,
        node: &str,
        silent: bool,
        now_ms: u64,
        bound: Duration,
    ) -> usize {
        let Some(h) = self.heard.get_mut(node) else {
            return 0;
        };
        if silent && !h.cell.overdue(now_ms, bound) {
            return 0;
        }
        if h.silent == silent {
            return 0;
        }
        h.silent = silent;
        h.cell.silent.store(silent, Ordering::Relaxed);
        let slots = self.slots_of_node(node, |_| true);
        let mut changed = 0;
        for s in slots {
            if self.set_silent(s, silent) {
                changed += 1;
            }
        }
        changed
    }

    /// Whether reporter `node`'s replicas read silent now.
    pub fn node_silent(&self, node: &str) -> bool {
        self.heard.get(node).is_some_and(|h| h.silent)
    }

    /// [`mono_ms`] when reporter `node` was last heard (`None`: not since this controller
    /// started).
    pub fn heard_at_ms(&self, node: &str) -> Option<u64> {
        self.heard.get(node).and_then(|h| h.cell.at_ms())
    }

    /// Forgets reporter `node`'s cell (its replicas expired).
    pub(super) fn forget_heard(&mut self, node: &str) {
        self.heard.remove(node);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::index::LookupQuery;
    use ic_shared::kv::coverage::CoverageState;
    use ic_shared::proto;

    const KEY: u64 = 0xabc;
    const BOUND: Duration = Duration::from_secs(5);

    fn exact(pod: &str) -> proto::StreamSnapshot {
        proto::StreamSnapshot {
            stream: Some(proto::StreamDescriptor {
                stream_id: format!("ns/{pod}#0"),
                replica: pod.into(),
                tenant: "ns".into(),
                model: "m".into(),
                hash_scheme: "vllm".into(),
                ..Default::default()
            }),
            entries: vec![proto::BlockEntry {
                block_size: 16,
                content_key: KEY,
                tier: proto::Tier::T1 as i32,
                ..Default::default()
            }],
            coverage: proto::Coverage::Exact as i32,
            ..Default::default()
        }
    }

    fn matched(ix: &PrefixIndex) -> Vec<(String, CoverageState)> {
        ix.lookup(&LookupQuery {
            content_keys: vec![KEY],
            block_size: Some(16),
            ..Default::default()
        })
        .replicas
        .iter()
        .map(|m| (m.replica().to_string(), m.coverage.state))
        .collect()
    }

    /// A reporter past the bound reads Unknown / HeartbeatMissed, unrouted, its entries kept,
    /// in lookups, `/snapshot` and the coverage gauge; heard again it reads what it reported.
    #[test]
    fn a_silent_reporter_is_unrouted_until_heard_again() {
        let mut ix = PrefixIndex::new();
        ix.resync_node("n1", &[exact("a")]);
        ix.resync_node("n2", &[exact("b")]);
        let a = ix.heard_cell("n1");
        a.open(true);
        let b = ix.heard_cell("n2");
        b.open(true);
        let at = a.at_ms().unwrap().max(b.at_ms().unwrap());
        assert!(ix.heartbeat_transitions(at, BOUND).is_empty());
        let bound_ms = BOUND.as_millis() as u64;
        // n2 is heard later than n1: only n1 is overdue.
        let later = at + bound_ms + 1;
        b.at_ms.store(later, Ordering::Relaxed);
        assert_eq!(
            ix.heartbeat_transitions(later, BOUND),
            vec![("n1".to_string(), true)]
        );
        assert_eq!(ix.set_node_silent("n1", true, later, BOUND), 1);
        assert!(a.silent() && ix.node_silent("n1"));
        assert_eq!(matched(&ix), vec![("b".to_string(), CoverageState::Exact)]);
        let snap = ix.snapshot();
        let ra = snap.replicas.iter().find(|r| r.replica == "a").unwrap();
        assert_eq!(
            (
                ra.coverage,
                ra.coverage_reason,
                ra.routable,
                ra.prefix_count
            ),
            ("Unknown", Some(HEARTBEAT_MISSED), false, 1)
        );
        let unknown = ix
            .coverage_counts()
            .iter()
            .find(|(s, _)| *s == CoverageState::Unknown)
            .map(|(_, n)| *n);
        assert_eq!(unknown, Some(1));
        // Only silent holders: NO_HINT says they are not routable.
        b.at_ms.store(1, Ordering::Relaxed);
        ix.set_node_silent("n2", true, later, BOUND);
        let r = ix.lookup(&LookupQuery {
            content_keys: vec![KEY],
            block_size: Some(16),
            ..Default::default()
        });
        assert!(!r.prefix_match);
        assert_eq!(r.reason, "HolderNotRoutable");
        // Heard again: the transition lifts it, and the replica reads what it reported.
        a.touch();
        b.touch();
        let now = a.at_ms().unwrap().max(b.at_ms().unwrap());
        let mut due = ix.heartbeat_transitions(now, BOUND);
        due.sort();
        assert_eq!(
            due,
            vec![("n1".to_string(), false), ("n2".to_string(), false)]
        );
        for (n, s) in due {
            ix.set_node_silent(&n, s, now, BOUND);
        }
        let mut m = matched(&ix);
        m.sort();
        assert_eq!(
            m,
            vec![
                ("a".to_string(), CoverageState::Exact),
                ("b".to_string(), CoverageState::Exact)
            ]
        );
        // Going silent is re-checked under the lock: a reporter heard since is left alone.
        assert_eq!(ix.set_node_silent("n1", true, now, BOUND), 0);
        assert!(!ix.node_silent("n1"));
    }

    /// Only a stream that announced the capability, and whose session reads it, is held to
    /// the bound; a resync of a silent reporter registers its replicas silent; an expired
    /// reporter's cell goes with it.
    #[test]
    fn the_bound_applies_only_to_capable_reading_streams() {
        let mut ix = PrefixIndex::new();
        ix.resync_node("n1", &[exact("a")]);
        let a = ix.heard_cell("n1");
        a.open(false);
        let far = a.at_ms().unwrap() + 3_600_000;
        assert!(ix.heartbeat_transitions(far, BOUND).is_empty());
        a.open(true);
        a.pause();
        let far = a.at_ms().unwrap() + 3_600_000;
        assert!(ix.heartbeat_transitions(far, BOUND).is_empty());
        a.resume();
        let far = a.at_ms().unwrap() + 3_600_000;
        assert_eq!(ix.set_node_silent("n1", true, far, BOUND), 1);
        ix.resync_node("n1", &[exact("a"), exact("c")]);
        assert!(matched(&ix).is_empty(), "{:?}", matched(&ix));
        assert_eq!(
            ix.snapshot()
                .replicas
                .iter()
                .filter(|r| !r.routable)
                .count(),
            2
        );
        ix.remove_node("n1");
        assert!(ix.heard_at_ms("n1").is_none());
        assert!(ix.snapshot().replicas.is_empty());
        assert!(!ix.node_silent("n1"));
    }
}
