//! The coverage heartbeat bound (issue 37 item 2; docs/kv-events.md "Coverage age").
//!
//! Agents that announce `coverage-heartbeat` in Hello send a `CoverageHeartbeat` every second
//! ([`ic_shared::link::COVERAGE_HEARTBEAT_INTERVAL`]); every message of a stream stamps its
//! reporter's [`crate::index::Heard`] on the controller's monotonic clock. [`watch`] looks every
//! [`sweep_period`] for reporters not heard within the bound (`--coverage-heartbeat-bound-ms`,
//! [`DEFAULT_BOUND`]) and reads their replicas Unknown / `HeartbeatMissed`, not routed, exactly
//! as a Disconnected replica is skipped; a session lifts that at the reporter's next message
//! ([`lift_silence`]), the watcher at its next look otherwise.
//!
//! A reporter's replicas therefore stop being routed at most `bound + sweep_period` after its
//! last message (5.25 s by default), whatever the HTTP/2 keep-alive (30 s + 20 s) still
//! believes. A session waiting for or applying a resync turn reads nothing of its stream
//! meanwhile (`ingest::turns`): the bound is suspended for it ([`crate::index::Heard::pause`]).

use std::sync::{Arc, Weak};
use std::time::Duration;

use tracing::{info, warn};

use crate::index::{mono_ms, Heard};
use crate::state::{Shared, WriteHold};

/// Default of `--coverage-heartbeat-bound-ms`: 5 s, five heartbeat intervals.
pub const DEFAULT_BOUND: Duration = crate::state::DEFAULT_COVERAGE_HEARTBEAT_BOUND;

/// The least bound `--coverage-heartbeat-bound-ms` accepts: more than three heartbeat intervals
/// (a live agent whose heartbeats run late by up to two intervals does not flap).
pub fn min_bound() -> Duration {
    ic_shared::link::COVERAGE_HEARTBEAT_INTERVAL * 3 + Duration::from_millis(1)
}

/// How often [`watch`] looks: a twentieth of the bound, between 50 ms and 250 ms. Each look
/// reads one atomic per reporter under the index read lock; the write lock is taken only when
/// some reporter falls silent or is heard again.
pub fn sweep_period(bound: Duration) -> Duration {
    (bound / 20).clamp(Duration::from_millis(50), Duration::from_millis(250))
}

/// Reads reporters silent past `bound`, and not silent once heard again, until `shared` is
/// dropped or the controller stops. Started once per [`Shared`] by the first accepted agent
/// stream ([`super::AgentIngest`]).
pub async fn watch(shared: Weak<Shared>, bound: Duration) {
    let mut tick = tokio::time::interval(sweep_period(bound));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if *shared.stopping.borrow() {
            return;
        }
        let now = mono_ms();
        let due = shared.index.read().heartbeat_transitions(now, bound);
        if due.is_empty() {
            continue;
        }
        let mut ix = shared.index_write(WriteHold::Disconnect);
        for (node, silent) in &due {
            let age_ms = ix
                .heard_at_ms(node)
                .map(|t| now.saturating_sub(t))
                .unwrap_or_default();
            let n = ix.set_node_silent(node, *silent, now, bound);
            if ix.node_silent(node) != *silent {
                // Heard between the look and the write lock: nothing changed.
                continue;
            }
            if *silent {
                warn!(node = %node, age_ms, bound_ms = bound.as_millis() as u64, replicas = n, "nothing heard from the agent within the coverage heartbeat bound: its replicas read Unknown/HeartbeatMissed and are not routed");
            } else {
                info!(node = %node, replicas = n, "the agent is heard again: its replicas read their reported coverage");
            }
        }
        shared.update_index_gauges(&ix);
    }
}

/// A message arrived on a stream of `node` whose reporter reads silent: lifts that at once
/// (not at the watcher's next look). A no-op when it does not read silent.
pub fn lift_silence(shared: &Shared, node: &str, heard: &Heard, bound: Duration) {
    if !heard.silent() {
        return;
    }
    let mut ix = shared.index_write(WriteHold::Connect);
    let n = ix.set_node_silent(node, false, mono_ms(), bound);
    if n > 0 {
        info!(node = %node, replicas = n, "the agent is heard again: its replicas read their reported coverage");
    }
    shared.update_index_gauges(&ix);
}

/// Starts [`watch`] for `shared` unless `started` says it runs already.
pub fn start_once(started: &std::sync::OnceLock<()>, shared: &Arc<Shared>, bound: Duration) {
    started.get_or_init(|| {
        tokio::spawn(watch(Arc::downgrade(shared), bound));
    });
}

/// Warns (once per stream) when an agent's heartbeat interval leaves less than three intervals
/// in `bound`: its replicas would flap whenever a heartbeat is a little late.
pub fn check_interval(node: &str, interval_ms: u32, bound: Duration, warned: &mut bool) {
    let interval = Duration::from_millis(u64::from(interval_ms));
    if *warned || interval.is_zero() || interval * 3 < bound {
        return;
    }
    *warned = true;
    warn!(node = %node, interval_ms, bound_ms = bound.as_millis() as u64, "the agent's heartbeat interval leaves less than three heartbeats in --coverage-heartbeat-bound-ms: its replicas may read HeartbeatMissed while it is live; raise the bound");
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn the_sweep_period_is_a_twentieth_of_the_bound_within_its_limits() {
        assert_eq!(sweep_period(DEFAULT_BOUND), Duration::from_millis(250));
        assert_eq!(
            sweep_period(Duration::from_secs(2)),
            Duration::from_millis(100)
        );
        assert_eq!(
            sweep_period(Duration::from_millis(10)),
            Duration::from_millis(50)
        );
        assert!(DEFAULT_BOUND >= min_bound());
    }
}
