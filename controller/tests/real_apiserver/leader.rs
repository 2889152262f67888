//! Lease-based leader election between two real `ic-controller run` processes: one holds the
//! Lease, the other takes it over after the holder is killed (SIGKILL: no release), within the
//! lease duration plus one retry.
//!
//! The two replicas run as a ServiceAccount of the test's own namespace that may only read and
//! write Leases there: as leaders of their own Lease they would otherwise reconcile the whole
//! cluster beside the chart's controller (and its audit would credit them with its work).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
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
