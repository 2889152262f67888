//! The back-off of every watch the controller runs (kube-runtime Controllers' trigger streams,
//! the followers, the webhook's stores).
//!
//! kube-runtime's default (800 ms doubling to 30 s with jitter, reset only after 120 s without
//! an error) is shared by *all* the watches of one Controller — the CacheBackend controller
//! merges five — and pauses the whole merged stream. After a kube-apiserver restart each watch
//! fails once when its connection drops and again with `410 Gone` once etcd has compacted past
//! its resourceVersion; measured on a real apiserver (controller/tests/real_apiserver_restart.rs),
//! those few errors pushed the next re-list 51 s out and no CacheBackend was reconciled for over
//! two minutes. Errors here are the apiserver going away or a re-list being due, not load to
//! shed, so the back-off stays short: 100 ms doubling to at most 5 s (with jitter), reset after
//! 15 s without an error.

use std::time::Duration;

use kube::runtime::utils::ResetTimerBackoff;
use kube::runtime::watcher::ExponentialBackoff;

/// First delay after a watch error.
pub const WATCH_BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Longest delay between re-list attempts.
pub const WATCH_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Quiet time after which the delay starts again from [`WATCH_BACKOFF_MIN`].
pub const WATCH_BACKOFF_RESET: Duration = Duration::from_secs(15);

/// The back-off for one watch stream (or one Controller's merged trigger stream).
pub fn watch_backoff() -> ResetTimerBackoff<ExponentialBackoff> {
    let exponential = backon::ExponentialBuilder::default()
        .with_min_delay(WATCH_BACKOFF_MIN)
        .with_max_delay(WATCH_BACKOFF_MAX)
        .with_factor(2.0)
        .with_jitter()
        .without_max_times();
    ResetTimerBackoff::new(exponential.into(), WATCH_BACKOFF_RESET)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watch_backoff_starts_short_stays_bounded_and_never_gives_up() {
        let delays: Vec<Duration> = watch_backoff().take(50).collect();
        assert_eq!(delays.len(), 50, "never exhausted");
        // Jitter adds up to one more delay of the same size.
        assert!(
            delays[0] >= WATCH_BACKOFF_MIN && delays[0] <= 2 * WATCH_BACKOFF_MIN,
            "{delays:?}"
        );
        assert!(
            delays.iter().all(|d| *d <= 2 * WATCH_BACKOFF_MAX),
            "{delays:?}"
        );
        assert!(delays[49] >= WATCH_BACKOFF_MAX, "{delays:?}");
    }
}
