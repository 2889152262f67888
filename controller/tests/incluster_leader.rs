//! Lease leader election: the pure state machine with an injected time. The kube layer (two
//! candidates, renewals, expiry, takeover, release, a lost race, the election loop) runs against
//! the real apiserver: `real_apiserver/leader.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use ic_controller::leader::{ElectionConfig, Elector, LeaseRecord, Step};
use k8s_openapi::jiff::Timestamp;

fn t(s: i64) -> Timestamp {
    Timestamp::from_second(s).unwrap()
}

fn cfg(id: &str) -> ElectionConfig {
    ElectionConfig {
        identity: id.into(),
        lease_duration: Duration::from_secs(15),
        renew_deadline: Duration::from_secs(10),
        retry_period: Duration::from_secs(2),
    }
}

fn held_by(holder: &str, renew: i64, transitions: i32) -> LeaseRecord {
    LeaseRecord {
        holder: Some(holder.into()),
        lease_duration_seconds: 15,
        acquire_time: Some(t(0)),
        renew_time: Some(t(renew)),
        transitions,
    }
}

#[test]
fn a_candidate_follows_a_live_lease_and_takes_over_an_expired_one() {
    let mut b = Elector::new(cfg("b"));
    b.observe(Some(&held_by("a", 100, 0)), t(1000));
    match b.next_step(t(1010)) {
        Step::Follow { holder, until } => {
            assert_eq!(holder, "a");
            assert_eq!(
                until,
                t(1015),
                "expiry runs on our clock from when we saw the record"
            );
        }
        s => panic!("{s:?}"),
    }
    // The holder renews: the observation time moves, so the lease lives on.
    b.observe(Some(&held_by("a", 112, 0)), t(1012));
    assert!(matches!(b.next_step(t(1020)), Step::Follow { .. }));
    // No renewal for a whole lease duration: take over, counting a transition.
    b.observe(Some(&held_by("a", 112, 0)), t(1027));
    match b.next_step(t(1027)) {
        Step::Update(r) => {
            assert_eq!(r.holder(), Some("b"));
            assert_eq!(r.transitions, 1);
            assert_eq!(r.acquire_time, Some(t(1027)));
        }
        s => panic!("{s:?}"),
    }
    assert!(!b.is_leader(t(1027)), "not before the write succeeded");
}

#[test]
fn a_released_lease_is_taken_at_once_and_renewals_keep_the_acquire_time() {
    let mut a = Elector::new(cfg("a"));
    let released = LeaseRecord {
        holder: None,
        lease_duration_seconds: 1,
        transitions: 4,
        ..Default::default()
    };
    a.observe(Some(&released), t(50));
    let Step::Update(rec) = a.next_step(t(50)) else {
        panic!()
    };
    assert_eq!((rec.holder(), rec.transitions), (Some("a"), 5));
    a.succeeded(rec, t(50));
    assert!(a.is_leader(t(55)));
    let Step::Update(renewal) = a.next_step(t(52)) else {
        panic!()
    };
    assert_eq!(renewal.acquire_time, Some(t(50)));
    assert_eq!(renewal.renew_time, Some(t(52)));
    assert_eq!(renewal.transitions, 5, "a renewal is not a transition");
    // Failing to renew for the renew deadline stops the leader before anyone may take over.
    assert!(a.is_leader(t(59)));
    assert!(!a.is_leader(t(60)));
    let rel = a.release_record(t(61)).unwrap();
    assert_eq!(rel.holder(), None);
    assert_eq!(rel.lease_duration_seconds, 1);
}

#[test]
fn records_round_trip_through_the_lease_spec() {
    let r = held_by("a", 7, 3);
    assert_eq!(LeaseRecord::from_spec(Some(&r.to_spec())), r);
    assert_eq!(LeaseRecord::from_spec(None), LeaseRecord::default());
}
