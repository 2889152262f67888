//! Per-stage timestamps of the KV delta path (engine batch → agent → controller index), for
//! benchmarks and tests that need to know *where* publish → visible time is spent
//! (`ic-bench`'s publish → visible, docs/benchmarks.md).
//!
//! Writers call [`mark`] at each [`Stage`]: a `TRACE` event of target [`TARGET`] with the fields
//! `stage` ([`Stage::as_str`]) and `id` (the engine's batch seq for the agent's KV stages, the
//! agent's `KvDeltaBatch.batch_id` for the link and controller stages). Under the binaries'
//! logging (`info` and above unless `RUST_LOG` asks for `inferencecache::timing=trace`) the event
//! is disabled at its call site: one relaxed atomic load, nothing recorded.
//!
//! Readers install a [`Recorder`] (a `tracing_subscriber` layer that keeps only these events,
//! each stamped with the wall clock when it was emitted) and read its [`Mark`]s back in emission
//! order. One definition for both sides: the stage names are parsed with [`Stage::parse`].

use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::field::{Field, Visit};
use tracing::subscriber::{Interest, Subscriber};
use tracing::{Event, Metadata};
use tracing_subscriber::layer::{Context, Layer};

/// The tracing target of every timing event.
pub const TARGET: &str = "inferencecache::timing";

/// Where a KV batch is on its way from the engine to the controller's index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stage {
    /// Agent: the engine's ZMQ message arrived on the SUB socket (`id` = engine batch seq).
    KvReceived,
    /// Agent: that batch is decoded and applied to the stream's state; its ops are pending
    /// (`id` = engine batch seq).
    KvApplied,
    /// Agent link: pending ops were taken into a `KvDeltaBatch` (`id` = batch id). Every batch
    /// applied before this mark (in emission order) is in it or an earlier one.
    BatchTaken,
    /// Agent link: the batch was handed to a controller stream's outbound queue (`id` = batch
    /// id; one mark per controller replica).
    BatchSent,
    /// Controller: the batch arrived on the agent's stream (`id` = batch id).
    BatchReceived,
    /// Controller: the batch went through the index (every delta applied, or those before the
    /// first refused one, which requests a resync) and the write lock is released; a lookup
    /// from now on sees it (`id` = batch id). A batch refused whole (a resync is awaited) has
    /// no such mark.
    BatchApplied,
}

impl Stage {
    /// Every stage, in path order.
    pub const ALL: [Stage; 6] = [
        Stage::KvReceived,
        Stage::KvApplied,
        Stage::BatchTaken,
        Stage::BatchSent,
        Stage::BatchReceived,
        Stage::BatchApplied,
    ];

    /// The `stage` field's value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Stage::KvReceived => "kv_received",
            Stage::KvApplied => "kv_applied",
            Stage::BatchTaken => "batch_taken",
            Stage::BatchSent => "batch_sent",
            Stage::BatchReceived => "batch_received",
            Stage::BatchApplied => "batch_applied",
        }
    }

    /// The stage a `stage` field names; `None` for anything else.
    pub fn parse(s: &str) -> Option<Stage> {
        Stage::ALL.into_iter().find(|st| st.as_str() == s)
    }
}

/// Emits the timing event of `stage` for `id` (see the module docs).
#[inline]
pub fn mark(stage: Stage, id: u64) {
    tracing::trace!(target: TARGET, stage = stage.as_str(), id);
}

/// One recorded event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark {
    /// The stage.
    pub stage: Stage,
    /// Engine batch seq or batch id (see [`Stage`]).
    pub id: u64,
    /// Wall clock when it was emitted, ns since the Unix epoch (comparable with another
    /// process's clock on the same host, e.g. Python's `time.time_ns()`).
    pub unix_ns: u64,
}

/// A `tracing_subscriber` layer keeping the timing events (and enabling nothing else).
#[derive(Debug, Clone, Default)]
pub struct Recorder {
    marks: Arc<Mutex<Vec<Mark>>>,
}

impl Recorder {
    /// An empty recorder.
    pub fn new() -> Self {
        Self::default()
    }

    /// A subscriber that feeds only this recorder; install it with
    /// `tracing::subscriber::set_global_default` (every thread) or `set_default` (this thread).
    pub fn subscriber(&self) -> impl Subscriber + Send + Sync + 'static {
        use tracing_subscriber::layer::SubscriberExt;
        tracing_subscriber::registry().with(self.clone())
    }

    /// Takes the marks recorded so far, in emission order.
    pub fn take(&self) -> Vec<Mark> {
        std::mem::take(&mut *self.lock())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Mark>> {
        self.marks.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

#[derive(Default)]
struct Fields {
    stage: Option<Stage>,
    id: Option<u64>,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "stage" {
            self.stage = Stage::parse(value);
        }
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "id" {
            self.id = Some(value);
        }
    }

    fn record_debug(&mut self, _field: &Field, _value: &dyn std::fmt::Debug) {}
}

impl<S: Subscriber> Layer<S> for Recorder {
    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        if metadata.target() == TARGET {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn enabled(&self, metadata: &Metadata<'_>, _ctx: Context<'_, S>) -> bool {
        metadata.target() == TARGET
    }

    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let unix_ns = unix_ns();
        let mut f = Fields::default();
        event.record(&mut f);
        if let (Some(stage), Some(id)) = (f.stage, f.id) {
            self.lock().push(Mark { stage, id, unix_ns });
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn marks_come_back_in_order_with_their_stage_and_id_and_nothing_else() {
        let rec = Recorder::new();
        let before = unix_ns();
        tracing::subscriber::with_default(rec.subscriber(), || {
            mark(Stage::KvReceived, 7);
            tracing::info!("an ordinary log line is not a mark");
            tracing::trace!(target: TARGET, stage = "not_a_stage", id = 1u64);
            mark(Stage::BatchApplied, 3);
        });
        let marks = rec.take();
        assert_eq!(
            marks.iter().map(|m| (m.stage, m.id)).collect::<Vec<_>>(),
            vec![(Stage::KvReceived, 7), (Stage::BatchApplied, 3)]
        );
        assert!(marks[0].unix_ns >= before && marks[1].unix_ns >= marks[0].unix_ns);
        assert!(rec.take().is_empty(), "take empties the recorder");
    }

    #[test]
    fn stage_names_round_trip() {
        for s in Stage::ALL {
            assert_eq!(Stage::parse(s.as_str()), Some(s));
        }
        assert_eq!(Stage::parse("kv_receivedx"), None);
    }
}
