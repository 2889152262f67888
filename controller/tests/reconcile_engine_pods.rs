//! The engine-pod Events controller against the bare real apiserver (`bare_apiserver_support`,
//! through `reconcile_support::Harness`: a namespace per test; spec 000 "Mutating Pod webhook"
//! Events row, "Contract Notes"): InjectedByCacheBackend only when the UID annotation matches
//! the live CR; SkippedByOperator only with both skip annotations. Pods and CacheBackends are
//! created through the API (server-assigned uids); the pod reconciler is called with the stored
//! pod, as its watch would deliver it. Events go to a recording sink, or to the API's
//! `events.k8s.io/v1` where what is stored is the point.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod reconcile_support;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use ic_controller::reconcile::cachebackend::events::{KubeEventSink, RecordingEventSink};
use ic_controller::reconcile::engine_pods::{
    decide, reconcile_engine_pod, truthy, PodDecision, PodEventsContext,
};
use ic_shared::crd::CacheBackend;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use reconcile_support::bare::{Faults, Step};
use reconcile_support::*;

const BY: &str = "inferencecache.io/injected-by";
const BY_UID: &str = "inferencecache.io/injected-by-uid";
const SKIP: &str = "inferencecache.io/skip-inject";
const SKIPPED: &str = "inferencecache.io/inject-skipped";

/// A namespace holding `cbs` (the harness), and a leading pod-events context over it recording
/// into a [`RecordingEventSink`].
async fn ctx_with(
    cbs: Vec<CacheBackend>,
) -> (Harness, Arc<PodEventsContext>, Arc<RecordingEventSink>) {
    let h = Harness::new(cbs, false).await;
    let events = Arc::new(RecordingEventSink::new());
    let ctx = Arc::new(PodEventsContext::new(
        h.client.clone(),
        events.clone(),
        Arc::new(AtomicBool::new(true)),
    ));
    (h, ctx, events)
}

async fn run(ctx: &Arc<PodEventsContext>, p: Pod) {
    reconcile_engine_pod(Arc::new(p), ctx.clone())
        .await
        .unwrap();
}

#[tokio::test]
async fn injected_by_cache_backend_when_the_uid_matches() {
    let (h, ctx, events) = ctx_with(vec![managed_redis("kv")]).await;
    let cb = h.cb("kv").await;
    let p = h.add_pod(injected_engine("engine-0", &cb, "vllm")).await;
    run(&ctx, p.clone()).await;
    run(&ctx, p.clone()).await;
    let ev = events.events();
    assert_eq!(ev.len(), 1, "recorded once per pod");
    assert_eq!(ev[0].event.reason, "InjectedByCacheBackend");
    assert_eq!(ev[0].object_kind, "Pod");
    assert_eq!(ev[0].object, h.key("engine-0"));
    assert_eq!(Some(&ev[0].object_uid), p.metadata.uid.as_ref());
}

#[tokio::test]
async fn no_injection_event_on_forgery_shapes_or_missing_cr() {
    let (h, ctx, events) = ctx_with(vec![managed_redis("kv")]).await;
    let kv = h.key("kv");
    // UID mismatch (forged or CR recreated).
    let p = h
        .add_pod(pod("a", &[], &[(BY, &kv), (BY_UID, "someone-else")]))
        .await;
    run(&ctx, p).await;
    // UID annotation absent.
    run(&ctx, h.add_pod(pod("b", &[], &[(BY, &kv)])).await).await;
    // Named CR missing.
    let gone = h.key("gone");
    let p = h
        .add_pod(pod("c", &[], &[(BY, &gone), (BY_UID, "uid-gone")]))
        .await;
    run(&ctx, p).await;
    // Malformed.
    let p = h
        .add_pod(pod("d", &[], &[(BY, "kv"), (BY_UID, "uid-kv")]))
        .await;
    run(&ctx, p).await;
    assert!(events.events().is_empty());
}

#[tokio::test]
async fn lookup_errors_are_reconcile_errors() {
    let faults = Faults::new();
    faults.rule(|c| {
        if c.method == "GET" && c.has("cachebackends") {
            Step::internal("apiserver unavailable")
        } else {
            Step::Pass
        }
    });
    let h = Harness::with_faults(vec![managed_redis("kv")], false, faults.clone()).await;
    let events = Arc::new(RecordingEventSink::new());
    let ctx = Arc::new(PodEventsContext::new(
        h.client.clone(),
        events.clone(),
        Arc::new(AtomicBool::new(true)),
    ));
    let cb = h.cb("kv").await;
    let p = h.add_pod(injected_engine("a", &cb, "vllm")).await;
    assert!(reconcile_engine_pod(Arc::new(p), ctx).await.is_err());
    assert!(events.events().is_empty());
    let calls = faults.calls();
    assert!(
        calls.len() == 1 && calls[0].is("GET", "/cachebackends/kv"),
        "{calls:?}"
    );
}

#[tokio::test]
async fn skipped_by_operator_needs_both_annotations() {
    let (h, ctx, events) = ctx_with(vec![]).await;
    for p in [
        pod(
            "a",
            &[],
            &[(SKIP, "true"), (SKIPPED, "skip-inject-annotation")],
        ),
        pod("b", &[], &[(SKIP, "true")]),
        pod("c", &[], &[(SKIPPED, "skip-inject-annotation")]),
        pod(
            "d",
            &[],
            &[(SKIP, "false"), (SKIPPED, "skip-inject-annotation")],
        ),
    ] {
        run(&ctx, h.add_pod(p).await).await;
    }
    let ev = events.events();
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].event.reason, "SkippedByOperator");
    assert_eq!(ev[0].object, h.key("a"));
}

/// A pod the webhook admitted unwired although a CacheBackend selects it carries the reason in
/// `not-injected` (the webhook's own constant); it gets a Warning NotInjected Event with it,
/// once, so `kubectl describe pod` and `kubectl get events` show why it runs without the cache.
#[tokio::test]
async fn a_selected_pod_admitted_unwired_gets_a_warning_with_the_reason() {
    use ic_controller::admission::pod::ANNOTATION_NOT_INJECTED;
    use ic_controller::reconcile::cachebackend::events::EventKind;
    let (h, ctx, events) = ctx_with(vec![]).await;
    let why = format!(
        "CacheBackend {}: Managed LMCacheServer backend has not published status.endpoint yet \
         (roll the engine workload once the backend is Ready)",
        h.key("kv")
    );
    let why = why.as_str();
    let p = h
        .add_pod(pod("a", &[], &[(ANNOTATION_NOT_INJECTED, why)]))
        .await;
    assert_eq!(decide(&p), PodDecision::NotInjected(why.to_string()));
    run(&ctx, p.clone()).await;
    run(&ctx, p).await;
    let ev = events.events();
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(
        (ev[0].event.kind, ev[0].event.reason.as_str()),
        (EventKind::Warning, "NotInjected")
    );
    assert!(ev[0].event.note.contains(why), "{}", ev[0].event.note);
    assert_eq!(ev[0].object, h.key("a"));
}

/// The Events the API server holds in the harness's namespace, as (regarding name, reason).
async fn stored_events(h: &Harness) -> Vec<(String, String)> {
    let api = h.api::<Event>();
    let mut out: Vec<(String, String)> = api
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|e| {
            (
                e.regarding.and_then(|r| r.name).unwrap_or_default(),
                e.reason.unwrap_or_default(),
            )
        })
        .collect();
    out.sort();
    out
}

/// InjectedByCacheBackend and SkippedByOperator are recorded once per pod, ever: a restarted
/// controller (fresh process memory) and a new leader re-list every pod, and the API server
/// still holds one Event each (spec 000 "Contract Notes"; issue: de-duplication across
/// restarts). A recreated pod of the same name is a different object and gets its own.
#[tokio::test]
async fn engine_pod_events_are_not_recreated_by_a_restarted_controller() {
    let h = Harness::new(vec![managed_redis("kv")], false).await;
    let client = h.client.clone();
    let cb = h.cb("kv").await;
    let injected = h.add_pod(injected_engine("engine-0", &cb, "vllm")).await;
    let skipped = h
        .add_pod(pod(
            "opted-out",
            &[],
            &[(SKIP, "yes"), (SKIPPED, "skip-inject-annotation")],
        ))
        .await;
    for _process in 0..3 {
        let sink = Arc::new(KubeEventSink::new(
            client.clone(),
            "inference-cache-controller",
            Some("controller-0".into()),
        ));
        let ctx = Arc::new(PodEventsContext::new(
            client.clone(),
            sink,
            Arc::new(AtomicBool::new(true)),
        ));
        run(&ctx, injected.clone()).await;
        run(&ctx, skipped.clone()).await;
        run(&ctx, injected.clone()).await;
    }
    assert_eq!(
        stored_events(&h).await,
        vec![
            ("engine-0".to_string(), "InjectedByCacheBackend".to_string()),
            ("opted-out".to_string(), "SkippedByOperator".to_string()),
        ]
    );
    // Straight at the sink: the second create of the same Event reads AlreadyRecorded (the API
    // server's 409), not a second object.
    use ic_controller::reconcile::cachebackend::events::{EventSink, EventSpec, Recorded};
    let sink = KubeEventSink::new(client.clone(), "inference-cache-controller", None);
    let oref = {
        use kube::Resource;
        injected.object_ref(&())
    };
    let ev = EventSpec::normal("InjectedByCacheBackend", "again");
    assert_eq!(
        sink.publish_once(&oref, &ev).await.unwrap(),
        Recorded::AlreadyRecorded
    );
    // The same name, a new UID: a new pod, a new Event.
    h.delete_pod("engine-0").await;
    let recreated = h.add_pod(injected_engine("engine-0", &cb, "vllm")).await;
    assert_ne!(recreated.metadata.uid, injected.metadata.uid);
    let sink = Arc::new(KubeEventSink::new(
        client.clone(),
        "inference-cache-controller",
        None,
    ));
    let ctx = Arc::new(PodEventsContext::new(
        client.clone(),
        sink,
        Arc::new(AtomicBool::new(true)),
    ));
    run(&ctx, recreated).await;
    assert_eq!(
        stored_events(&h)
            .await
            .iter()
            .filter(|(_, r)| r == "InjectedByCacheBackend")
            .count(),
        2
    );
}

#[tokio::test]
async fn followers_record_nothing() {
    let h = Harness::new(vec![managed_redis("kv")], false).await;
    let cb = h.cb("kv").await;
    let events = Arc::new(RecordingEventSink::new());
    let ctx = Arc::new(PodEventsContext::new(
        h.client.clone(),
        events.clone(),
        Arc::new(AtomicBool::new(false)),
    ));
    run(
        &ctx,
        h.add_pod(injected_engine("engine-0", &cb, "vllm")).await,
    )
    .await;
    assert!(events.events().is_empty());
}

/// A pod the follower saw (admitted while the old leader was failing) is looked at again, so
/// the replica that gains the Lease records its Event; a pod that calls for none is not
/// requeued.
#[tokio::test]
async fn a_new_leader_records_what_it_saw_as_a_follower() {
    use ic_controller::reconcile::engine_pods::FOLLOWER_RECHECK;
    use kube::runtime::controller::Action;
    let h = Harness::new(vec![managed_redis("kv")], false).await;
    let cb = h.cb("kv").await;
    let events = Arc::new(RecordingEventSink::new());
    let leader = Arc::new(AtomicBool::new(false));
    let ctx = Arc::new(PodEventsContext::new(
        h.client.clone(),
        events.clone(),
        leader.clone(),
    ));
    let engine = Arc::new(h.add_pod(injected_engine("engine-0", &cb, "vllm")).await);
    let a = reconcile_engine_pod(engine.clone(), ctx.clone())
        .await
        .unwrap();
    assert_eq!(a, Action::requeue(FOLLOWER_RECHECK));
    let plain = Arc::new(h.add_pod(pod("web-0", &[("app", "web")], &[])).await);
    assert_eq!(
        reconcile_engine_pod(plain, ctx.clone()).await.unwrap(),
        Action::await_change()
    );
    assert!(events.events().is_empty());
    leader.store(true, std::sync::atomic::Ordering::SeqCst);
    let a = reconcile_engine_pod(engine, ctx.clone()).await.unwrap();
    assert_eq!(a, Action::await_change());
    let ev = events.events();
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].event.reason, "InjectedByCacheBackend");
}

#[test]
fn every_opt_out_the_webhook_honours_gets_skipped_by_operator() {
    use ic_controller::admission::pod::{mutate_pod, PodWebhookConfig};
    let cb = managed_redis("kv");
    for v in ["yes", "on", "tRuE", " 1 ", "Y", "t"] {
        let p = pod(
            "engine-0",
            &[("app", "vllm")],
            &[("inferencecache.io/skip-inject", v)],
        );
        let mut doc = serde_json::to_value(&p).unwrap();
        let out = mutate_pod(
            &doc,
            NS,
            std::slice::from_ref(&cb),
            &PodWebhookConfig::default(),
        );
        let ops = out.patch.clone().unwrap_or_default();
        let patch: json_patch::Patch =
            serde_json::from_value(serde_json::Value::Array(ops)).unwrap();
        json_patch::patch(&mut doc, &patch).unwrap();
        let admitted: k8s_openapi::api::core::v1::Pod = serde_json::from_value(doc).unwrap();
        assert!(
            admitted.spec.as_ref().unwrap().init_containers.is_none(),
            "{v:?}: the webhook skips"
        );
        assert_eq!(decide(&admitted), PodDecision::SkippedByOperator, "{v:?}");
    }
    // What the webhook does not honour is not an opt-out for the Event either.
    for v in ["no", "false", "", "maybe"] {
        assert!(!truthy(v), "{v:?}");
    }
}

#[test]
fn decisions_and_truthiness() {
    assert!(truthy("true") && truthy("1") && truthy("T") && truthy("TRUE"));
    assert!(truthy("yes") && truthy("on") && !truthy("false") && !truthy(""));
    assert!(matches!(decide(&pod("x", &[], &[])), PodDecision::Skip(_)));
    assert_eq!(
        decide(&pod("x", &[], &[(BY, "ml/kv"), (BY_UID, "u")])),
        PodDecision::VerifyInjection {
            namespace: "ml".to_string(),
            name: "kv".to_string(),
            uid: "u".to_string()
        }
    );
}

/// A pod a CacheBackend selects that carries no decision annotation was admitted without the
/// webhook (fail-open): it gets the reason; decided, opted-out and unselected pods do not.
#[test]
fn selected_pods_the_webhook_never_saw_are_named() {
    use ic_controller::reconcile::engine_pods::admitted_without_webhook;
    let cb: CacheBackend = serde_json::from_value(serde_json::json!({
        "apiVersion": "inferencecache.io/v1alpha1", "kind": "CacheBackend",
        "metadata": {"name": "kv", "namespace": "ml", "uid": "u1"},
        "spec": {"runtime": "VLLM", "engineSelector": {"matchLabels": {"app": "llm"}}}
    }))
    .unwrap();
    let backends = vec![Arc::new(cb)];
    let pod = |labels: serde_json::Value, annotations: serde_json::Value| -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ml", "labels": labels, "annotations": annotations},
            "spec": {"containers": [{"name": "vllm", "image": "vllm"}]}
        }))
        .unwrap()
    };
    let why = admitted_without_webhook(
        &pod(serde_json::json!({"app": "llm"}), serde_json::json!({})),
        &backends,
    )
    .unwrap();
    assert!(why.starts_with("CacheBackend ml/kv: "), "{why}");
    for (labels, annotations) in [
        (
            serde_json::json!({"app": "llm"}),
            serde_json::json!({BY: "ml/kv"}),
        ),
        (
            serde_json::json!({"app": "llm"}),
            serde_json::json!({"inferencecache.io/not-injected": "x"}),
        ),
        (
            serde_json::json!({"app": "llm"}),
            serde_json::json!({SKIPPED: "skip-inject-annotation"}),
        ),
        (
            serde_json::json!({"app": "llm", "inferencecache.io/webhook": "disabled"}),
            serde_json::json!({}),
        ),
        (serde_json::json!({"app": "other"}), serde_json::json!({})),
    ] {
        assert_eq!(
            admitted_without_webhook(&pod(labels.clone(), annotations.clone()), &backends),
            None,
            "{labels} {annotations}"
        );
    }
    let elsewhere = pod(serde_json::json!({"app": "llm"}), serde_json::json!({}));
    let mut other_ns = elsewhere.clone();
    other_ns.metadata.namespace = Some("other".into());
    assert_eq!(admitted_without_webhook(&other_ns, &backends), None);
}
