//! Applying a session's resync to the index: the node agent's streams kept to its node's
//! scope (and its deltas likewise), the per-reporter stream cap, the block-size caps, and the
//! resync itself in slices of [`RESYNC_SLICE_ENTRIES`] under short holds of the index write
//! lock.

use std::collections::HashSet;

use ic_shared::proto;
use tracing::{info, warn};

use super::Session;
use crate::ingest::{scope, RESYNC_SLICE_ENTRIES};
use crate::state::WriteHold;

impl Session {
    /// A node agent's deltas without those of streams outside its node's scope (counted);
    /// subscribers' deltas pass (they are held to their pod by [`Session::authorize`]).
    pub(super) fn in_scope_deltas(
        &self,
        deltas: Vec<proto::StreamDelta>,
    ) -> Vec<proto::StreamDelta> {
        if self.ticket.scope.is_some() {
            return deltas;
        }
        let nodes = self.shared.nodes.lock();
        let before = deltas.len();
        let kept: Vec<proto::StreamDelta> = deltas
            .into_iter()
            .filter(|d| {
                d.stream
                    .as_ref()
                    .is_none_or(|desc| nodes.node_may_report(&self.ticket.node, desc).is_ok())
            })
            .collect();
        drop(nodes);
        let dropped = before - kept.len();
        if dropped > 0 {
            let m = &self.shared.metrics;
            m.kv_streams_refused_total
                .with_label_values(&["outside_node_scope"])
                .inc_by(dropped as u64);
            m.kv_deltas_refused_total
                .with_label_values(&["outside_node_scope"])
                .inc_by(dropped as u64);
            warn!(node = %self.ticket.node, dropped, "KV deltas of streams outside the node's scope were dropped");
        }
        kept
    }

    /// A node agent's resync without the streams outside its node's scope (counted, with the
    /// first reason logged).
    fn in_scope_snapshots(
        &self,
        streams: Vec<proto::StreamSnapshot>,
    ) -> Vec<proto::StreamSnapshot> {
        if self.ticket.scope.is_some() {
            return streams;
        }
        let nodes = self.shared.nodes.lock();
        let mut first = None;
        let before = streams.len();
        let kept: Vec<proto::StreamSnapshot> = streams
            .into_iter()
            .filter(|s| match s.stream.as_ref() {
                None => true,
                Some(desc) => match nodes.node_may_report(&self.ticket.node, desc) {
                    Ok(()) => true,
                    Err(e) => {
                        first.get_or_insert(e);
                        false
                    }
                },
            })
            .collect();
        drop(nodes);
        if let Some(why) = first {
            let dropped = before - kept.len();
            self.shared
                .metrics
                .kv_streams_refused_total
                .with_label_values(&["outside_node_scope"])
                .inc_by(dropped as u64);
            warn!(node = %self.ticket.node, dropped, first = %why, "resync streams outside the node's scope were left out");
        }
        kept
    }

    /// The resync's first `--max-streams-per-reporter` distinct streams; the rest are left out
    /// and counted (`kv_streams_refused_total{reason="stream_cap"}`). Bounds what one agent or
    /// pod token can register (issue 38 item 4: 200 000 one-entry streams held the index write
    /// lock 7.4 s in one `begin_resync`), and so the streams one resync registers under one
    /// hold of the lock.
    fn within_stream_cap(
        &self,
        mut streams: Vec<proto::StreamSnapshot>,
    ) -> Vec<proto::StreamSnapshot> {
        let cap = self.shared.policy.streams_per_reporter();
        let mut seen: HashSet<&str> = HashSet::new();
        let mut keep = streams.len();
        for (i, s) in streams.iter().enumerate() {
            seen.insert(s.stream.as_ref().map_or("", |d| d.stream_id.as_str()));
            if seen.len() > cap {
                keep = i;
                break;
            }
        }
        if keep < streams.len() {
            let dropped = streams.len() - keep;
            streams.truncate(keep);
            self.shared
                .metrics
                .kv_streams_refused_total
                .with_label_values(&["stream_cap"])
                .inc_by(dropped as u64);
            warn!(node = %self.ticket.node, cap, dropped, "resync carried more streams than one reporter may register (--max-streams-per-reporter); the rest were left out");
        }
        streams
    }

    /// The index write lock for `what` while this stream is still its node's (or pod's)
    /// current one; `None` once a newer one took over. Checked under the registry lock, which
    /// a newer stream's connect holds while it supersedes this one's replicas
    /// ([`crate::index::PrefixIndex::supersede_node`]), so nothing this stream applies lands
    /// after that.
    pub(super) fn index_write_if_current(
        &self,
        what: WriteHold,
    ) -> Option<crate::state::IndexWrite<'_>> {
        let nodes = self.shared.nodes.lock();
        if !nodes.is_current(&self.ticket) {
            return None;
        }
        let ix = self.shared.index_write(what);
        drop(nodes);
        Some(ix)
    }

    /// Replaces the node's streams with a whole resync, applied in slices of
    /// [`RESYNC_SLICE_ENTRIES`] entries ([`crate::index::PrefixIndex::begin_resync`]): the index
    /// write lock is released and the task yields between slices, so lookups and other agents'
    /// writes interleave with a large resync (a restart storm applies thousands at once). Until
    /// the last slice the node's streams read Partial / `ResyncApplying`. A newer stream of the
    /// node taking over stops the apply (the newer stream's resync replaces these streams).
    pub(super) async fn apply_resync(&mut self, streams: Vec<proto::StreamSnapshot>) {
        let m = &self.shared.metrics;
        let trigger = if self.awaiting_resync {
            "requested"
        } else {
            "connect"
        };
        let streams = self.within_stream_cap(self.in_scope_snapshots(streams));
        let mut streams = with_node(streams, self.ticket.reporting_node());
        let mut apply = {
            let Some(mut ix) = self.index_write_if_current(WriteHold::ResyncBegin) else {
                info!(node = %self.ticket.node, "a newer stream of the node took over before its resync was applied");
                self.turn = None;
                return;
            };
            let mut budget = scope::BlockSizeBudget::new(ix.registered_block_sizes());
            let mut capped: Vec<String> = Vec::new();
            for s in streams.iter_mut() {
                if scope::cap_snapshot(s, &mut budget) > 0 {
                    capped.extend(s.stream.as_ref().map(|d| d.stream_id.clone()));
                }
            }
            m.kv_streams_refused_total
                .with_label_values(&["block_size_cap"])
                .inc_by(capped.len() as u64);
            let apply = ix.begin_resync(&self.ticket.node, &streams);
            // What the cap dropped is not in the index: those streams read Partial whatever
            // their snapshot says, until a resync or clear drops nothing.
            for id in &capped {
                ix.limit_stream(id, ic_shared::kv::coverage::BLOCK_SIZE_CAP_EXCEEDED);
            }
            self.shared.update_index_gauges(&ix);
            // The agent sends its counters again right after a resync.
            self.shared
                .host_tier
                .write()
                .forget_reporter(&self.ticket.node);
            drop(ix);
            apply
        };
        let total: u64 = streams.iter().map(|s| s.entries.len() as u64).sum();
        let mut told = tokio::time::Instant::now();
        loop {
            let (done, replaced) = {
                // Large tables this slice could grow are grown first under an upgradable read
                // lock (lookups go on), then swapped in; the slice itself never grows one.
                let ix = self.shared.index.upgradable_read();
                let grown = ix.grow_ahead(&apply, &streams, RESYNC_SLICE_ENTRIES);
                let mut ix = self.shared.index_upgrade(ix, WriteHold::ResyncSlice);
                let replaced = ix.install_grown(grown);
                let done = ix.resync_step(&mut apply, &streams, RESYNC_SLICE_ENTRIES);
                self.shared.update_index_gauges(&ix);
                drop(ix);
                (done, replaced)
            };
            // The replaced tables are freed outside the lock.
            drop(replaced);
            if done {
                break;
            }
            if !self.shared.nodes.lock().is_current(&self.ticket) {
                info!(node = %self.ticket.node, "a newer stream of the node took over during its resync; stopped applying it");
                self.turn = None;
                return;
            }
            if told.elapsed() >= self.shared.resync_turns.progress_every() {
                told = tokio::time::Instant::now();
                let _ = self.progress(proto::ResyncProgress {
                    applying: true,
                    entries_applied: apply.entries_done(&streams),
                    entries_total: total,
                });
            }
            tokio::task::yield_now().await;
        }
        self.turn = None;
        self.opening_pending = false;
        self.owned = streams
            .iter()
            .filter_map(|s| s.stream.as_ref().map(|d| d.stream_id.clone()))
            .collect();
        m.kv_resyncs_total.with_label_values(&[trigger]).inc();
        self.awaiting_resync = false;
    }
}

/// Stamps the reporting node into each stream descriptor.
fn with_node(mut streams: Vec<proto::StreamSnapshot>, node: &str) -> Vec<proto::StreamSnapshot> {
    for s in &mut streams {
        if let Some(d) = s.stream.as_mut() {
            d.node = node.to_string();
        }
    }
    streams
}
