//! The functional-probe gate's inputs (spec 000 "Functional-probe gate").
//!
//! The probe itself (a synthetic ingest → routing → tier-2 round trip through the in-process
//! index) is an effect behind the [`Prober`] trait; the reconciler calls it at most once per
//! backend per rate-limit window (~30 s) and only when the upstream gates say Ready=True. A
//! controller wired without a prober (the spec's `--server-probe-url=""`) has the gate off and
//! clears any stale FunctionalProbeOK.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::future::BoxFuture;
use ic_shared::crd::CacheBackend;
use parking_lot::Mutex;

/// The result of one probe stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StageResult {
    /// Round-tripped.
    Ok,
    /// Not run (e.g. no tier-2 prober is registered).
    Skipped,
    /// Failed; the server's diagnostic.
    Failed(String),
}

/// Per-stage outcome of a completed probe call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeStages {
    /// Stage A: a synthesized event reaches the index.
    pub ingest: StageResult,
    /// Stage B: the index routes a lookup to it.
    pub routing: StageResult,
    /// Stage C: the tier-2 backend accepts a put and returns it on get.
    pub t2: StageResult,
}

/// What a probe call returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeOutcome {
    /// The probe ran; per-stage results.
    Completed(ProbeStages),
    /// The probe endpoint could not be reached (transport error, 5xx); the error text.
    TransportError(String),
}

/// What the status computation knows about the probe this reconcile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeInput {
    /// No probe call was made (yet) in this reconcile.
    NotRun,
    /// A probe call was made; its outcome.
    Ran(ProbeOutcome),
}

/// Runs the functional probe for one backend.
pub trait Prober: Send + Sync {
    /// Probes `cb`'s cache-plane round trip. Never fails: transport problems are an outcome.
    fn probe<'a>(&'a self, cb: &'a CacheBackend) -> BoxFuture<'a, ProbeOutcome>;
}

/// A prober from a synchronous function — e.g. a closure over the in-process `/probe`
/// implementation (`crate::probe::run`) that maps its per-stage report to a [`ProbeOutcome`].
pub struct FnProber<F>(pub F);

impl<F> Prober for FnProber<F>
where
    F: Fn(&CacheBackend) -> ProbeOutcome + Send + Sync,
{
    fn probe<'a>(&'a self, cb: &'a CacheBackend) -> BoxFuture<'a, ProbeOutcome> {
        let outcome = (self.0)(cb);
        Box::pin(async move { outcome })
    }
}

/// A scripted prober for tests: answers queued outcomes in order, then repeats the last one
/// (all stages ok when nothing was ever queued), and counts calls.
#[derive(Debug, Default)]
pub struct FakeProber {
    queue: Mutex<VecDeque<ProbeOutcome>>,
    last: Mutex<Option<ProbeOutcome>>,
    calls: AtomicUsize,
}

impl FakeProber {
    /// A prober that answers all-ok.
    pub fn new() -> Self {
        Self::default()
    }

    /// Queues the next answer.
    pub fn push(&self, outcome: ProbeOutcome) {
        self.queue.lock().push_back(outcome);
    }

    /// Number of probe calls so far.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// All stages ok (t2 skipped, as on every install today).
    pub fn all_ok() -> ProbeOutcome {
        ProbeOutcome::Completed(ProbeStages {
            ingest: StageResult::Ok,
            routing: StageResult::Ok,
            t2: StageResult::Skipped,
        })
    }
}

impl Prober for FakeProber {
    fn probe<'a>(&'a self, _cb: &'a CacheBackend) -> BoxFuture<'a, ProbeOutcome> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let next = self.queue.lock().pop_front();
        let outcome = match next {
            Some(o) => {
                *self.last.lock() = Some(o.clone());
                o
            }
            None => self.last.lock().clone().unwrap_or_else(Self::all_ok),
        };
        Box::pin(async move { outcome })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn fn_prober_and_fake_prober_answer() {
        let cb = CacheBackend::default();
        let p = FnProber(|_: &CacheBackend| ProbeOutcome::TransportError("down".to_string()));
        assert_eq!(
            p.probe(&cb).await,
            ProbeOutcome::TransportError("down".to_string())
        );
        let f = FakeProber::new();
        assert_eq!(f.probe(&cb).await, FakeProber::all_ok());
        f.push(ProbeOutcome::TransportError("x".to_string()));
        assert_eq!(
            f.probe(&cb).await,
            ProbeOutcome::TransportError("x".to_string())
        );
        assert_eq!(
            f.probe(&cb).await,
            ProbeOutcome::TransportError("x".to_string())
        );
        assert_eq!(f.calls(), 3);
    }
}
