//! The CEL rules (`x-kubernetes-validations`) of the generated ModelCache and ModelCacheBinding
//! CRDs, evaluated on old/new pairs with kube-cel's validator as the API server evaluates them
//! (transition rules only when an old object exists; schema defaults applied first). Every
//! forbidden transition is rejected and every allowed one admitted (spec 004 "Cache binding":
//! `spec` is immutable, `Retiring` never returns to `Active`, a recorded identity never changes).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use ic_controller::crdgen;
use kube_cel::Validator;
use serde_json::{json, Value};

fn schema(kind: &str) -> Value {
    let crd = crdgen::all_crds()
        .into_iter()
        .find(|c| c.spec.names.kind == kind)
        .unwrap();
    serde_json::to_value(
        crd.spec.versions[0]
            .schema
            .as_ref()
            .unwrap()
            .open_api_v3_schema
            .as_ref()
            .unwrap(),
    )
    .unwrap()
}

/// `Ok(())` or the failing messages.
fn eval(kind: &str, new: &Value, old: Option<&Value>) -> Result<(), Vec<String>> {
    Validator::new()
        .validate(&schema(kind), new, old)
        .map_err(|errs| errs.into_vec().into_iter().map(|e| e.message).collect())
}

fn hex64(c: char) -> String {
    std::iter::repeat_n(c, 64).collect()
}

fn binding() -> Value {
    json!({
        "apiVersion": "inferencecache.io/v1alpha1",
        "kind": "ModelCacheBinding",
        "metadata": {"name": "mcb-0123456789abcdef-1", "namespace": "inference-cache-model-cache",
                     "finalizers": ["inferencecache.io/model-cache-binding"]},
        "spec": {
            "identity": {"workflow": "helmModelCache", "sharingDomainDigest": hex64('a'), "cacheHandleDigest": hex64('b')},
            "decision": {"provider": "nvmesh", "provisioner": "nvmesh-csi.excelero.com", "flow": "roxReadOnly",
                         "accessModes": ["ReadWriteOnce", "ReadOnlyMany"], "readerMountOptions": ["ro", "nouuid"],
                         "encrypted": false, "catalogProfileDigest": hex64('c')},
            "storageClass": {"name": "inference-cache-model-cache", "uid": "sc-uid", "reclaimPolicy": "Retain",
                             "configurationDigest": hex64('d')},
            "resources": {"persistentVolumeClaims": [{"namespace": "ctl", "name": "w"}], "jobs": [{"namespace": "ctl", "name": "w"}]}
        }
    })
}

fn with(mut v: Value, pointer: &str, value: Value) -> Value {
    let (parent, key) = pointer.rsplit_once('/').unwrap();
    let target = if parent.is_empty() {
        &mut v
    } else {
        v.pointer_mut(parent).unwrap()
    };
    if value.is_null() {
        target.as_object_mut().unwrap().remove(key);
    } else {
        target[key] = value;
    }
    v
}

fn with_phase(phase: Option<&str>) -> Value {
    let mut b = binding();
    b["status"] = match phase {
        Some(p) => {
            json!({"phase": p, "requestReferences": [{"namespace": "a", "name": "m", "uid": "u1"}]})
        }
        None => json!({"requestReferences": []}),
    };
    b
}

fn rejects(kind: &str, new: &Value, old: Option<&Value>, message: &str) {
    match eval(kind, new, old) {
        Ok(()) => panic!("{kind}: expected rejection with {message:?}, got admitted\nnew: {new}"),
        Err(msgs) => assert!(
            msgs.iter().any(|m| m.contains(message)),
            "{kind}: expected {message:?} among {msgs:?}"
        ),
    }
}

fn admits(kind: &str, new: &Value, old: Option<&Value>) {
    if let Err(msgs) = eval(kind, new, old) {
        panic!("{kind}: expected admission, got {msgs:?}\nnew: {new}");
    }
}

const MCB: &str = "ModelCacheBinding";
const MC: &str = "ModelCache";

#[test]
fn binding_create_is_admitted_in_every_phase() {
    admits(MCB, &binding(), None);
    admits(MCB, &with_phase(Some("Active")), None);
    admits(MCB, &with_phase(Some("Retiring")), None);
}

#[test]
fn binding_spec_is_immutable() {
    let old = binding();
    for (pointer, value) in [
        ("/spec/decision/flow", json!("rwxReadOnly")),
        ("/spec/decision/readerMountOptions", json!(["ro"])),
        ("/spec/storageClass/uid", json!("other")),
        ("/spec/resources/persistentVolumes", json!(["pv-x"])),
        ("/spec/decision/encrypted", json!(true)),
    ] {
        rejects(
            MCB,
            &with(old.clone(), pointer, value),
            Some(&old),
            "spec is immutable",
        );
    }
    // Metadata (labels, finalizers) and status are not spec.
    let relabelled = with(old.clone(), "/metadata/labels", json!({"x": "y"}));
    admits(MCB, &relabelled, Some(&old));
    let no_finalizer = with(old.clone(), "/metadata/finalizers", json!([]));
    admits(MCB, &no_finalizer, Some(&old));
    admits(MCB, &old, Some(&old));
}

#[test]
fn a_recorded_identity_never_changes() {
    let old = binding();
    for (pointer, value) in [
        ("/spec/identity/workflow", json!("regularModelCache")),
        ("/spec/identity/sharingDomainDigest", json!(hex64('e'))),
        ("/spec/identity/cacheHandleDigest", json!(hex64('f'))),
    ] {
        let new = with(old.clone(), pointer, value);
        rejects(MCB, &new, Some(&old), "a recorded identity never changes");
        rejects(MCB, &new, Some(&old), "spec is immutable");
    }
}

#[test]
fn retiring_never_returns_to_active() {
    let retiring = with_phase(Some("Retiring"));
    rejects(
        MCB,
        &with_phase(Some("Active")),
        Some(&retiring),
        "Retiring never returns to Active",
    );
    // A missing phase reads as Active, and so does a missing status.
    rejects(
        MCB,
        &with_phase(None),
        Some(&retiring),
        "Retiring never returns to Active",
    );
    rejects(
        MCB,
        &binding(),
        Some(&retiring),
        "Retiring never returns to Active",
    );
    // Allowed transitions.
    admits(MCB, &retiring, Some(&retiring));
    admits(MCB, &retiring, Some(&with_phase(Some("Active"))));
    admits(MCB, &retiring, Some(&binding()));
    admits(MCB, &with_phase(Some("Active")), Some(&binding()));
    admits(
        MCB,
        &with_phase(Some("Active")),
        Some(&with_phase(Some("Active"))),
    );
    admits(MCB, &with_phase(None), Some(&with_phase(Some("Active"))));
    // References may change while Retiring (pruning), the phase may not.
    let mut pruned = retiring.clone();
    pruned["status"]["requestReferences"] = json!([]);
    admits(MCB, &pruned, Some(&retiring));
}

fn request(spec_extra: Value) -> Value {
    let mut spec = json!({
        "source": {"uri": "hf://meta-llama/Llama-3.1-8B", "revision": "abc"},
        "size": "40Gi",
        "workflow": "regularModelCache",
        "writer": {"template": {"spec": {"containers": [{"name": "fetch", "image": "x"}]}}}
    });
    for (k, v) in spec_extra.as_object().unwrap() {
        spec[k] = v.clone();
    }
    json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "ModelCache",
        "metadata": {"name": "llama", "namespace": "team-a"},
        "spec": spec
    })
}

fn with_status(mut v: Value, status: Value) -> Value {
    v["status"] = status;
    v
}

#[test]
fn request_workflow_shape() {
    admits(MC, &request(json!({})), None);
    admits(
        MC,
        &request(
            json!({"workflow": "helmModelCache", "readerNamespaces": ["b"], "sharingDomain": "org"}),
        ),
        None,
    );
    let msg = "helmModelCache needs readerNamespaces";
    rejects(
        MC,
        &request(json!({"workflow": "helmModelCache"})),
        None,
        msg,
    );
    rejects(
        MC,
        &request(json!({"workflow": "helmModelCache", "readerNamespaces": []})),
        None,
        msg,
    );
    rejects(MC, &request(json!({"readerNamespaces": ["b"]})), None, msg);
    rejects(MC, &request(json!({"sharingDomain": "org"})), None, msg);
}

#[test]
fn request_spec_is_immutable() {
    let old = request(json!({}));
    for (pointer, value) in [
        ("/spec/source/revision", json!("def")),
        ("/spec/size", json!("80Gi")),
        ("/spec/writer/template", json!({"spec": {"containers": []}})),
        ("/spec/durability", json!("Ephemeral")),
    ] {
        rejects(
            MC,
            &with(old.clone(), pointer, value),
            Some(&old),
            "spec is immutable",
        );
    }
    admits(MC, &old, Some(&old));
}

#[test]
fn recorded_mode_selection_and_binding_are_final() {
    let base = request(json!({}));
    let sel = json!({"provisioner": "p", "flow": "rwxReadOnly", "storageClassName": "c",
                     "storageClassUid": "u", "decisionDigest": "d"});
    let bound = with_status(
        base.clone(),
        json!({"mode": "durable", "selection": sel, "binding": {"name": "mcb-1", "uid": "u1"},
               "readerClaim": "mcb-1-reader"}),
    );
    // Recording for the first time is allowed, in steps.
    let selected = with_status(base.clone(), json!({"selection": sel}));
    admits(MC, &selected, Some(&base));
    admits(MC, &bound, Some(&selected));
    admits(MC, &bound, Some(&bound));
    // Conditions and reader namespaces may change.
    let mut more = bound.clone();
    more["status"]["readerNamespaces"] = json!(["team-a"]);
    more["status"]["conditions"] = json!([{"type": "Ready", "status": "True", "reason": "ReadersReady",
        "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]);
    admits(MC, &more, Some(&bound));
    // Never rebound, never unbound.
    let mut rebound = bound.clone();
    rebound["status"]["binding"] = json!({"name": "mcb-2", "uid": "u2"});
    rejects(MC, &rebound, Some(&bound), "never rebound");
    let mut same_name = bound.clone();
    same_name["status"]["binding"]["uid"] = json!("u9");
    rejects(MC, &same_name, Some(&bound), "never rebound");
    let mut unbound = bound.clone();
    unbound["status"].as_object_mut().unwrap().remove("binding");
    rejects(MC, &unbound, Some(&bound), "never rebound");
    rejects(MC, &base, Some(&bound), "never rebound");
    // The mode is final.
    let none = with_status(base.clone(), json!({"mode": "none"}));
    let eph = with_status(base.clone(), json!({"mode": "ephemeral"}));
    rejects(MC, &eph, Some(&none), "status.mode is final");
    rejects(MC, &bound, Some(&eph), "status.mode is final");
    rejects(MC, &base, Some(&none), "status.mode is final");
    admits(MC, &none, Some(&base));
    // The selection is final.
    let mut drifted = bound.clone();
    drifted["status"]["selection"]["flow"] = json!("roxReadOnly");
    rejects(MC, &drifted, Some(&bound), "status.selection is final");
}

// ------------------------------------------------------------------ issue 17: data identity

fn with_binding_status(status: Value) -> Value {
    let mut b = binding();
    b["status"] = status;
    b
}

#[test]
fn writer_volume_name_is_set_once() {
    let msg = "status.writerVolumeName is set once";
    let none = with_binding_status(json!({"phase": "Active"}));
    let set = with_binding_status(json!({"phase": "Active", "writerVolumeName": "pvc-1"}));
    // Recording it the first time is allowed; keeping it is allowed.
    admits(MCB, &set, Some(&none));
    admits(MCB, &set, Some(&set));
    // Changed, removed, or the whole status dropped: rejected.
    let other = with_binding_status(json!({"phase": "Active", "writerVolumeName": "pvc-2"}));
    rejects(MCB, &other, Some(&set), msg);
    rejects(MCB, &none, Some(&set), msg);
    rejects(MCB, &binding(), Some(&set), msg);
}

#[test]
fn additional_resources_never_shrink() {
    let never = "is never dropped";
    let pvc = |ns: &str| json!({"namespace": ns, "name": "mcb-1-reader"});
    let old = with_binding_status(json!({"additionalResources": {
        "persistentVolumeClaims": [pvc("b"), pvc("c")],
        "persistentVolumes": ["mcb-1-b", "mcb-1-c"],
        "lease": {"namespace": "ctl", "name": "w"}
    }}));
    // Growing (a new reader namespace) is allowed, in any order.
    let grown = with_binding_status(json!({"additionalResources": {
        "persistentVolumeClaims": [pvc("d"), pvc("b"), pvc("c")],
        "persistentVolumes": ["mcb-1-b", "mcb-1-c", "mcb-1-d"],
        "lease": {"namespace": "ctl", "name": "w"}
    }}));
    admits(MCB, &grown, Some(&old));
    admits(MCB, &old, Some(&old));
    // Dropping one entry of either list, or a whole list, is rejected.
    let mut dropped_pvc = old.clone();
    dropped_pvc["status"]["additionalResources"]["persistentVolumeClaims"] = json!([pvc("c")]);
    rejects(MCB, &dropped_pvc, Some(&old), never);
    let mut dropped_pv = old.clone();
    dropped_pv["status"]["additionalResources"]["persistentVolumes"] = json!(["mcb-1-b"]);
    rejects(MCB, &dropped_pv, Some(&old), never);
    let mut no_list = old.clone();
    no_list["status"]["additionalResources"]
        .as_object_mut()
        .unwrap()
        .remove("persistentVolumes");
    rejects(MCB, &no_list, Some(&old), never);
    // A renamed entry is a dropped one.
    let mut renamed = old.clone();
    renamed["status"]["additionalResources"]["persistentVolumeClaims"][0]["name"] = json!("x");
    rejects(MCB, &renamed, Some(&old), never);
    // The Lease never changes; the whole field and the whole status never go.
    let mut lease = old.clone();
    lease["status"]["additionalResources"]["lease"]["name"] = json!("other");
    rejects(MCB, &lease, Some(&old), "a named lease never changes");
    let gone = "status.additionalResources is never removed";
    rejects(MCB, &with_binding_status(json!({})), Some(&old), gone);
    rejects(MCB, &binding(), Some(&old), gone);
}

/// Every `x-kubernetes-validations` rule of a schema, with the schema node it sits on.
fn rules_of(node: &Value, path: &str, out: &mut Vec<(String, String, Value)>) {
    if let Some(rules) = node
        .get("x-kubernetes-validations")
        .and_then(Value::as_array)
    {
        for r in rules {
            out.push((
                path.to_string(),
                r["rule"].as_str().unwrap().to_string(),
                node.clone(),
            ));
        }
    }
    if let Some(props) = node.get("properties").and_then(Value::as_object) {
        for (k, v) in props {
            rules_of(v, &format!("{path}.{k}"), out);
        }
    }
    if let Some(items) = node.get("items") {
        rules_of(items, &format!("{path}[]"), out);
    }
}

/// The API server refuses a CRD whose rules it cannot bound (estimated cost over its budget,
/// lists walked without `maxItems`): kube-cel's static analysis of every rule of both CRDs,
/// on the node it sits on, finds nothing to warn about.
#[test]
fn every_rule_compiles_within_the_cost_budget() {
    let mut all = Vec::new();
    for kind in [MCB, MC] {
        rules_of(&schema(kind), kind, &mut all);
    }
    assert!(all.len() >= 15, "rules found: {}", all.len());
    let mut warnings = Vec::new();
    for (path, rule, node) in &all {
        let compiled = kube_cel::compile_schema(node);
        assert!(!compiled.has_errors(), "{path}: {rule} does not compile");
        for w in kube_cel::analyze_rule(rule, &compiled, kube_cel::ScopeContext::CrdValidation) {
            // kube-cel's scope check also lists the variables a macro binds (`all(x, …)`),
            // which are in scope for the API server: only other variables are wrong.
            let bound_by_macro = w.kind == kube_cel::WarningKind::WrongScope
                && ["all", "exists", "exists_one", "map", "filter"]
                    .iter()
                    .any(|m| {
                        w.message
                            .split('\'')
                            .nth(1)
                            .is_some_and(|var| rule.contains(&format!(".{m}({var},")))
                    });
            if !bound_by_macro {
                warnings.push(format!("{path}: {rule}: {} ({:?})", w.message, w.kind));
            }
        }
    }
    assert!(warnings.is_empty(), "{warnings:#?}");
    // The lists the never-shrinks rules walk are bounded, and so are the strings they compare.
    let res =
        &schema(MCB)["properties"]["status"]["properties"]["additionalResources"]["properties"];
    for list in [
        "persistentVolumeClaims",
        "persistentVolumes",
        "jobs",
        "storageClasses",
        "secrets",
    ] {
        assert_eq!(res[list]["maxItems"], json!(256), "{list}");
    }
    assert_eq!(res["persistentVolumes"]["items"]["maxLength"], json!(253));
    assert_eq!(
        res["persistentVolumeClaims"]["items"]["properties"]["name"]["maxLength"],
        json!(253)
    );
    assert_eq!(
        res["persistentVolumeClaims"]["items"]["properties"]["namespace"]["maxLength"],
        json!(63)
    );
}

// ------------------------------------------------------------------ issue 17 item 10

/// `spec` is immutable, the writer template included: the rule compares the whole value (the
/// real apiserver refuses a template edit the same way, 422 "spec is immutable":
/// model_cache_failures.rs `a_writer_template_edit_is_refused`).
#[test]
fn spec_immutability_covers_the_writer_template() {
    let old = request(json!({}));
    let edited = with(
        old.clone(),
        "/spec/writer/template",
        json!({"spec": {"containers": [{"name": "fetch", "image": "evil"}]}}),
    );
    rejects(MC, &edited, Some(&old), "spec is immutable");
    let resized = with(old.clone(), "/spec/size", json!("80Gi"));
    rejects(MC, &resized, Some(&old), "spec is immutable");
}

#[test]
fn the_writer_template_digest_is_final() {
    let base = request(json!({}));
    let d1 = with_status(base.clone(), json!({"writerTemplateDigest": hex64('a')}));
    let d2 = with_status(base.clone(), json!({"writerTemplateDigest": hex64('b')}));
    admits(MC, &d1, Some(&base));
    admits(MC, &d1, Some(&d1));
    let msg = "status.writerTemplateDigest is final";
    rejects(MC, &d2, Some(&d1), msg);
    rejects(MC, &base, Some(&d1), msg);
    rejects(MC, &with_status(base.clone(), json!({})), Some(&d1), msg);
}
