//! The latest SGLang HiCache host-tier readings of engine streams (issue 19 item 4), as the
//! node agents report them in `CounterReport`s (`StreamCounters.host_tier_written_tokens` /
//! `host_tier_served_tokens`), for the `HiCacheHostTier` condition
//! (`crate::reconcile::cachebackend::host_tier`).
//!
//! Unlike the tier-2 counters in the index (kept at their last value: a ratio over a lifetime),
//! a reading here is only ever the current one, because the condition must never read True
//! from numbers of an engine or a connection that is gone:
//!
//! - a report without the pair removes the stream's reading (the engine stopped exporting it,
//!   or the agent's last scrape of it failed — the agent drops the pair then), and a report
//!   that no longer lists a stream removes its reading (a report is the reporter's whole set);
//! - a `Resync` of a reporter removes all of its readings (the agent sends its counters again
//!   right after);
//! - the end of a reporter's current stream removes all of its readings (a restarted or
//!   reconnected agent reports again).
//!
//! Readings are keyed by stream id and filed under the reporter (the node, or a per-pod
//! subscriber's key) whose connection sent them.

use std::collections::HashMap;

use ic_shared::proto::StreamCounters;

/// One stream's host-tier counters, cumulative since its engine started (tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HostTierReading {
    /// Tokens backed up GPU → host for the stream's rank
    /// (`sglang:hicache_backup_tokens_total{pool="kv"}`).
    pub written_tokens: u64,
    /// Prompt tokens the pod served from the host tier
    /// (`sglang:cached_tokens_total{cache_source="host"}`; the pod's, on each of its streams).
    pub served_tokens: u64,
    /// Unix ms of the agent's scrape.
    pub observed_at_unix_ms: i64,
}

impl HostTierReading {
    /// The reading a `StreamCounters` carries: `None` unless both fields are present.
    pub fn from_counters(c: &StreamCounters) -> Option<Self> {
        Some(HostTierReading {
            written_tokens: c.host_tier_written_tokens?,
            served_tokens: c.host_tier_served_tokens?,
            observed_at_unix_ms: c.observed_at_unix_ms,
        })
    }
}

/// The current readings, by stream id.
#[derive(Debug, Default)]
pub struct HostTierReadings {
    by_stream: HashMap<String, (String, HostTierReading)>,
}

impl HostTierReadings {
    /// Records what `reporter` said of `stream_id`: its reading, or none (removed).
    pub fn record(&mut self, reporter: &str, stream_id: &str, c: &StreamCounters) {
        match HostTierReading::from_counters(c) {
            Some(r) => {
                self.by_stream
                    .insert(stream_id.to_string(), (reporter.to_string(), r));
            }
            None => {
                self.by_stream.remove(stream_id);
            }
        }
    }

    /// Records one whole `CounterReport` of `reporter`: the report is every stream's latest
    /// counters (the agent's `EngineCounters::report`), so a reading of `reporter`'s that the
    /// report no longer lists is removed too (its engine left the plan).
    pub fn record_report<'a>(
        &mut self,
        reporter: &str,
        streams: impl IntoIterator<Item = (&'a str, &'a StreamCounters)>,
    ) {
        let mut listed = std::collections::HashSet::new();
        for (id, c) in streams {
            self.record(reporter, id, c);
            listed.insert(id);
        }
        self.by_stream
            .retain(|id, (r, _)| r != reporter || listed.contains(id.as_str()));
    }

    /// Removes every reading `reporter` sent (its resync, or its stream ended).
    pub fn forget_reporter(&mut self, reporter: &str) {
        self.by_stream.retain(|_, (r, _)| r != reporter);
    }

    /// The current reading of `stream_id`.
    pub fn get(&self, stream_id: &str) -> Option<HostTierReading> {
        self.by_stream.get(stream_id).map(|(_, r)| *r)
    }

    /// Number of streams with a reading.
    pub fn len(&self) -> usize {
        self.by_stream.len()
    }

    /// True when no stream has a reading.
    pub fn is_empty(&self) -> bool {
        self.by_stream.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters(written: Option<u64>, served: Option<u64>) -> StreamCounters {
        StreamCounters {
            host_tier_written_tokens: written,
            host_tier_served_tokens: served,
            observed_at_unix_ms: 7,
            ..Default::default()
        }
    }

    #[test]
    fn a_reading_is_only_ever_the_current_one() {
        let mut r = HostTierReadings::default();
        r.record("n1", "ns/a#0", &counters(Some(5), Some(3)));
        r.record("n2", "ns/b#0", &counters(Some(1), Some(0)));
        assert_eq!(
            r.get("ns/a#0"),
            Some(HostTierReading {
                written_tokens: 5,
                served_tokens: 3,
                observed_at_unix_ms: 7
            })
        );
        // Half a pair is no reading; a report without it removes the old one.
        r.record("n1", "ns/a#0", &counters(Some(9), None));
        assert_eq!(r.get("ns/a#0"), None);
        r.record("n1", "ns/a#0", &counters(Some(5), Some(3)));
        // A reporter's resync or disconnect forgets only its own readings.
        r.forget_reporter("n1");
        assert_eq!((r.get("ns/a#0"), r.len()), (None, 1));
        assert!(r.get("ns/b#0").is_some());
        r.forget_reporter("n2");
        assert!(r.is_empty());
    }

    /// A report is the reporter's whole set: a stream it no longer lists loses its reading,
    /// another reporter's stay.
    #[test]
    fn a_report_replaces_the_reporters_whole_set() {
        let mut r = HostTierReadings::default();
        let c = counters(Some(5), Some(3));
        r.record_report("n1", [("ns/a#0", &c), ("ns/b#0", &c)]);
        r.record_report("n2", [("ns/c#0", &c)]);
        r.record_report("n1", [("ns/b#0", &c)]);
        assert_eq!(r.get("ns/a#0"), None, "the engine left n1's report");
        assert!(r.get("ns/b#0").is_some() && r.get("ns/c#0").is_some());
    }
}
