//! The node-wide budget of KV-event bytes in flight (issue 38, D1): every live message an
//! engine sends is charged from the moment the reader takes it off the socket until the
//! processor has applied it (decoded, fed to the stream state, dropped), across all streams of
//! the agent. A message the budget cannot take is dropped and counted
//! (`inferencecache_agent_kv_events_dropped_total{reason="inflight_budget"}`), and its stream
//! reads Stale `TailUnverified` until the gap it left is healed — the index never silently
//! misses what was dropped.
//!
//! A message is charged, first, in the ZMTP relay: each frame of 64 KiB or more twice its size
//! (what the `zeromq` library may hold while it assembles the message) before the library sees
//! it, the relay waiting for the budget ([`super::super::zmtp_guard::RelayBudget`]); then, on
//! arrival, [`decoded_bytes_bound`](ic_shared::kv::decode::decoded_bytes_bound) of its payload
//! (what decoding it may allocate, counted before it is decoded) plus its bytes when the relay
//! charged none: a decoded batch is many times its wire size, so a budget of wire bytes alone
//! would not bound memory.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Default of `--kv-inflight-bytes`: 48 MiB.
pub const DEFAULT_INFLIGHT_BYTES: usize = 48 << 20;

/// The `reason` label of a message dropped because the budget was spent.
pub const DROP_REASON: &str = "inflight_budget";

/// Bytes charged by the messages in flight, against a limit (see the module docs). Cheap to
/// share (`Arc`); thread-safe.
#[derive(Debug)]
pub struct InflightBudget {
    limit: AtomicUsize,
    used: AtomicUsize,
}

impl InflightBudget {
    /// A budget of `limit` bytes, none used.
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            limit: AtomicUsize::new(limit),
            used: AtomicUsize::new(0),
        })
    }

    /// The limit, bytes.
    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    /// Sets the limit, bytes; messages already charged keep their charge.
    pub fn set_limit(&self, limit: usize) {
        self.limit.store(limit, Ordering::Relaxed);
    }

    /// Bytes charged now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Charges `bytes` when `used + bytes` stays within the limit; `None` (nothing charged)
    /// otherwise. The charge is returned when the permit is dropped.
    pub fn try_charge(self: &Arc<Self>, bytes: usize) -> Option<InflightPermit> {
        let limit = self.limit();
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&total| total <= limit)
            })
            .ok()?;
        Some(InflightPermit {
            budget: self.clone(),
            bytes,
        })
    }
}

/// A charge against an [`InflightBudget`], returned on drop.
#[derive(Debug)]
pub struct InflightPermit {
    budget: Arc<InflightBudget>,
    bytes: usize,
}

impl InflightPermit {
    /// Bytes charged.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Takes over `other`'s charge (same budget): one permit returns both on drop.
    pub fn absorb(&mut self, mut other: InflightPermit) {
        self.bytes += std::mem::take(&mut other.bytes);
    }
}

impl Drop for InflightPermit {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// Large buffers (at least 128 KiB) go back to the operating system when freed: glibc's malloc
/// otherwise raises its mmap threshold to the size of the last large block freed (up to 32 MiB),
/// after which a flood of 15 MiB messages is carved out of per-thread arenas that keep the
/// memory resident after the messages are gone (measured: 4 streams of 15 MiB messages, all
/// dropped, peaked at 187 MiB and stayed at 157 MiB; with a fixed threshold 133 MiB, back to
/// 21 MiB). Sets `M_MMAP_THRESHOLD`, which also turns the dynamic adjustment off; a no-op on
/// other C libraries. Call once at start-up, before other threads exist.
pub fn return_large_buffers_to_the_os() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes malloc's tuning parameters; called at start-up before any
    // other thread allocates.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 << 10);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_stay_within_the_limit_and_come_back_on_drop() {
        let b = InflightBudget::new(100);
        let a = b.try_charge(60);
        assert!(a.is_some());
        assert!(b.try_charge(41).is_none());
        let c = b.try_charge(40);
        assert_eq!(b.used(), 100);
        drop(a);
        assert_eq!(b.used(), 40);
        assert!(b.try_charge(usize::MAX).is_none());
        drop(c);
        assert_eq!(b.used(), 0);
        b.set_limit(10);
        assert!(b.try_charge(11).is_none());
    }
}
