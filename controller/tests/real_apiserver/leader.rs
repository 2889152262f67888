//! Lease-based leader election between two real `ic-controller run` processes: one holds the
//! Lease, the other takes it over after the holder is killed (SIGKILL: no release), within the
//! lease duration plus one retry.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;

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

fn replica(c: &Cluster, ns: &str, identity: &str) -> Replica {
    let child = Command::new(env!("CARGO_BIN_EXE_ic-controller"))
        .args([
            "run",
            "--kubeconfig",
            &c.env["IC_CLUSTER_KUBECONFIG"],
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
    let mut replicas = vec![replica(&c, &ns, "replica-a"), replica(&c, &ns, "replica-b")];
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
