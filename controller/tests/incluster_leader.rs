//! Lease leader election: the pure state machine with an injected time, and the kube layer
//! against the in-memory API (two candidates, renewals, expiry, takeover, release, a lost race).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use ic_controller::leader::{
    self, attempt, release, ElectionConfig, Elector, LeaseLock, LeaseRecord, Step,
};
use ic_controller::reconcile::clock::{Clock, FakeClock};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube_fake_client::ClientBuilder;

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

#[tokio::test]
async fn two_replicas_elect_one_leader_through_the_api() {
    let client = ClientBuilder::new().build().await.unwrap();
    let lock = LeaseLock::new(client.clone(), "ic", "inference-cache-controller");
    let clock = FakeClock::at_unix_seconds(1_000);
    let mut a = Elector::new(cfg("a"));
    let mut b = Elector::new(cfg("b"));

    assert!(
        attempt(&mut a, &lock, &clock).await.unwrap(),
        "a creates the Lease"
    );
    assert!(!attempt(&mut b, &lock, &clock).await.unwrap(), "b follows");
    let lease = Api::<Lease>::namespaced(client.clone(), "ic")
        .get("inference-cache-controller")
        .await
        .unwrap();
    let spec = lease.spec.unwrap();
    assert_eq!(spec.holder_identity.as_deref(), Some("a"));
    assert_eq!(spec.lease_duration_seconds, Some(15));

    // a renews every retry period; b never takes over.
    for _ in 0..10 {
        clock.advance(Duration::from_secs(2));
        assert!(attempt(&mut a, &lock, &clock).await.unwrap());
        assert!(!attempt(&mut b, &lock, &clock).await.unwrap());
    }

    // a stops renewing (hung, partitioned): after the lease duration b takes over.
    clock.advance(Duration::from_secs(14));
    assert!(
        !attempt(&mut b, &lock, &clock).await.unwrap(),
        "not yet expired on b's clock"
    );
    clock.advance(Duration::from_secs(2));
    assert!(
        attempt(&mut b, &lock, &clock).await.unwrap(),
        "b takes over"
    );
    assert!(
        !a.is_leader(clock.now()),
        "a stopped leading at its renew deadline"
    );
    assert!(
        !attempt(&mut a, &lock, &clock).await.unwrap(),
        "a follows b now"
    );
    let spec = Api::<Lease>::namespaced(client.clone(), "ic")
        .get("inference-cache-controller")
        .await
        .unwrap()
        .spec
        .unwrap();
    assert_eq!(spec.holder_identity.as_deref(), Some("b"));
    assert_eq!(spec.lease_transitions, Some(1));

    // b shuts down and releases: a takes over without waiting for expiry.
    release(&mut b, &lock, &clock).await.unwrap();
    clock.advance(Duration::from_secs(1));
    assert!(attempt(&mut a, &lock, &clock).await.unwrap());
    let spec = Api::<Lease>::namespaced(client, "ic")
        .get("inference-cache-controller")
        .await
        .unwrap()
        .spec
        .unwrap();
    assert_eq!(spec.holder_identity.as_deref(), Some("a"));
    assert_eq!(spec.lease_transitions, Some(2));
}

#[tokio::test]
async fn a_write_with_a_stale_resource_version_loses_the_round() {
    let client = ClientBuilder::new().build().await.unwrap();
    let lock = LeaseLock::new(client, "ic", "l");
    assert!(lock.create(&held_by("a", 1, 0)).await.unwrap());
    assert!(
        !lock.create(&held_by("b", 1, 0)).await.unwrap(),
        "409 on create"
    );
    let (_, rv) = lock.read().await.unwrap().unwrap();
    assert!(lock.replace(&held_by("a", 2, 0), rv.clone()).await.unwrap());
    assert!(
        !lock.replace(&held_by("b", 2, 1), rv).await.unwrap(),
        "409 on a stale resourceVersion"
    );
    assert_eq!(lock.read().await.unwrap().unwrap().0.holder(), Some("a"));
}

#[tokio::test]
async fn the_election_loop_publishes_leadership_and_releases_on_shutdown() {
    let client = ClientBuilder::new().build().await.unwrap();
    let lock = LeaseLock::new(client.clone(), "ic", "loop");
    let mut c = cfg("solo");
    c.retry_period = Duration::from_millis(20);
    let clock: Arc<dyn Clock> = Arc::new(ic_controller::reconcile::clock::SystemClock);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let election = leader::spawn(lock.clone(), c, clock, None, stop_rx);
    let mut rx = election.handle.subscribe();
    tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|l| *l))
        .await
        .unwrap()
        .unwrap();
    assert!(election.handle.is_leader());
    stop_tx.send(true).unwrap();
    election.task.await.unwrap();
    assert!(!election.handle.is_leader());
    assert_eq!(
        lock.read().await.unwrap().unwrap().0.holder(),
        None,
        "released"
    );
}
