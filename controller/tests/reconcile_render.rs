//! Golden tests of provider rendering (spec 000 "Resources", "Template Overrides", "Mooncake
//! provider configuration"): one golden file per provider input class under
//! `tests/reconcile_golden/`. Regenerate with `UPDATE_GOLDEN=1`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod reconcile_support;

use std::path::PathBuf;

use ic_controller::reconcile::render::{self, Rendered, Workload};
use reconcile_support::*;
use serde_json::{json, Value};

fn golden(name: &str, r: &Rendered) {
    let mut docs: Vec<Value> = Vec::new();
    match &r.workload {
        Workload::Deployment(d) => docs.push(serde_json::to_value(d).unwrap()),
        Workload::StatefulSet(s) => docs.push(serde_json::to_value(s).unwrap()),
    }
    docs.push(serde_json::to_value(&r.service).unwrap());
    if let Some(h) = &r.hpa {
        docs.push(serde_json::to_value(h).unwrap());
    }
    let text = docs
        .iter()
        .map(|d| serde_yaml::to_string(d).unwrap())
        .collect::<Vec<_>>()
        .join("---\n");
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/reconcile_golden")
        .join(format!("{name}.yaml"));
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, &text).unwrap();
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run with UPDATE_GOLDEN=1)", path.display()));
    assert_eq!(
        text, want,
        "golden {name} differs; rerun with UPDATE_GOLDEN=1 and review"
    );
}

fn rendered(spec: Value) -> Rendered {
    render::render(&backend("kv", spec)).unwrap().unwrap()
}

#[test]
fn redis_deployment_golden() {
    // Default resources (4Gi/8Gi) → --maxmemory at 80 % of 8Gi; template overrides merged.
    let r = rendered(json!({
        "runtime": "VLLM",
        "remoteStorage": {"provider": "Redis", "ownership": "Managed"},
        "replicas": 2,
        "template": {
            "nodeSelector": {"pool": "cache"},
            "tolerations": [{"key": "cache", "operator": "Exists", "effect": "NoSchedule"}],
            "priorityClassName": "high",
            "serviceAccountName": "cache-sa",
            "terminationGracePeriodSeconds": 5
        }
    }));
    golden("redis-deployment", &r);
    assert_eq!(r.container_names, vec!["redis".to_string()]);
}

#[test]
fn lmcache_server_statefulset_with_hpa_golden() {
    // StatefulSet kind, pinned default image, explicit resources deep-copied, the 250m CPU
    // fallback for autoscaling (requests.cpu "0" is not positive), HPA bounds.
    let r = rendered(json!({
        "runtime": "VLLM",
        "deploymentKind": "StatefulSet",
        "replicas": 2,
        "autoscaling": {"maxReplicas": 5, "targetCPUUtilizationPercent": 60},
        "remoteStorage": {"provider": "LMCacheServer", "ownership": "Managed",
            "lmCacheServer": {"resources": {"requests": {"cpu": "0", "memory": "16Gi"},
                                              "limits": {"memory": "32Gi"}}}}
    }));
    golden("lmcache-server-statefulset-hpa", &r);
    let Workload::StatefulSet(s) = &r.workload else {
        panic!("expected a StatefulSet")
    };
    // The HPA owns replicas.
    assert_eq!(s.spec.as_ref().unwrap().replicas, None);
    let hpa = r.hpa.as_ref().unwrap().spec.as_ref().unwrap();
    assert_eq!(hpa.min_replicas, Some(2));
    assert_eq!(hpa.max_replicas, 5);
    assert_eq!(hpa.scale_target_ref.kind, "StatefulSet");
}

#[test]
fn mooncake_master_golden() {
    let r = rendered(json!({
        "runtime": "VLLM",
        "remoteStorage": {"provider": "Mooncake", "ownership": "Managed"}
    }));
    golden("mooncake-deployment", &r);
    let Workload::Deployment(d) = &r.workload else {
        panic!("expected a Deployment")
    };
    let spec = d.spec.as_ref().unwrap();
    assert_eq!(
        spec.strategy.as_ref().unwrap().type_.as_deref(),
        Some("Recreate")
    );
    let pod = spec.template.spec.as_ref().unwrap();
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(pod.dns_policy.as_deref(), Some("ClusterFirstWithHostNet"));
    let svc = r.service.spec.as_ref().unwrap();
    assert_eq!(svc.cluster_ip.as_deref(), Some("None"));
    let ports: Vec<i32> = svc.ports.as_ref().unwrap().iter().map(|p| p.port).collect();
    assert_eq!(ports, vec![50051, 8080], "RPC first, then HTTP metadata");
    assert_eq!(
        render::service_endpoint(&r.service).as_deref(),
        Some("kv-mooncake-master.ml.svc:50051")
    );
}

#[test]
fn explicit_resources_are_deep_copied_and_empty_block_suppresses_default() {
    let with = rendered(json!({
        "runtime": "VLLM",
        "remoteStorage": {"provider": "Redis", "ownership": "Managed",
            "redis": {"image": "redis:7.2", "resources": {"limits": {"memory": "10Gi", "cpu": "2"}}}}
    }));
    let Workload::Deployment(d) = &with.workload else {
        panic!()
    };
    let c = &d
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
        .containers[0];
    assert_eq!(c.image.as_deref(), Some("redis:7.2"));
    let res = c.resources.as_ref().unwrap();
    assert!(
        res.requests.is_none(),
        "no default request next to an explicit block"
    );
    assert_eq!(res.limits.as_ref().unwrap()["memory"].0, "10Gi");
    let args = c.args.as_ref().unwrap();
    let i = args.iter().position(|a| a == "--maxmemory").unwrap();
    assert_eq!(
        args[i + 1],
        (10u64 * 1024 * 1024 * 1024 * 8 / 10).to_string()
    );
    assert!(args
        .windows(2)
        .any(|w| w == ["--maxmemory-policy", "allkeys-lru"]));

    let empty = rendered(json!({
        "runtime": "VLLM",
        "remoteStorage": {"provider": "Redis", "ownership": "Managed", "redis": {"resources": {}}}
    }));
    let Workload::Deployment(d) = &empty.workload else {
        panic!()
    };
    let c = &d
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
        .containers[0];
    assert_eq!(c.resources.as_ref().unwrap(), &Default::default());
    assert!(!c.args.as_ref().unwrap().iter().any(|a| a == "--maxmemory"));
}

#[test]
fn autoscaling_keeps_a_positive_cpu_request() {
    let r = rendered(json!({
        "runtime": "VLLM",
        "autoscaling": {"minReplicas": 1, "maxReplicas": 3},
        "remoteStorage": {"provider": "Redis", "ownership": "Managed",
            "redis": {"resources": {"requests": {"cpu": "1"}}}}
    }));
    let Workload::Deployment(d) = &r.workload else {
        panic!()
    };
    let c = &d
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
        .containers[0];
    assert_eq!(
        c.resources.as_ref().unwrap().requests.as_ref().unwrap()["cpu"].0,
        "1"
    );
    let hpa = r.hpa.unwrap();
    let m = &hpa.spec.unwrap().metrics.unwrap()[0];
    assert_eq!(
        m.resource.as_ref().unwrap().target.average_utilization,
        Some(80),
        "default target 80 %"
    );
}

#[test]
fn owner_reference_points_at_the_backend() {
    let r = rendered(json!({
        "runtime": "VLLM",
        "remoteStorage": {"provider": "Redis", "ownership": "Managed"}
    }));
    let refs = r.service.metadata.owner_references.unwrap();
    assert_eq!(refs.len(), 1);
    assert_eq!(refs[0].kind, "CacheBackend");
    assert_eq!(refs[0].api_version, "inferencecache.io/v1alpha1");
    assert_eq!(refs[0].uid, "uid-kv");
    assert_eq!(refs[0].controller, Some(true));
}

#[test]
fn modes_without_a_managed_provider_render_nothing() {
    for spec in [
        json!({"runtime": "VLLM"}),
        json!({"runtime": "VLLM", "integration": {"mode": "EventsOnly"}}),
        json!({"runtime": "VLLM", "remoteStorage": {"provider": "Redis", "ownership": "External", "endpoint": "r:6379"}}),
        json!({"runtime": "SGLang", "type": "SGLangHiCache", "hiCache": {"ratio": "2.0"}}),
    ] {
        assert!(
            render::render(&backend("kv", spec.clone()))
                .unwrap()
                .is_none(),
            "{spec}"
        );
    }
}

#[test]
fn missing_uid_is_an_error() {
    let mut cb = backend(
        "kv",
        json!({"runtime": "VLLM", "remoteStorage": {"provider": "Redis", "ownership": "Managed"}}),
    );
    cb.metadata.uid = None;
    assert!(render::render(&cb).is_err());
}
