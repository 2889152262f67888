//! Replica coverage and routability, and the streams the node plans expect: the per-state
//! tally of effective coverage (`inferencecache_controller_index_replicas_by_coverage`), the
//! per-scope count of replicas whose entries may miss blocks ([`PrefixIndex::inexact_replicas`]),
//! the `unroutable` filter lookups read, and the planned streams without a replica (spec 000
//! "Index Participation"; issue 37). Kept incrementally as coverage, limits, replicas and plans
//! change, so neither the gauges nor a lookup walks every replica.
use std::collections::HashMap;

use ic_shared::kv::coverage::{self, Coverage, CoverageState};
use ic_shared::proto;

use super::{PrefixIndex, Replica, ReplicaSlot};

/// A replica's scope in [`PrefixIndex::inexact_replicas`]: (tenant, model, hash scheme).
pub type StreamScope = (String, String, String);

/// The KV-event streams `plans` expect (stream id → scope), with the descriptors the agents
/// report them by ([`ic_shared::plan::EnginePlan::descriptor`]): what
/// [`PrefixIndex::set_planned_streams`] takes.
pub fn planned_streams<'a>(
    plans: impl IntoIterator<Item = &'a ic_shared::plan::NodePlan>,
) -> HashMap<String, StreamScope> {
    let mut out = HashMap::new();
    for e in plans.into_iter().flat_map(|p| &p.engines) {
        for src in &e.kv_events {
            let d = e.descriptor(src.dp_rank);
            out.entry(d.stream_id)
                .or_insert((d.tenant, d.model, d.hash_scheme));
        }
    }
    out
}

/// Replicas per effective coverage state ([`PrefixIndex::coverage_counts`]) and, per
/// (tenant, model, hash scheme), the replicas whose entries may miss blocks the engine holds
/// ([`misses_entries`]: [`PrefixIndex::inexact_replicas`]) plus the planned streams the index
/// has no replica for. Kept as coverage, limits, replicas and plans change, so neither the
/// gauges nor a lookup walks every replica.
#[derive(Debug, Default)]
pub(super) struct CoverageTally {
    pub(super) by_state: [usize; CoverageState::ALL.len()],
    pub(super) inexact: HashMap<StreamScope, u32>,
    /// The streams the node plans expect ([`PrefixIndex::set_planned_streams`]), by stream id.
    pub(super) planned: HashMap<String, StreamScope>,
    /// How many of `planned` have no replica.
    pub(super) planned_absent: usize,
}

/// Whether a replica in `state` may hold blocks its index entries lack: anything but Exact,
/// and but EngineDown (the engine and its cache are gone).
pub(super) fn misses_entries(state: CoverageState) -> bool {
    !matches!(state, CoverageState::Exact | CoverageState::EngineDown)
}

impl CoverageTally {
    /// Moves the replica of `desc` between states (`None`: it is created or removed).
    pub(super) fn moved(
        &mut self,
        desc: &proto::StreamDescriptor,
        from: Option<CoverageState>,
        to: Option<CoverageState>,
    ) {
        if from == to {
            return;
        }
        retally(&mut self.by_state, from, to);
        // A planned stream without a replica counts as inexact under its planned scope.
        if from.is_none() || to.is_none() {
            if let Some(planned) = self.planned.get(&desc.stream_id).cloned() {
                let created = from.is_none();
                self.planned_absent = if created {
                    self.planned_absent.saturating_sub(1)
                } else {
                    self.planned_absent + 1
                };
                self.bump(planned, !created);
            }
        }
        let was = from.is_some_and(misses_entries);
        let is = to.is_some_and(misses_entries);
        if was == is {
            return;
        }
        let scope = (
            desc.tenant.clone(),
            desc.model.clone(),
            desc.hash_scheme.clone(),
        );
        self.bump(scope, is);
    }

    /// Counts one more (`up`) or one less inexact replica in `scope`.
    pub(super) fn bump(&mut self, scope: StreamScope, up: bool) {
        if up {
            *self.inexact.entry(scope).or_default() += 1;
        } else if let Some(n) = self.inexact.get_mut(&scope) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.inexact.remove(&scope);
            }
        }
    }

    /// Replaces the planned streams; `present` says whether the index has a replica of a
    /// stream id.
    pub(super) fn set_planned(
        &mut self,
        planned: HashMap<String, StreamScope>,
        present: impl Fn(&str) -> bool,
    ) {
        let old = std::mem::take(&mut self.planned);
        for (id, scope) in old {
            if !present(&id) {
                self.bump(scope, false);
            }
        }
        self.planned_absent = 0;
        for (id, scope) in &planned {
            if !present(id) {
                self.planned_absent += 1;
                self.bump(scope.clone(), true);
            }
        }
        self.planned = planned;
    }
}

/// Moves one replica between the per-state counts of [`PrefixIndex::coverage_counts`]
/// (`None`: the replica is created or removed).
pub(super) fn retally(
    tally: &mut [usize; CoverageState::ALL.len()],
    from: Option<CoverageState>,
    to: Option<CoverageState>,
) {
    if from == to {
        return;
    }
    let at = |s: CoverageState| CoverageState::ALL.iter().position(|x| *x == s);
    if let Some(c) = from.and_then(at).and_then(|i| tally.get_mut(i)) {
        *c = c.saturating_sub(1);
    }
    if let Some(c) = to.and_then(at).and_then(|i| tally.get_mut(i)) {
        *c += 1;
    }
}

impl PrefixIndex {
    /// Records a replica's coverage and whether lookups may match it.
    pub(super) fn set_coverage(&mut self, slot: ReplicaSlot, cov: Coverage) {
        let mut silent = false;
        if let Some(r) = self
            .replicas
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
        {
            silent = r.silent;
            if r.coverage == cov {
                // Unchanged (nearly every delta): the tally and `unroutable` already agree.
                return;
            }
            let before = r.effective_coverage().state;
            r.coverage = cov;
            self.coverage_tally
                .moved(&r.desc, Some(before), Some(r.effective_coverage().state));
        }
        self.set_unroutable(slot, !cov.state.routable() || silent);
    }

    /// Reads the replica in `slot` silent or not ([`Replica::silent`]), keeping the tally and
    /// `unroutable`. True when that changed.
    pub(super) fn set_silent(&mut self, slot: ReplicaSlot, silent: bool) -> bool {
        let Some(r) = self
            .replicas
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
        else {
            return false;
        };
        if r.silent == silent {
            return false;
        }
        let before = r.effective_coverage().state;
        r.silent = silent;
        self.coverage_tally
            .moved(&r.desc, Some(before), Some(r.effective_coverage().state));
        let block = !r.routable_now();
        self.set_unroutable(slot, block);
        true
    }

    /// Sets whether lookups skip `slot`, keeping `unroutable_count`.
    pub(super) fn set_unroutable(&mut self, slot: ReplicaSlot, block: bool) {
        let i = slot as usize;
        if self.unroutable.len() <= i {
            self.unroutable.resize(i + 1, false);
        }
        if let Some(cell) = self.unroutable.get_mut(i) {
            if *cell != block {
                *cell = block;
                if block {
                    self.unroutable_count += 1;
                } else {
                    self.unroutable_count = self.unroutable_count.saturating_sub(1);
                }
            }
        }
    }

    /// True when lookups may match the replica in `slot`.
    #[inline]
    pub(super) fn routable(&self, slot: ReplicaSlot) -> bool {
        self.unroutable_count == 0 || !self.unroutable.get(slot as usize).copied().unwrap_or(false)
    }

    /// Marks every routable replica of `node` as unreported (its agent's stream ended):
    /// coverage Unknown / `AgentDisconnected` until the agent's next resync. Those entries stay
    /// routable (an agent restart is not an engine outage) until the node expires; a replica
    /// already reported Disconnected or EngineDown stays unrouted.
    pub fn mark_node_unreported(&mut self, node: &str) {
        self.mark_node_routable(
            node,
            Coverage::new(CoverageState::Unknown, coverage::AGENT_DISCONNECTED),
        );
    }

    /// A newer agent stream of `node` opened (it supersedes the one that reported the node's
    /// replicas): a resync of the old stream still being applied in slices stops touching them
    /// (its later [`Self::resync_step`]s skip them and do not set their coverage), and each
    /// routable one reads Unknown / `AgentDisconnected` until the new stream's resync.
    pub fn supersede_node(&mut self, node: &str) {
        for s in self.slots_of_node(node, |_| true) {
            if let Some(r) = self.replica_mut(s) {
                // No apply has generation 0 (`begin_resync` counts from 1).
                r.resync = 0;
            }
        }
        self.mark_node_unreported(node);
    }

    /// The slots of `node`'s replicas for which `keep` holds.
    pub(super) fn slots_of_node(
        &self,
        node: &str,
        keep: impl Fn(&Replica) -> bool,
    ) -> Vec<ReplicaSlot> {
        self.node_slots
            .get(node)
            .into_iter()
            .flatten()
            .copied()
            .filter(|s| self.replica(*s).is_some_and(|r| r.node == node && keep(r)))
            .collect()
    }

    /// Marks the replica of `stream_id` Partial with `reason` until it is cleared or resynced
    /// (whatever its agent reports meanwhile): ingest dropped some of its entries or ops
    /// (e.g. [`coverage::BLOCK_SIZE_CAP_EXCEEDED`]). False when the stream is not indexed.
    pub fn limit_stream(&mut self, stream_id: &str, reason: &'static str) -> bool {
        let Some(&slot) = self.slot_by_stream.get(stream_id) else {
            return false;
        };
        self.limit_slot(slot, reason);
        true
    }

    /// Sets `slot`'s [`Replica::limited`] and keeps the coverage tally.
    pub(super) fn limit_slot(&mut self, slot: ReplicaSlot, reason: &'static str) {
        if let Some(r) = self
            .replicas
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
        {
            let before = r.effective_coverage().state;
            r.limited = Some(reason);
            self.coverage_tally
                .moved(&r.desc, Some(before), Some(r.effective_coverage().state));
        }
    }

    /// Marks every routable replica of `node` Unknown / `ResyncRequested`: the controller
    /// refused one of the node's deltas and asked its agent for a resync, and applies none of
    /// its deltas until then, so the entries are as last applied. Still routed, like an
    /// unreported node; the resync sets each stream's coverage again.
    pub fn mark_node_awaiting_resync(&mut self, node: &str) {
        self.mark_node_routable(
            node,
            Coverage::new(CoverageState::Unknown, coverage::RESYNC_REQUESTED),
        );
    }

    /// Sets `cov` on every replica of `node` that is routable now.
    pub(super) fn mark_node_routable(&mut self, node: &str, cov: Coverage) {
        for s in self.slots_of_node(node, |r| r.coverage.state.routable()) {
            self.set_coverage(s, cov);
        }
    }

    /// Replicas per coverage state, every state listed (the
    /// `inferencecache_controller_index_replicas_by_coverage` gauge).
    pub fn coverage_counts(&self) -> [(CoverageState, usize); CoverageState::ALL.len()] {
        let mut out = CoverageState::ALL.map(|s| (s, 0usize));
        for (c, n) in out.iter_mut().zip(self.coverage_tally.by_state) {
            c.1 = n;
        }
        out
    }

    /// The inexact-replica tally by walking every replica and planned stream (what it must
    /// equal).
    #[cfg(test)]
    pub(super) fn inexact_walked(&self) -> HashMap<StreamScope, u32> {
        let mut out: HashMap<StreamScope, u32> = HashMap::new();
        for (_, r) in self.live_replicas() {
            if misses_entries(r.effective_coverage().state) {
                *out.entry((
                    r.desc.tenant.clone(),
                    r.desc.model.clone(),
                    r.desc.hash_scheme.clone(),
                ))
                .or_default() += 1;
            }
        }
        for (id, scope) in &self.coverage_tally.planned {
            if !self.slot_by_stream.contains_key(id.as_str()) {
                *out.entry(scope.clone()).or_default() += 1;
            }
        }
        out
    }

    /// Sets the streams the node plans expect (stream id → scope; [`planned_streams`] derives
    /// them from the plans): each one the index has no replica for — its node's agent has not
    /// connected since this controller started, or never did, or its replica expired — counts
    /// in [`Self::inexact_replicas`] of its scope until its replica appears. O(planned streams);
    /// the caller skips it when the plans did not change ([`Self::planned_streams_are`]).
    pub fn set_planned_streams(&mut self, planned: HashMap<String, StreamScope>) {
        let by_stream = &self.slot_by_stream;
        self.coverage_tally
            .set_planned(planned, |id| by_stream.contains_key(id));
    }

    /// True when [`Self::set_planned_streams`] last set exactly `planned`.
    pub fn planned_streams_are(&self, planned: &HashMap<String, StreamScope>) -> bool {
        self.coverage_tally.planned == *planned
    }

    /// Planned streams the index has no replica for (the
    /// `inferencecache_controller_index_planned_streams_absent` gauge).
    pub fn planned_streams_absent(&self) -> usize {
        self.coverage_tally.planned_absent
    }

    /// The planned streams the index has no replica for, as (stream id, scope), in no
    /// particular order: the replicas a status lists as `Unknown` / `NotReported`.
    /// O(planned streams).
    pub fn planned_streams_without_replica(&self) -> impl Iterator<Item = (&str, &StreamScope)> {
        self.coverage_tally
            .planned
            .iter()
            .filter(|(id, _)| !self.slot_by_stream.contains_key(id.as_str()))
            .map(|(id, scope)| (id.as_str(), scope))
    }

    /// [`Self::coverage_counts`] by walking every replica (what the tally must equal).
    #[cfg(test)]
    pub(super) fn coverage_counts_walked(
        &self,
    ) -> [(CoverageState, usize); CoverageState::ALL.len()] {
        let mut out = CoverageState::ALL.map(|s| (s, 0usize));
        for (_, r) in self.live_replicas() {
            if let Some(c) = out
                .iter_mut()
                .find(|(s, _)| *s == r.effective_coverage().state)
            {
                c.1 += 1;
            }
        }
        out
    }
}
