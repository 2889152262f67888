//! The injected clock (STYLE.md "Rate-limited status writers with an injected clock").
//!
//! Every time-dependent decision in the reconcilers (the `firstAvailableAt` / KV-event latches,
//! the `firstEventTimeout` window, the functional-probe and cascade rate limits) reads the time
//! from a [`Clock`], so tests drive time with a [`FakeClock`] instead of sleeping.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use parking_lot::Mutex;

/// A source of the current time.
pub trait Clock: Send + Sync {
    /// The current instant (UTC).
    fn now(&self) -> Timestamp;
}

/// The wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }
}

/// A clock tests set and advance by hand. Starts where it is told to and only moves on
/// [`FakeClock::advance`] or [`FakeClock::set`].
#[derive(Debug)]
pub struct FakeClock {
    now: Mutex<Timestamp>,
}

impl FakeClock {
    /// A clock reading `at`.
    pub fn new(at: Timestamp) -> Self {
        FakeClock {
            now: Mutex::new(at),
        }
    }

    /// A clock reading `seconds` after the Unix epoch (the epoch itself if out of range).
    pub fn at_unix_seconds(seconds: i64) -> Self {
        Self::new(Timestamp::from_second(seconds).unwrap_or(Timestamp::UNIX_EPOCH))
    }

    /// Moves the clock forward by `by` (saturating at the maximum timestamp).
    pub fn advance(&self, by: Duration) {
        let mut now = self.now.lock();
        let step = SignedDuration::try_from(by).unwrap_or(SignedDuration::MAX);
        *now = now.checked_add(step).unwrap_or(Timestamp::MAX);
    }

    /// Sets the clock to `at`.
    pub fn set(&self, at: Timestamp) {
        *self.now.lock() = at;
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Timestamp {
        *self.now.lock()
    }
}

/// `ts` truncated to whole seconds as a `metav1.Time` (the precision the API server stores, so
/// a value written and read back compares equal).
pub fn to_time(ts: Timestamp) -> Time {
    Time(Timestamp::from_second(ts.as_second()).unwrap_or(ts))
}

/// Time elapsed from `since` to `now`; zero when `since` is in the future.
pub fn elapsed(since: &Time, now: Timestamp) -> Duration {
    let d = now.duration_since(since.0);
    Duration::try_from(d).unwrap_or(Duration::ZERO)
}

/// `at + by` (saturating).
pub fn add(at: Timestamp, by: Duration) -> Timestamp {
    let step = SignedDuration::try_from(by).unwrap_or(SignedDuration::MAX);
    at.checked_add(step).unwrap_or(Timestamp::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_clock_advances_and_truncates() {
        let c = FakeClock::at_unix_seconds(1_000);
        c.advance(Duration::from_millis(1_500));
        assert_eq!(c.now().as_millisecond(), 1_001_500);
        assert_eq!(to_time(c.now()).0.as_second(), 1_001);
        assert_eq!(
            elapsed(&to_time(Timestamp::from_second(990).unwrap()), c.now()),
            Duration::from_millis(11_500)
        );
        assert_eq!(
            elapsed(&to_time(Timestamp::from_second(2_000).unwrap()), c.now()),
            Duration::ZERO
        );
    }
}
