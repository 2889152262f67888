//! [`KvHub`]: the agent's KV-event aggregation point. The node plan says which engine publishers
//! to follow; the hub runs one subscriber per stream and hands the link deltas and snapshots.
//!
//! Contract with the link (`agent/src/link/`):
//!
//! 1. [`KvHub::apply_plan`] on every plan (starts new streams, stops removed or changed ones;
//!    a stopped stream's state is dropped, so the next snapshot no longer lists it).
//! 2. On (re)connect, and on the controller's `ResyncRequest`: [`KvHub::snapshot`] → `Resync`.
//! 3. Then loop: `hub.changed().await`, [`KvHub::take_deltas`] → `KvDeltaBatch`.
//!
//! Each stream numbers its deltas: the first delta after a snapshot with seq `s` has seq `s + 1`.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use ic_shared::plan::NodePlan;
use ic_shared::proto::{StreamDelta, StreamSnapshot};
use serde::Serialize;
use tokio::sync::Notify;

use super::metrics::KvMetrics;
use super::persist::StateDir;
use super::stream::{LinkState, StreamConfig};
use super::subscriber::{
    self, Running, Sink, StreamInner, StreamShared, StreamSpec, SubscriberOptions,
};

/// The agent's KV-event hub. Cheap to clone (an `Arc` inside); all methods are thread-safe.
#[derive(Clone)]
pub struct KvHub {
    inner: Arc<HubInner>,
}

struct HubInner {
    sink: Sink,
    opts: SubscriberOptions,
    stream_defaults: StreamConfig,
    streams: Mutex<BTreeMap<String, StreamEntry>>,
    /// Where stream state is kept across agent restarts (`kv::persist`), if anywhere.
    state_dir: Mutex<Option<StateDir>>,
}

struct StreamEntry {
    shared: Arc<StreamShared>,
    /// `None` while no tokio runtime was available to start it (retried on the next plan).
    running: Option<Running>,
    /// The last save: unchanged streams are not written again.
    saved: Option<SaveMark>,
}

/// What a stream looked like when it was last kept, and when.
#[derive(Debug, Clone, Copy)]
struct SaveMark {
    key: (Option<u64>, u64, ic_shared::kv::Coverage),
    at: std::time::Instant,
}

/// Per-stream status for `/v1/report` (JSON, camelCase).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StreamStatus {
    /// `<namespace>/<pod>#<dp_rank>`.
    pub stream_id: String,
    /// Replica id in routing answers.
    pub replica: String,
    /// Data-parallel rank from the plan.
    pub dp_rank: u32,
    /// Rank the engine reports in its batches (a mismatch means a misplanned port).
    pub reported_dp_rank: Option<u32>,
    /// PUB endpoint followed.
    pub endpoint: String,
    /// Replay endpoint, if any.
    pub replay_endpoint: Option<String>,
    /// Topic prefix filter.
    pub topic: String,
    /// True while the SUB socket is connected.
    pub connected: bool,
    /// Last applied engine sequence number.
    pub last_seq: Option<u64>,
    /// Engine seq of the stream's last kept-state save (the file a restart resumes from; see
    /// `--state-dir`); `None` before the first save or without a state directory. The replay
    /// after a `kill -9` covers `lastSeq − keptSeq` batches.
    pub kept_seq: Option<u64>,
    /// Engine time of the newest applied batch, unix ms.
    pub last_event_unix_ms: Option<i64>,
    /// Agent time the last live message arrived, unix ms.
    pub last_message_unix_ms: Option<i64>,
    /// Estimated engine clock minus agent clock, seconds (positive: the engine's clock is ahead),
    /// from live batches' timestamps over the last 10 minutes; `None` before one. Beyond ±2 s it
    /// is flagged (a WARN) and taken out of the stream lag.
    pub engine_clock_skew_seconds: Option<f64>,
    /// Live messages received.
    pub events_received: u64,
    /// Batches obtained by replay.
    pub batches_replayed: u64,
    /// Batches decoded (live and replayed).
    pub batches_decoded: u64,
    /// Events decoded and applied.
    pub events_decoded: u64,
    /// Batches or events lost, total.
    pub events_dropped: u64,
    /// Losses by reason.
    pub dropped_by_reason: BTreeMap<String, u64>,
    /// Sequence gaps detected.
    pub gaps: u64,
    /// Successful replays (healing and bootstrap).
    pub replays: u64,
    /// Failed replays.
    pub replays_failed: u64,
    /// Replica clears (AllBlocksCleared, restarts, unhealed gaps).
    pub resyncs: u64,
    /// Index entries held.
    pub blocks_held: usize,
    /// Blocks parked for an unknown parent.
    pub orphans: usize,
    /// True while the state is uncertain after an unhealed gap.
    pub stale: bool,
    /// Coverage state (`Exact`, `Healing`, `Partial`, `Disconnected`, `EngineDown`;
    /// `docs/kv-events.md` "Coverage").
    pub coverage: &'static str,
    /// Why the stream is not Exact (`BootstrapIncomplete`, `ReplayTruncated`, …).
    pub coverage_reason: Option<&'static str>,
    /// The stream's current delta seq.
    pub delta_seq: u64,
    /// The plan's block size.
    pub plan_block_size: u32,
    /// Largest block size seen on indexed events (0 before any); differs from the plan's when
    /// the router and the engine disagree.
    pub observed_block_size: u32,
    /// Most recent connection, replay or subscription error.
    pub last_error: Option<String>,
}

impl KvHub {
    /// Creates a hub with default subscriber options; its metrics (prefixed
    /// `inferencecache_agent_kv_`) are registered in `registry`.
    ///
    /// # Errors
    /// When a metric of the same name is already registered there.
    pub fn new(registry: &prometheus::Registry) -> Result<Self, prometheus::Error> {
        Self::with_options(
            registry,
            SubscriberOptions::default(),
            StreamConfig::default(),
        )
    }

    /// Like [`new`](Self::new) with explicit subscriber timing and state-machine limits
    /// (`stream_defaults.keeps_l2` and `block_size` are replaced per stream from the plan).
    pub fn with_options(
        registry: &prometheus::Registry,
        opts: SubscriberOptions,
        stream_defaults: StreamConfig,
    ) -> Result<Self, prometheus::Error> {
        Ok(Self {
            inner: Arc::new(HubInner {
                sink: Sink {
                    metrics: KvMetrics::new(registry)?,
                    notify: Arc::new(Notify::new()),
                    budget: subscriber::budget::InflightBudget::new(
                        subscriber::budget::DEFAULT_INFLIGHT_BYTES,
                    ),
                },
                opts,
                stream_defaults,
                streams: Mutex::new(BTreeMap::new()),
                state_dir: Mutex::new(None),
            }),
        })
    }

    /// Sets the node-wide budget of KV-event bytes in flight (`--kv-inflight-bytes`; default
    /// [`subscriber::budget::DEFAULT_INFLIGHT_BYTES`]), for every stream, running ones
    /// included: a live message is charged its bytes plus what decoding it may allocate from
    /// the socket until it is applied; one the budget cannot take is dropped
    /// (`events_dropped_total{reason="inflight_budget"}`) and its stream reads Stale
    /// `TailUnverified` until the gap is healed.
    pub fn set_inflight_bytes(&self, bytes: usize) {
        self.inner.sink.budget.set_limit(bytes);
    }

    /// Bytes charged against the in-flight budget now (see [`KvHub::set_inflight_bytes`]).
    pub fn inflight_bytes(&self) -> usize {
        self.inner.sink.budget.used()
    }

    /// Keeps stream state in `dir` across agent restarts: streams started afterwards resume
    /// from their kept state; changed streams are saved by [`KvHub::save_changed`] and all of
    /// them by [`KvHub::shutdown`]. Call it before the first [`KvHub::apply_plan`]
    /// (`AgentState::with_state_dir` does): streams already started keep the state they have.
    pub fn set_state_dir(&self, dir: StateDir) {
        tracing::info!(dir = %dir.path().display(), "kv events: stream state kept across restarts");
        *self
            .inner
            .state_dir
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(dir);
    }

    fn state_dir(&self) -> Option<StateDir> {
        self.inner
            .state_dir
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Replaces a not-yet-started stream's empty state with its kept one.
    fn restore(&self, shared: &StreamShared) {
        let Some(dir) = self.state_dir() else { return };
        let id = &shared.spec.descriptor.stream_id;
        if shared.spec.replay_endpoint.is_none() {
            // Nothing could verify a kept state against the engine: start fresh.
            dir.remove(id);
            return;
        }
        match dir.load(&shared.spec) {
            Ok(Some(mut st)) => {
                st.set_link(LinkState::Disconnected);
                tracing::info!(stream = %id, last_seq = ?st.last_seq(), blocks = st.blocks_held(), "kv events: resuming from kept state");
                shared.lock().state = st;
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(stream = %id, error = %e, "kv events: kept state discarded; the stream starts fresh");
                dir.remove(id);
            }
        }
    }

    /// Saves every stream whose state changed since its last save. Returns how many were
    /// written. Blocking file I/O: call it off the async workers.
    pub fn save_changed(&self) -> usize {
        self.save(false)
    }

    fn save(&self, all: bool) -> usize {
        let Some(dir) = self.state_dir() else {
            return 0;
        };
        // The hub's map is held only to list the streams; each stream's records are taken
        // under its own lock alone, and written with no lock held.
        let listed: Vec<(String, Arc<StreamShared>, Option<SaveMark>)> = self
            .streams()
            .iter()
            .map(|(id, e)| (id.clone(), e.shared.clone(), e.saved))
            .collect();
        let mut n = 0;
        for (id, shared, saved) in listed {
            if shared.spec.replay_endpoint.is_none() {
                continue; // never restored (see `restore`)
            }
            let (key, blocks, records) = {
                let g = shared.lock();
                let key = (g.state.last_seq(), g.state.delta_seq(), g.state.coverage());
                if g.state.last_seq().is_none() {
                    continue;
                }
                let blocks = g.state.blocks_held();
                // Large states are written less often (1 s + 1 s per 200 000 entries, at most
                // 5 s): the replay from the kept seq covers the difference after a kill -9.
                let due = saved.is_none_or(|m| {
                    m.key != key
                        && m.at.elapsed()
                            >= std::time::Duration::from_millis(
                                (1000 + blocks as u64 / 200).min(5000),
                            )
                });
                if !all && !due {
                    continue;
                }
                (key, blocks, g.state.to_persisted())
            };
            match dir.save(&shared.spec, records) {
                Ok(_) => {
                    n += 1;
                    if let Some(e) = self.streams().get_mut(&id) {
                        if Arc::ptr_eq(&e.shared, &shared) {
                            e.saved = Some(SaveMark {
                                key,
                                at: std::time::Instant::now(),
                            });
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(stream = %id, blocks, error = %e, "kv events: could not keep stream state")
                }
            }
        }
        n
    }

    /// Stops every stream and keeps its state (agent shutdown). Unlike an empty plan, this
    /// deletes no kept state. Blocking file I/O.
    pub fn shutdown(&self) {
        {
            let mut streams = self.streams();
            for entry in streams.values_mut() {
                entry.running = None;
            }
        }
        let n = self.save(true);
        if n > 0 {
            tracing::info!(
                streams = n,
                "kv events: stream state kept for the next start"
            );
        }
        self.streams().clear();
    }

    fn streams(&self) -> MutexGuard<'_, BTreeMap<String, StreamEntry>> {
        self.inner.streams.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The streams a plan asks for, by stream id (first occurrence wins on duplicates).
    fn planned(&self, plan: &NodePlan) -> BTreeMap<String, StreamSpec> {
        let mut out = BTreeMap::new();
        for e in &plan.engines {
            for src in &e.kv_events {
                let id = e.stream_id(src.dp_rank);
                if out.contains_key(&id) {
                    tracing::warn!(stream = %id, "kv events: duplicate stream in plan ignored");
                    continue;
                }
                let spec = StreamSpec {
                    descriptor: e.descriptor(src.dp_rank),
                    endpoint: src.endpoint.clone(),
                    replay_endpoint: src.replay_endpoint.clone().filter(|s| !s.is_empty()),
                    topic: src.topic.clone(),
                    config: StreamConfig {
                        keeps_l2: e.keeps_l2,
                        block_size: e.block_size,
                        dp_rank: Some(src.dp_rank),
                        ..self.inner.stream_defaults.clone()
                    },
                };
                out.insert(id, spec);
            }
        }
        out
    }

    /// Starts subscribers for new streams in the plan, stops removed ones (their state is dropped:
    /// the next snapshot no longer lists them). A stream whose endpoint, topic, identity or plan
    /// facts changed is restarted with empty state; its next delta skips one seq so the
    /// controller resyncs rather than mixing the two incarnations. Subscribers start only within
    /// a tokio runtime; outside one, streams are listed (with an error in their status) and
    /// started by the next call made within a runtime.
    pub fn apply_plan(&self, plan: &NodePlan) {
        let desired = self.planned(plan);
        let rt = tokio::runtime::Handle::try_current().ok();
        let mut streams = self.streams();
        let metrics = &self.inner.sink.metrics;
        // Delta seqs of streams replaced in place (same id, changed spec).
        let mut replaced: BTreeMap<String, u64> = BTreeMap::new();
        let state_dir = self.state_dir();
        streams.retain(|id, entry| {
            let keep = desired.get(id) == Some(&entry.shared.spec);
            if !keep {
                tracing::info!(stream = %id, "kv events: stream stopped");
                metrics.remove_stream(id);
                if desired.contains_key(id) {
                    replaced.insert(id.clone(), entry.shared.lock().state.delta_seq());
                }
                if let Some(d) = &state_dir {
                    d.remove(id);
                }
            }
            keep
        });
        for (id, spec) in desired {
            if let Some(entry) = streams.get_mut(&id) {
                if let (None, Some(rt)) = (&entry.running, &rt) {
                    entry.shared.lock().stats.last_error = None;
                    self.restore(&entry.shared);
                    entry.running = Some(subscriber::spawn(
                        rt,
                        entry.shared.clone(),
                        self.inner.sink.clone(),
                        self.inner.opts.clone(),
                    ));
                }
                continue;
            }
            tracing::info!(stream = %id, endpoint = %spec.endpoint, "kv events: stream started");
            metrics.init_stream(&id);
            let shared = Arc::new(StreamShared::new(spec));
            if let Some(prev) = replaced.get(&id) {
                shared.lock().state.continue_after(*prev);
            }
            let running = match &rt {
                Some(rt) => {
                    if !replaced.contains_key(&id) {
                        self.restore(&shared);
                    }
                    Some(subscriber::spawn(
                        rt,
                        shared.clone(),
                        self.inner.sink.clone(),
                        self.inner.opts.clone(),
                    ))
                }
                None => {
                    shared.lock().stats.last_error = Some("no tokio runtime: not started".into());
                    None
                }
            };
            streams.insert(
                id,
                StreamEntry {
                    shared,
                    running,
                    saved: None,
                },
            );
        }
    }

    /// Takes pending ops: one [`StreamDelta`] per stream with pending ops, each stream's delta seq
    /// incremented by 1 (by 2 after an op overflow, which makes the controller ask for a resync).
    pub fn take_deltas(&self) -> Vec<StreamDelta> {
        let streams = self.streams();
        let mut out = Vec::new();
        for entry in streams.values() {
            let mut g = entry.shared.lock();
            out.extend(take_delta_of(entry, &mut g));
        }
        out
    }

    /// The pending ops of every stream as deltas, and then every stream's full state, each
    /// stream's pair taken under one hold of its lock: `(deltas, snapshots)`. A stream's
    /// snapshot has the seq of its delta (when it had one), so the link that asked for the
    /// snapshot drops that delta (`Covered`), while every other controller stream gets it — no
    /// op that lands meanwhile is in a snapshot but missing from the deltas.
    pub fn take_deltas_and_snapshot(&self) -> (Vec<StreamDelta>, Vec<StreamSnapshot>) {
        let streams = self.streams();
        let (mut deltas, mut snaps) = (Vec::new(), Vec::with_capacity(streams.len()));
        for entry in streams.values() {
            let mut g = entry.shared.lock();
            deltas.extend(take_delta_of(entry, &mut g));
            snaps.push(snapshot_of(entry, &mut g));
        }
        (deltas, snaps)
    }

    /// Resolves when new ops are pending (a `tokio::sync::Notify` permit: a change that happened
    /// while nobody waited resolves the next call at once).
    pub async fn changed(&self) {
        self.inner.sink.notify.notified().await;
    }

    /// Per-stream status for `/v1/report`, in stream-id order.
    pub fn status(&self) -> Vec<StreamStatus> {
        let streams = self.streams();
        streams
            .values()
            .map(|entry| {
                let s = &entry.shared;
                let g = s.lock();
                let d = &s.spec.descriptor;
                let ts = g.state.last_event_unix_ms();
                let cov = g.state.coverage();
                StreamStatus {
                    stream_id: d.stream_id.clone(),
                    replica: d.replica.clone(),
                    dp_rank: d.dp_rank,
                    reported_dp_rank: g.stats.reported_dp_rank,
                    endpoint: s.spec.endpoint.clone(),
                    replay_endpoint: s.spec.replay_endpoint.clone(),
                    topic: s.spec.topic.clone(),
                    connected: s.connected.load(Ordering::Relaxed),
                    last_seq: g.state.last_seq(),
                    kept_seq: entry.saved.and_then(|m| m.key.0),
                    last_event_unix_ms: (ts > 0).then_some(ts),
                    last_message_unix_ms: g.stats.last_message_unix_ms,
                    engine_clock_skew_seconds: g.stats.clock.estimate(),
                    events_received: g.stats.batches_received,
                    batches_replayed: g.stats.batches_replayed,
                    batches_decoded: g.stats.batches_decoded,
                    events_decoded: g.stats.events_decoded,
                    events_dropped: g.stats.dropped,
                    dropped_by_reason: g
                        .stats
                        .dropped_by_reason
                        .iter()
                        .map(|(k, v)| (k.to_string(), *v))
                        .collect(),
                    gaps: g.stats.gaps,
                    replays: g.stats.replays,
                    replays_failed: g.stats.replays_failed,
                    resyncs: g.stats.resyncs,
                    blocks_held: g.state.blocks_held(),
                    orphans: g.state.orphans(),
                    stale: g.state.is_stale(),
                    coverage: cov.state.as_str(),
                    coverage_reason: cov.reason,
                    delta_seq: g.state.delta_seq(),
                    plan_block_size: s.spec.config.block_size,
                    observed_block_size: g.state.observed_block_size(),
                    last_error: g.stats.last_error.clone(),
                }
            })
            .collect()
    }
}

/// The stream's pending ops as its next delta (see [`StreamState::take_delta`]), under the
/// held lock `g`.
fn take_delta_of(entry: &StreamEntry, g: &mut MutexGuard<'_, StreamInner>) -> Option<StreamDelta> {
    let (seq, ops, last_event_unix_ms) = g.state.take_delta()?;
    let cov = g.state.reported_coverage();
    Some(StreamDelta {
        stream: Some(entry.shared.spec.descriptor.clone()),
        seq,
        ops,
        last_event_unix_ms,
        coverage: cov.state.to_proto() as i32,
        coverage_reason: cov.reason_str().to_string(),
    })
}

/// The stream's full state (see [`StreamState::snapshot`]), under the held lock `g`.
fn snapshot_of(entry: &StreamEntry, g: &mut MutexGuard<'_, StreamInner>) -> StreamSnapshot {
    let (seq, entries, stale) = g.state.snapshot();
    let cov = g.state.reported_coverage();
    StreamSnapshot {
        stream: Some(entry.shared.spec.descriptor.clone()),
        seq,
        entries,
        last_event_unix_ms: g.state.last_event_unix_ms(),
        stale,
        coverage: cov.state.to_proto() as i32,
        coverage_reason: cov.reason_str().to_string(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use ic_shared::plan::{EnginePlan, HashScheme, KvEventSource};

    fn plan(endpoint: &str) -> NodePlan {
        NodePlan {
            engines: vec![EnginePlan {
                namespace: "ns".into(),
                pod: "p".into(),
                model: "m".into(),
                hash_scheme: HashScheme::Sglang,
                block_size: 16,
                backend: "ns/b".into(),
                kv_events: vec![
                    KvEventSource {
                        endpoint: endpoint.into(),
                        dp_rank: 0,
                        ..KvEventSource::default()
                    },
                    KvEventSource {
                        endpoint: endpoint.into(),
                        dp_rank: 1,
                        ..KvEventSource::default()
                    },
                ],
                ..EnginePlan::default()
            }],
            ..NodePlan::default()
        }
    }

    /// What changed since the last delta is taken as a delta and the snapshot in one hold of
    /// the stream's lock, at the same seq: the controller stream that asked for the snapshot
    /// drops that delta (its snapshot holds it), every other one applies it — a change never
    /// reaches one controller in a snapshot and the others not at all.
    #[test]
    fn a_snapshot_is_taken_with_the_deltas_it_covers() {
        let reg = prometheus::Registry::new();
        let hub = KvHub::new(&reg).unwrap();
        hub.apply_plan(&plan("tcp://127.0.0.1:1"));
        // Without a runtime the streams read Disconnected; that first change leaves as deltas.
        assert_eq!(hub.take_deltas().len(), 2);
        {
            let streams = hub.streams();
            let mut g = streams.get("ns/p#0").unwrap().shared.lock();
            g.state.set_link(LinkState::EngineDown);
        }
        let (deltas, snaps) = hub.take_deltas_and_snapshot();
        assert_eq!(deltas.len(), 1, "{deltas:?}");
        let d = &deltas[0];
        assert_eq!(d.stream.as_ref().unwrap().stream_id, "ns/p#0");
        assert_eq!(
            (d.seq, d.coverage),
            (2, ic_shared::proto::Coverage::EngineDown as i32)
        );
        let s = snaps
            .iter()
            .find(|s| s.stream.as_ref().unwrap().stream_id == "ns/p#0")
            .unwrap();
        assert_eq!((s.seq, s.coverage), (d.seq, d.coverage));
        // Nothing is left to send after them.
        assert!(hub.take_deltas().is_empty());
    }

    #[test]
    fn plan_streams_are_listed_with_their_descriptors_and_removed_with_the_plan() {
        let reg = prometheus::Registry::new();
        let hub = KvHub::new(&reg).unwrap();
        // No runtime here: streams are listed but not started.
        hub.apply_plan(&plan("tcp://127.0.0.1:1"));
        let snap = hub.take_deltas_and_snapshot().1;
        assert_eq!(snap.len(), 2);
        let d = snap[1].stream.as_ref().unwrap();
        assert_eq!(d.stream_id, "ns/p#1");
        assert_eq!(d.replica, "p#1");
        assert_eq!(d.tenant, "ns");
        assert_eq!(d.model, "m");
        assert_eq!(d.hash_scheme, "sglang");
        assert_eq!(d.backend, "ns/b");
        // Seq 1: the streams' first coverage (Disconnected, no runtime) left as a delta with it.
        assert_eq!(
            (snap[0].seq, snap[0].entries.len(), snap[0].stale),
            (1, 0, false)
        );
        let status = hub.status();
        assert!(status[0].last_error.as_deref().unwrap().contains("runtime"));
        let json = serde_json::to_value(&status[0]).unwrap();
        assert!(json.get("streamId").is_some() && json.get("blocksHeld").is_some());
        // Within a runtime, the same plan starts the listed streams.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async { hub.apply_plan(&plan("tcp://127.0.0.1:1")) });
        for st in hub.status() {
            assert!(!st.last_error.unwrap_or_default().contains("runtime"));
        }
        // A changed spec restarts the stream; its next delta skips a seq (forces a resync):
        // after the snapshot's seq 1 comes 3.
        let mut changed = plan("tcp://127.0.0.1:1");
        changed.engines[0].keeps_l2 = true;
        hub.apply_plan(&changed);
        let deltas = hub.take_deltas();
        assert_eq!(deltas.iter().map(|d| d.seq).collect::<Vec<_>>(), vec![3, 3]);
        hub.apply_plan(&NodePlan::default());
        assert!(hub.take_deltas_and_snapshot().1.is_empty());
        assert!(hub.take_deltas().is_empty());
        // A second hub on the same registry is refused.
        assert!(KvHub::new(&reg).is_err());
    }
}
