//! The chart's ValidatingAdmissionPolicies (chart/files/controller-admission-policy.yaml, the
//! one definition the chart embeds) evaluated with the CEL interpreter kube-cel is built on,
//! the way the API server evaluates them for the controller's service account: `request`,
//! `object` (null for DELETE), `oldObject` (null for CREATE) and `variables` in order.
//!
//! Allowed: every object the controller renders for a CacheBackend (created, updated, deleted),
//! the exact merge patch its cascade applies to an engine Deployment, and the model cache's
//! writer claim, writer Jobs and encrypted StorageClass. Denied: forged objects — an engine
//! Deployment or a label-only imitation, a takeover of a foreign object, a cascade that also
//! changes anything else, a StatefulSet "cascade", unlabelled model-cache objects, a writer Job
//! in the control namespace under another service account.
//!
//! What this cannot check: the API server's type checking of the expressions (this interpreter
//! is dynamically typed; the chart test validates the rendered objects against the Kubernetes
//! schemas only), and the match constraints and conditions (which resources and which user the
//! API server sends to the policy: asserted on the rendered chart in
//! chart-tests/test_security.py).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod model_cache_support;
mod reconcile_support;

use std::path::PathBuf;

use cel::{Context, Program, Value as CelValue};
use ic_controller::reconcile::cachebackend::cascade;
use ic_controller::reconcile::model_cache::render as mc_render;
use ic_controller::reconcile::render::{self, Workload};
use ic_shared::crd::{AccessMode, BindingDecision, Flow};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::{json, Value};

const CONTROL_NS: &str = "inference-cache-model-cache";
const WRITER_SA: &str = "model-writer";

struct Policy {
    variables: Vec<(String, Program)>,
    validations: Vec<(Program, String)>,
}

/// The section `section` of the policy file, with the release variables the template adds.
fn policy(section: &str, release: &[(&str, &str)]) -> Policy {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../chart/files/controller-admission-policy.yaml");
    let doc: Value = serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let s = &doc[section];
    let compile = |e: &str| Program::compile(e).unwrap_or_else(|err| panic!("{e}: {err:?}"));
    let mut variables: Vec<(String, Program)> = release
        .iter()
        .map(|(n, e)| (n.to_string(), compile(e)))
        .collect();
    for v in s["variables"].as_array().unwrap() {
        variables.push((
            v["name"].as_str().unwrap().to_string(),
            compile(v["expression"].as_str().unwrap()),
        ));
    }
    let validations = s["validations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            (
                compile(v["expression"].as_str().unwrap()),
                v["message"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    Policy {
        variables,
        validations,
    }
}

fn workloads() -> Policy {
    policy("workloads", &[])
}

fn model_cache() -> Policy {
    policy(
        "modelCache",
        &[
            ("controlNamespace", "'inference-cache-model-cache'"),
            ("writerServiceAccount", "'model-writer'"),
        ],
    )
}

/// `request.resource` of a kind.
fn resource_of(kind: &str) -> (&'static str, &'static str) {
    match kind {
        "Deployment" => ("apps", "deployments"),
        "StatefulSet" => ("apps", "statefulsets"),
        "Service" => ("", "services"),
        "HorizontalPodAutoscaler" => ("autoscaling", "horizontalpodautoscalers"),
        "Job" => ("batch", "jobs"),
        "PersistentVolumeClaim" => ("", "persistentvolumeclaims"),
        "PersistentVolume" => ("", "persistentvolumes"),
        "StorageClass" => ("storage.k8s.io", "storageclasses"),
        "Secret" => ("", "secrets"),
        other => panic!("no resource for {other}"),
    }
}

/// Admits `operation` with `object` / `oldObject` (either may be null): `Ok` or the messages of
/// the failed validations. An expression that errors is a failure (`failurePolicy: Fail`).
fn admit(p: &Policy, operation: &str, object: &Value, old: &Value) -> Result<(), Vec<String>> {
    let any = if object.is_null() { old } else { object };
    let kind = any["kind"].as_str().unwrap();
    let (group, resource) = resource_of(kind);
    let request = json!({
        "operation": operation,
        "kind": {"group": group, "kind": kind},
        "resource": {"group": group, "version": "v1", "resource": resource},
        "namespace": any["metadata"]["namespace"].as_str().unwrap_or(""),
        "name": any["metadata"]["name"],
        "userInfo": {"username": "system:serviceaccount:inference-cache:inference-cache-controller"},
    });
    // The API server's activation: request, object, oldObject and the variables so far.
    let context = |vars: &serde_json::Map<String, Value>| {
        let mut ctx = Context::default();
        ctx.add_variable("request", request.clone()).unwrap();
        ctx.add_variable("object", object.clone()).unwrap();
        ctx.add_variable("oldObject", old.clone()).unwrap();
        ctx.add_variable("variables", Value::Object(vars.clone()))
            .unwrap();
        ctx
    };
    let mut vars = serde_json::Map::new();
    for (name, prog) in &p.variables {
        let v = prog
            .execute(&context(&vars))
            .unwrap_or_else(|e| panic!("variable {name} errors on {operation} {kind}: {e:?}"));
        vars.insert(name.clone(), cel_to_json(&v));
    }
    let mut failed = Vec::new();
    for (prog, message) in &p.validations {
        let ctx = context(&vars);
        match prog.execute(&ctx) {
            Ok(CelValue::Bool(true)) => {}
            Ok(other) => failed.push(format!("{message} ({other:?})")),
            Err(e) => failed.push(format!("{message} (error: {e:?})")),
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(failed)
    }
}

fn cel_to_json(v: &CelValue) -> Value {
    match v {
        CelValue::Bool(b) => json!(b),
        CelValue::String(s) => json!(s.as_str()),
        CelValue::Int(i) => json!(i),
        CelValue::UInt(u) => json!(u),
        CelValue::Null => Value::Null,
        CelValue::Map(m) => Value::Object(
            m.map
                .iter()
                .map(|(k, v)| {
                    let k = match k {
                        cel::objects::Key::String(s) => s.to_string(),
                        other => format!("{other:?}"),
                    };
                    (k, cel_to_json(v))
                })
                .collect(),
        ),
        CelValue::List(l) => Value::Array(l.iter().map(cel_to_json).collect()),
        other => panic!("unexpected variable value {other:?}"),
    }
}

fn allowed(p: &Policy, op: &str, object: &Value, old: &Value) {
    if let Err(e) = admit(p, op, object, old) {
        panic!(
            "{op} {} denied: {e:?}",
            (if object.is_null() { old } else { object })["metadata"]["name"]
        );
    }
}

fn denied(p: &Policy, op: &str, object: &Value, old: &Value) -> Vec<String> {
    match admit(p, op, object, old) {
        Ok(()) => panic!("{op} {object} was admitted"),
        // A verdict, not an expression that failed to evaluate.
        Err(e) if e.iter().any(|m| m.contains("(error:")) => panic!("{op}: {e:?}"),
        Err(e) => e,
    }
}

/// RFC 7386 merge patch (what the API server does with the cascade's `Patch::Merge`).
fn merge(target: &mut Value, patch: &Value) {
    match (target.as_object_mut(), patch.as_object()) {
        (Some(t), Some(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        _ => *target = patch.clone(),
    }
}

/// What the controller renders (and server-side applies) for managed providers: the Redis
/// Deployment, the LMCache server StatefulSet with its HPA, their Services.
fn rendered_objects() -> Vec<Value> {
    let specs = [
        json!({"runtime": "VLLM", "remoteStorage": {"provider": "Redis", "ownership": "Managed"}}),
        json!({"runtime": "VLLM", "remoteStorage": {"provider": "LMCacheServer", "ownership": "Managed"},
               "deploymentKind": "StatefulSet",
               "replicas": 2, "autoscaling": {"maxReplicas": 5, "targetCPUUtilizationPercent": 60}}),
    ];
    let mut out = Vec::new();
    for spec in specs {
        let r = render::render(&reconcile_support::backend("kv", spec))
            .unwrap()
            .unwrap();
        out.push(match &r.workload {
            Workload::Deployment(d) => serde_json::to_value(d).unwrap(),
            Workload::StatefulSet(s) => serde_json::to_value(s).unwrap(),
        });
        out.push(serde_json::to_value(&r.service).unwrap());
        if let Some(h) = &r.hpa {
            out.push(serde_json::to_value(h).unwrap());
        }
    }
    assert!(out.iter().any(|o| o["kind"] == "HorizontalPodAutoscaler"));
    assert!(out.iter().any(|o| o["kind"] == "StatefulSet"));
    // As stored: the API server adds what the policy sees on updates and deletes.
    for o in &mut out {
        o["metadata"]["uid"] = json!("stored-uid");
        o["metadata"]["resourceVersion"] = json!("7");
    }
    out
}

/// An engine Deployment the controller does not own: the vLLM docs' "Deployment with GPUs"
/// (fixture `01-vllm-docs-nvidia-sh-c.yaml` is its pod), as stored with API-server defaults.
fn engine_deployment() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/pods/01-vllm-docs-nvidia-sh-c.yaml");
    let pod: Value = serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "mistral-7b", "namespace": "default", "uid": "engine-uid",
                     "resourceVersion": "41", "generation": 3,
                     "labels": {"app": "mistral-7b"},
                     "annotations": {"deployment.kubernetes.io/revision": "3"}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "mistral-7b"}},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}},
            "revisionHistoryLimit": 10, "progressDeadlineSeconds": 600,
            "template": {"metadata": {"labels": {"app": "mistral-7b"},
                                      "annotations": {"inferencecache.io/backend": "kv"}},
                         "spec": pod["spec"].clone()},
        },
    })
}

#[test]
fn the_objects_the_controller_renders_are_admitted() {
    let p = workloads();
    for o in rendered_objects() {
        allowed(&p, "CREATE", &o, &Value::Null);
        let mut changed = o.clone();
        changed["metadata"]["annotations"] = json!({"example.com/x": "1"});
        allowed(&p, "UPDATE", &changed, &o);
        allowed(&p, "DELETE", &Value::Null, &o);
    }
}

#[test]
fn the_cascade_restart_of_an_engine_deployment_is_admitted_and_nothing_more() {
    let p = workloads();
    let old = engine_deployment();
    let mut new = old.clone();
    merge(&mut new, &cascade::restart_patch("kv-redis-5d9f-abc12"));
    new["metadata"]["generation"] = json!(4);
    allowed(&p, "UPDATE", &new, &old);
    // A second cascade replaces the trigger value.
    let mut again = new.clone();
    merge(&mut again, &cascade::restart_patch("kv-redis-5d9f-xyz89"));
    allowed(&p, "UPDATE", &again, &new);

    let forge = |f: &dyn Fn(&mut Value)| {
        let mut v = new.clone();
        f(&mut v);
        v
    };
    let forged = [
        (
            "a new image",
            forge(&|v| {
                v["spec"]["template"]["spec"]["containers"][0]["image"] = json!("evil/vllm:latest")
            }),
        ),
        (
            "another annotation",
            forge(&|v| v["spec"]["template"]["metadata"]["annotations"]["x"] = json!("1")),
        ),
        (
            "a removed annotation",
            forge(&|v| {
                v["spec"]["template"]["metadata"]["annotations"]
                    .as_object_mut()
                    .unwrap()
                    .remove("inferencecache.io/backend");
            }),
        ),
        (
            "a pod label",
            forge(&|v| v["spec"]["template"]["metadata"]["labels"]["y"] = json!("1")),
        ),
        ("replicas", forge(&|v| v["spec"]["replicas"] = json!(0))),
        (
            "an object label",
            forge(&|v| {
                v["metadata"]["labels"]["app.kubernetes.io/managed-by"] = json!("inference-cache")
            }),
        ),
        (
            "a service account",
            forge(&|v| v["spec"]["template"]["spec"]["serviceAccountName"] = json!("admin")),
        ),
    ];
    for (what, v) in forged {
        let errs = denied(&p, "UPDATE", &v, &old);
        assert!(errs[0].contains("restart-trigger"), "{what}: {errs:?}");
    }
    // Without the trigger it is no cascade.
    let mut no_trigger = old.clone();
    no_trigger["spec"]["template"]["metadata"]["annotations"]["z"] = json!("1");
    denied(&p, "UPDATE", &no_trigger, &old);
    // The exception is for Deployments only.
    let mut sts_old = old.clone();
    sts_old["kind"] = json!("StatefulSet");
    let mut sts_new = new.clone();
    sts_new["kind"] = json!("StatefulSet");
    denied(&p, "UPDATE", &sts_new, &sts_old);
}

#[test]
fn forged_and_foreign_workloads_are_denied() {
    let p = workloads();
    let engine = engine_deployment();
    // Creating or deleting an object it does not own.
    denied(&p, "CREATE", &engine, &Value::Null);
    denied(&p, "DELETE", &Value::Null, &engine);
    let owned = rendered_objects();
    let service = owned.iter().find(|o| o["kind"] == "Service").unwrap();
    // A label without the owner reference, an owner reference to another kind or not the
    // controller, and the reverse.
    let forge = |f: &dyn Fn(&mut Value)| {
        let mut v = service.clone();
        f(&mut v);
        v
    };
    for v in [
        forge(&|v| {
            v["metadata"]
                .as_object_mut()
                .unwrap()
                .remove("ownerReferences");
        }),
        forge(&|v| v["metadata"]["ownerReferences"][0]["kind"] = json!("Deployment")),
        forge(&|v| v["metadata"]["ownerReferences"][0]["apiVersion"] = json!("apps/v1")),
        forge(&|v| v["metadata"]["ownerReferences"][0]["controller"] = json!(false)),
        forge(&|v| {
            v["metadata"]["labels"]
                .as_object_mut()
                .unwrap()
                .remove("app.kubernetes.io/managed-by");
        }),
        forge(&|v| v["metadata"]["labels"]["app.kubernetes.io/managed-by"] = json!("Helm")),
    ] {
        denied(&p, "CREATE", &v, &Value::Null);
        denied(&p, "DELETE", &Value::Null, &v);
    }
    // Taking over a foreign object by adding the label and an owner reference.
    let mut takeover = engine.clone();
    takeover["metadata"]["labels"]["app.kubernetes.io/managed-by"] = json!("inference-cache");
    takeover["metadata"]["ownerReferences"] = service["metadata"]["ownerReferences"].clone();
    denied(&p, "UPDATE", &takeover, &engine);
    // Dropping ownership of its own object is an update of an owned object into a foreign one.
    let mut released = service.clone();
    released["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("ownerReferences");
    denied(&p, "UPDATE", &released, service);
}

fn decision() -> BindingDecision {
    BindingDecision {
        provider: "nvmesh".into(),
        provisioner: model_cache_support::NVMESH.into(),
        flow: Flow::RoxReadOnly,
        access_modes: vec![AccessMode::ReadWriteOnce, AccessMode::ReadOnlyMany],
        reader_mount_options: vec!["ro".into()],
        volume_handle_namespace: None,
        encrypted: false,
        catalog_profile_digest: "d".into(),
    }
}

#[test]
fn the_model_cache_writes_only_labelled_objects_and_its_writer_runs_as_the_writer_account() {
    let p = model_cache();
    let owner = mc_render::Owner {
        name: "mcb-0123456789abcdef-1",
        uid: "uid-b",
    };
    // What the model cache renders: the writer claim and Job in the control namespace (helm
    // workflow, writer service account), a Job in the request namespace (regular workflow), the
    // encrypted StorageClass.
    let claim = serde_json::to_value(mc_render::writer_claim(
        "w",
        CONTROL_NS,
        owner,
        &decision(),
        Quantity("40Gi".into()),
        "inference-cache-model-cache",
    ))
    .unwrap();
    let helm = model_cache_support::helm("m", "team-a", &["team-b"]);
    let job = serde_json::to_value(
        mc_render::writer_job("w", CONTROL_NS, owner, &helm, "w", Some(WRITER_SA)).unwrap(),
    )
    .unwrap();
    let regular = model_cache_support::regular("m", "team-a", "r1");
    let team_job = serde_json::to_value(
        mc_render::writer_job("w", "team-a", owner, &regular, "w", None).unwrap(),
    )
    .unwrap();
    let class = serde_json::to_value(mc_render::encrypted_class(
        &model_cache_support::storage_class(model_cache_support::NVMESH, Some("Retain")),
        "enc",
        owner,
        "k",
        CONTROL_NS,
    ))
    .unwrap();
    let key = serde_json::to_value(mc_render::key_secret("k", CONTROL_NS, owner, "00")).unwrap();
    for o in [&claim, &job, &team_job, &class, &key] {
        let mut o = o.clone();
        o["apiVersion"] = json!(match o["kind"].as_str().unwrap() {
            "Job" => "batch/v1",
            "StorageClass" => "storage.k8s.io/v1",
            _ => "v1",
        });
        allowed(&p, "CREATE", &o, &Value::Null);
        allowed(&p, "DELETE", &Value::Null, &o);
        allowed(&p, "UPDATE", &o, &o);
    }

    // Forged: unlabelled objects, a takeover, a writer Job under another account.
    let unlabel = |o: &Value| {
        let mut v = o.clone();
        v["metadata"].as_object_mut().unwrap().remove("labels");
        v
    };
    for o in [&claim, &job, &class, &key] {
        let errs = denied(&p, "CREATE", &unlabel(o), &Value::Null);
        assert!(errs[0].contains("it labels"), "{errs:?}");
        denied(&p, "DELETE", &Value::Null, &unlabel(o));
        denied(&p, "UPDATE", o, &unlabel(o));
    }
    let mut admin_job = job.clone();
    admin_job["spec"]["template"]["spec"]["serviceAccountName"] = json!("cluster-admin-sa");
    let errs = denied(&p, "CREATE", &admin_job, &Value::Null);
    assert!(
        errs.iter().any(|e| e.contains("writer service account")),
        "{errs:?}"
    );
    let mut no_sa = job.clone();
    no_sa["spec"]["template"]["spec"]
        .as_object_mut()
        .unwrap()
        .remove("serviceAccountName");
    denied(&p, "CREATE", &no_sa, &Value::Null);
    // A Secret outside the control namespace is not the model cache's to judge (the self-signed
    // webhook bundle in the release namespace): allowed here, limited by RBAC.
    let mut webhook_bundle = unlabel(&key);
    webhook_bundle["metadata"]["namespace"] = json!("inference-cache");
    allowed(&p, "CREATE", &webhook_bundle, &Value::Null);
    let mut deprecated = job.clone();
    deprecated["spec"]["template"]["spec"]["serviceAccount"] = json!("cluster-admin-sa");
    denied(&p, "CREATE", &deprecated, &Value::Null);
}
