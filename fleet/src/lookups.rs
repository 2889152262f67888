//! The gateway side: `RouterService.LookupRoute` over loopback gRPC at a fixed rate, asking for a
//! live prompt of a random replica and checking the answer (that replica first, the whole
//! chain matched), with each round trip's latency.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ic_shared::proto::{router_service_client::RouterServiceClient, Decision, LookupRouteRequest};
use parking_lot::Mutex;

use crate::agents::Fleet;
use crate::spec::{BLOCK_SIZE, MODEL};

/// How one answer compares with what the fleet holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The asked replica first, with the whole chain matched.
    Exact,
    /// NO_HINT (the replica's resync has not arrived yet, or a lookup timeout).
    NoHint,
    /// PREFIX_MATCH on other replicas within the tenant's shared prefix only: the asked
    /// replica's resync has not arrived yet (correct then).
    Elsewhere,
    /// PREFIX_MATCH, but neither of the above: not the asked replica at full depth first.
    Wrong,
    /// The call failed (controller down or restarting).
    Error,
}

/// One lookup: when it was sent (since the run started), its round trip, its verdict.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// Send time since the run started.
    pub at: Duration,
    /// Round trip, µs.
    pub rtt_us: u64,
    /// Verdict.
    pub verdict: Verdict,
}

/// Runs lookups at `rate` per second until the fleet stops, appending to `out`.
pub async fn run(
    fleet: Arc<Fleet>,
    url: String,
    rate: u32,
    t0: Instant,
    out: Arc<Mutex<Vec<Sample>>>,
) {
    let Ok(endpoint) = tonic::transport::Endpoint::from_shared(url) else {
        return;
    };
    let channel = endpoint
        .connect_timeout(Duration::from_secs(1))
        .timeout(Duration::from_secs(2))
        .connect_lazy();
    let mut client = RouterServiceClient::new(channel);
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(rate.max(1))));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let spec = &fleet.spec;
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    while !fleet.stop.load(Ordering::Relaxed) {
        tick.tick().await;
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let a = (rng % spec.agents as u64) as usize;
        let g = ((rng >> 32) % spec.streams_per_agent as u64) as usize;
        // A prompt in the middle of the live window: churn in flight cannot have evicted it.
        let s = fleet.epochs[a].load(Ordering::Acquire) + spec.sequences as u64 / 2;
        let chain = spec.chain(a, g, s);
        let want = spec.engine(a, g).replica_id(0);
        let req = LookupRouteRequest {
            tenant: spec.tenant(a),
            model: MODEL.to_string(),
            hash_scheme: "vllm".into(),
            adapter: String::new(),
            token_ids: Vec::new(),
            content_keys: chain.clone(),
            block_size: BLOCK_SIZE,
            ..Default::default()
        };
        let sent = Instant::now();
        let r = client.lookup_route(req).await;
        let rtt_us = sent.elapsed().as_micros() as u64;
        let verdict = match r {
            Err(_) => Verdict::Error,
            Ok(resp) => {
                let resp = resp.into_inner();
                if resp.decision != Decision::PrefixMatch as i32 {
                    Verdict::NoHint
                } else {
                    match resp.replicas.first() {
                        Some(m)
                            if m.replica == want && m.matched_blocks as usize == chain.len() =>
                        {
                            Verdict::Exact
                        }
                        Some(m)
                            if m.replica != want
                                && m.matched_blocks as usize <= spec.shared_prefix =>
                        {
                            Verdict::Elsewhere
                        }
                        _ => Verdict::Wrong,
                    }
                }
            }
        };
        out.lock().push(Sample {
            at: sent - t0,
            rtt_us,
            verdict,
        });
    }
}

/// Latency and verdicts of the samples sent in `[from, to)`.
#[derive(Debug, Default, Clone)]
pub struct Window {
    /// Answered lookups (not `Error`).
    pub answered: usize,
    /// Calls that failed.
    pub errors: usize,
    /// Exact / no-hint / wrong answers.
    pub exact: usize,
    /// NO_HINT answers, and matches of the shared prefix on other replicas.
    pub no_hint: usize,
    /// Wrong answers.
    pub wrong: usize,
    /// Round-trip p50 / p99 / max of answered lookups, µs.
    pub p50_us: u64,
    /// p99.
    pub p99_us: u64,
    /// max.
    pub max_us: u64,
}

/// The window `[from, to)` of `samples`.
pub fn window(samples: &[Sample], from: Duration, to: Duration) -> Window {
    let mut w = Window::default();
    let mut rtts: Vec<u64> = Vec::new();
    for s in samples.iter().filter(|s| s.at >= from && s.at < to) {
        match s.verdict {
            Verdict::Error => {
                w.errors += 1;
                continue;
            }
            Verdict::Exact => w.exact += 1,
            Verdict::NoHint | Verdict::Elsewhere => w.no_hint += 1,
            Verdict::Wrong => w.wrong += 1,
        }
        rtts.push(s.rtt_us);
    }
    w.answered = rtts.len();
    rtts.sort_unstable();
    let q = |p: f64| {
        if rtts.is_empty() {
            0
        } else {
            rtts[((rtts.len() as f64 * p) as usize).min(rtts.len() - 1)]
        }
    };
    w.p50_us = q(0.50);
    w.p99_us = q(0.99);
    w.max_us = rtts.last().copied().unwrap_or(0);
    w
}
