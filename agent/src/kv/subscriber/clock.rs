//! The engine clock's skew against ours, estimated from the fastest batches and left out of
//! the stream-lag gauge.

/// Engine clock minus agent clock beyond which the skew is flagged (a WARN) and taken out of
/// the stream lag, seconds. NTP keeps nodes within milliseconds; a batch's own delay is
/// milliseconds too.
pub const CLOCK_SKEW_FLAG_SECONDS: f64 = 2.0;
/// Minutes of live batches the skew estimate looks back over.
const CLOCK_SKEW_WINDOW_MINUTES: i64 = 10;

/// The estimate of one stream's engine clock skew (issue 37 item 8). A live batch's
/// `ts − arrival` is the engine clock's lead over the agent's minus the batch's delay (≥ 0), so
/// its largest value over a window is the skew less the smallest delay — milliseconds on a
/// healthy stream. Kept as one maximum per minute of agent time, over the last
/// [`CLOCK_SKEW_WINDOW_MINUTES`]: a clock corrected by NTP leaves the estimate within that.
/// A stream whose every batch of the window arrived seconds late reads the same as skew.
#[derive(Debug, Default, Clone)]
pub(crate) struct ClockSkew {
    /// `(minute of agent time, max of ts − arrival in seconds)`, oldest first.
    minutes: std::collections::VecDeque<(i64, f64)>,
    /// The skew was beyond [`CLOCK_SKEW_FLAG_SECONDS`] at the last sample.
    pub flagged: bool,
}

impl ClockSkew {
    /// Adds a live batch's engine `ts` (unix seconds) arriving at `now_ms` (agent unix ms);
    /// returns the estimate, seconds.
    pub fn observe(&mut self, now_ms: i64, ts: f64) -> f64 {
        let minute = now_ms.div_euclid(60_000);
        let sample = ts - now_ms as f64 / 1000.0;
        if self.minutes.back().is_some_and(|(m, _)| *m > minute) {
            // The agent's own clock went back: start over.
            self.minutes.clear();
        }
        match self.minutes.back_mut() {
            Some((m, v)) if *m == minute => *v = v.max(sample),
            _ => self.minutes.push_back((minute, sample)),
        }
        while self
            .minutes
            .front()
            .is_some_and(|(m, _)| *m <= minute - CLOCK_SKEW_WINDOW_MINUTES)
        {
            self.minutes.pop_front();
        }
        self.estimate().unwrap_or(sample)
    }

    /// The estimate (engine − agent, seconds), `None` before any sample.
    pub fn estimate(&self) -> Option<f64> {
        self.minutes.iter().map(|(_, v)| *v).reduce(f64::max)
    }
}

/// The stream lag of a live batch: agent time − engine `ts`, plus the `skew` (engine − agent)
/// when it is flagged, so an engine clock hours off does not read as hours of lag.
pub(crate) fn corrected_lag(now_ms: i64, ts: f64, skew: f64) -> f64 {
    let raw = now_ms as f64 / 1000.0 - ts;
    if skew.abs() > CLOCK_SKEW_FLAG_SECONDS {
        raw + skew
    } else {
        raw
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_skew_is_estimated_from_the_fastest_batch_and_left_out_of_the_lag() {
        let mut c = ClockSkew::default();
        let t0 = 1_767_225_600_000i64;
        // An engine 6 h ahead; batches arrive 5 ms to 2 s after they were stamped.
        let ahead = 21_600.0;
        for (i, delay_ms) in [2000i64, 5, 300, 40].iter().enumerate() {
            let now = t0 + i as i64 * 1000;
            let ts = (now - delay_ms) as f64 / 1000.0 + ahead;
            c.observe(now, ts);
        }
        let skew = c.estimate().unwrap();
        assert!((skew - (ahead - 0.005)).abs() < 1e-3, "{skew}");
        // A batch 300 ms late reads 300 ms of lag, not -6 h.
        let now = t0 + 10_000;
        let lag = corrected_lag(now, (now - 300) as f64 / 1000.0 + ahead, skew);
        assert!((lag - 0.295).abs() < 1e-3, "{lag}");
        // Without skew the lag is the raw difference, whatever the estimate's milliseconds.
        assert!((corrected_lag(now, (now - 300) as f64 / 1000.0, -0.004) - 0.3).abs() < 1e-6);
        // The window forgets: 10 minutes later a corrected clock reads as such.
        let later = t0 + 11 * 60_000;
        let s = c.observe(later, (later - 5) as f64 / 1000.0);
        assert!(s.abs() < 0.01, "{s}");
        // An engine behind by 2 h.
        let mut c = ClockSkew::default();
        c.observe(t0, (t0 - 10) as f64 / 1000.0 - 7200.0);
        assert!((c.estimate().unwrap() + 7200.01).abs() < 1e-3);
    }
}
