//! Lease-based leader election between two real `ic-controller run` processes: one holds the
//! Lease, the other takes it over after the holder is killed (SIGKILL: no release), within the
//! lease duration plus one retry.
//!
//! Below that, the election's kube layer (`LeaseLock`, `attempt`, `release`, the election loop)
//! on the real Lease API with an injected clock: renewals, expiry, takeover, release, a lost
//! race on the resourceVersion.
//!
//! The two replicas run as a ServiceAccount of the test's own namespace that may only read and
//! write Leases there: as leaders of their own Lease they would otherwise reconcile the whole
//! cluster beside the chart's controller (and its audit would credit them with its work).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use ic_controller::leader::{
    self, attempt, release, ElectionConfig, Elector, LeaseLock, LeaseRecord,
};
use ic_controller::reconcile::clock::{Clock, FakeClock};
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use serde_json::json;

use crate::support::{wait_for, Cluster};

const LEASE: &str = "leader-test";
const LEASE_SECONDS: u64 = 4;

struct Replica {
    identity: String,
    child: Child,
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A kubeconfig of ServiceAccount `lease-only` in `ns`, allowed Leases in `ns` and nothing else.
async fn lease_only_kubeconfig(c: &Cluster, ns: &str) -> tempfile::NamedTempFile {
    let sa: ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": "lease-only"}})).unwrap();
    let sas = Api::<ServiceAccount>::namespaced(c.admin.clone(), ns);
    sas.create(&PostParams::default(), &sa).await.unwrap();
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "lease-only"},
        "rules": [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                   "verbs": ["get", "create", "update"]}]
    }))
    .unwrap();
    Api::<Role>::namespaced(c.admin.clone(), ns)
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "lease-only"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "lease-only"},
        "subjects": [{"kind": "ServiceAccount", "name": "lease-only", "namespace": ns}]
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(c.admin.clone(), ns)
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let req: TokenRequest =
        serde_json::from_value(json!({"spec": {"expirationSeconds": 3600}})).unwrap();
    let token = sas
        .create_token_request("lease-only", &PostParams::default(), &req)
        .await
        .unwrap()
        .status
        .unwrap()
        .token;
    let ca = std::fs::read(&c.env["IC_CLUSTER_CA"]).unwrap();
    let kubeconfig = json!({
        "apiVersion": "v1", "kind": "Config", "current-context": "local",
        "clusters": [{"name": "local", "cluster": {
            "server": c.env["IC_CLUSTER_API"],
            "certificate-authority-data": base64::engine::general_purpose::STANDARD.encode(ca)}}],
        "users": [{"name": "lease-only", "user": {"token": token}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": "lease-only"}}]
    });
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), kubeconfig.to_string()).unwrap();
    file
}

fn replica(kubeconfig: &Path, ns: &str, identity: &str) -> Replica {
    let child = Command::new(env!("CARGO_BIN_EXE_ic-controller"))
        .args([
            "run",
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
            "--grpc-addr=127.0.0.1:0",
            "--http-addr=127.0.0.1:0",
            "--webhooks=false",
            "--model-cache-enabled=false",
            "--functional-probe=false",
            "--data-plane-auth=false",
            "--agent-service-account=inference-cache:inference-cache-agent",
            &format!("--leader-election-namespace={ns}"),
            &format!("--leader-election-lease-name={LEASE}"),
            &format!("--leader-election-identity={identity}"),
            &format!("--leader-election-lease-seconds={LEASE_SECONDS}"),
            "--leader-election-renew-deadline-seconds=3",
            "--leader-election-retry-seconds=1",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    Replica {
        identity: identity.to_string(),
        child,
    }
}

async fn holder(leases: &Api<Lease>) -> Option<(String, i32)> {
    let l = leases.get_opt(LEASE).await.ok()??;
    let spec = l.spec?;
    Some((spec.holder_identity?, spec.lease_transitions.unwrap_or(0)))
}

#[tokio::test]
async fn the_other_replica_takes_over_a_killed_holder() {
    let c = Cluster::get().await;
    let ns = c.namespace("leader").await;
    let leases = Api::<Lease>::namespaced(c.admin.clone(), &ns);
    let kubeconfig = lease_only_kubeconfig(&c, &ns).await;
    let mut replicas = vec![
        replica(kubeconfig.path(), &ns, "replica-a"),
        replica(kubeconfig.path(), &ns, "replica-b"),
    ];
    let (first, transitions) = wait_for("a Lease holder", Duration::from_secs(60), || async {
        holder(&leases).await.filter(|(h, _)| !h.is_empty())
    })
    .await;
    let i = replicas
        .iter()
        .position(|r| r.identity == first)
        .unwrap_or_else(|| panic!("holder {first} is neither replica"));
    // The holder keeps renewing: still the holder two lease periods later.
    tokio::time::sleep(Duration::from_secs(2 * LEASE_SECONDS)).await;
    assert_eq!(holder(&leases).await.unwrap().0, first);

    let killed = replicas.remove(i);
    let t0 = Instant::now();
    drop(killed);
    let survivor = replicas[0].identity.clone();
    let (second, after) = wait_for(
        "the other replica to take over",
        Duration::from_secs(30),
        || async { holder(&leases).await.filter(|(h, _)| *h == survivor) },
    )
    .await;
    let took = t0.elapsed();
    assert_eq!(second, survivor);
    assert!(
        after > transitions,
        "leaseTransitions {transitions} -> {after}"
    );
    // Within the dead holder's lease plus a few retries.
    assert!(
        took <= Duration::from_secs(LEASE_SECONDS + 6),
        "takeover took {took:?}"
    );
    drop(replicas);
    c.drop_namespace(&ns).await;
}

#[tokio::test]
async fn two_replicas_elect_one_leader_through_the_api() {
    let c = Cluster::get().await;
    let ns = c.namespace("lease-api").await;
    let client = c.admin.clone();
    let lock = LeaseLock::new(client.clone(), &ns, "inference-cache-controller");
    let clock = FakeClock::at_unix_seconds(1_000);
    let mut a = Elector::new(ElectionConfig::new("a"));
    let mut b = Elector::new(ElectionConfig::new("b"));

    assert!(
        attempt(&mut a, &lock, &clock).await.unwrap(),
        "a creates the Lease"
    );
    assert!(!attempt(&mut b, &lock, &clock).await.unwrap(), "b follows");
    let lease = Api::<Lease>::namespaced(client.clone(), &ns)
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
    let spec = Api::<Lease>::namespaced(client.clone(), &ns)
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
    let spec = Api::<Lease>::namespaced(client, &ns)
        .get("inference-cache-controller")
        .await
        .unwrap()
        .spec
        .unwrap();
    assert_eq!(spec.holder_identity.as_deref(), Some("a"));
    assert_eq!(spec.lease_transitions, Some(2));
    c.drop_namespace(&ns).await;
}

#[tokio::test]
async fn a_write_with_a_stale_resource_version_loses_the_round() {
    let c = Cluster::get().await;
    let ns = c.namespace("lease-race").await;
    let lock = LeaseLock::new(c.admin.clone(), &ns, "l");
    let held_by = |holder: &str, renew: i64, transitions: i32| LeaseRecord {
        holder: Some(holder.into()),
        lease_duration_seconds: 15,
        acquire_time: Some(Timestamp::from_second(0).unwrap()),
        renew_time: Some(Timestamp::from_second(renew).unwrap()),
        transitions,
    };
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
    c.drop_namespace(&ns).await;
}

#[tokio::test]
async fn the_election_loop_publishes_leadership_and_releases_on_shutdown() {
    let cluster = Cluster::get().await;
    let ns = cluster.namespace("lease-loop").await;
    let lock = LeaseLock::new(cluster.admin.clone(), &ns, "loop");
    let mut c = ElectionConfig::new("solo");
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
    cluster.drop_namespace(&ns).await;
}
