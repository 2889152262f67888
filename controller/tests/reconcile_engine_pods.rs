//! The engine-pod Events controller against the in-memory API (spec 000 "Mutating Pod webhook"
//! Events row, "Contract Notes"): InjectedByCacheBackend only when the UID annotation matches
//! the live CR; SkippedByOperator only with both skip annotations.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod reconcile_support;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use ic_controller::reconcile::cachebackend::events::RecordingEventSink;
use ic_controller::reconcile::engine_pods::{
    decide, reconcile_engine_pod, truthy, PodDecision, PodEventsContext,
};
use ic_shared::crd::CacheBackend;
use k8s_openapi::api::core::v1::Pod;
use kube_fake_client::{interceptor, ClientBuilder};
use reconcile_support::*;

const BY: &str = "inferencecache.io/injected-by";
const BY_UID: &str = "inferencecache.io/injected-by-uid";
const SKIP: &str = "inferencecache.io/skip-inject";
const SKIPPED: &str = "inferencecache.io/inject-skipped";

async fn ctx_with(cbs: Vec<CacheBackend>) -> (Arc<PodEventsContext>, Arc<RecordingEventSink>) {
    let client = fake_client(cbs).await;
    let events = Arc::new(RecordingEventSink::new());
    let ctx = Arc::new(PodEventsContext::new(
        client,
        events.clone(),
        Arc::new(AtomicBool::new(true)),
    ));
    (ctx, events)
}

async fn run(ctx: &Arc<PodEventsContext>, p: Pod) {
    reconcile_engine_pod(Arc::new(p), ctx.clone())
        .await
        .unwrap();
}

#[tokio::test]
async fn injected_by_cache_backend_when_the_uid_matches() {
    let cb = managed_redis("kv");
    let (ctx, events) = ctx_with(vec![cb.clone()]).await;
    let p = injected_engine("engine-0", &cb, "vllm");
    run(&ctx, p.clone()).await;
    run(&ctx, p).await;
    let ev = events.events();
    assert_eq!(ev.len(), 1, "recorded once per pod");
    assert_eq!(ev[0].event.reason, "InjectedByCacheBackend");
    assert_eq!(ev[0].object_kind, "Pod");
    assert_eq!(ev[0].object, "ml/engine-0");
    assert_eq!(ev[0].object_uid, "uid-engine-0");
}

#[tokio::test]
async fn no_injection_event_on_forgery_shapes_or_missing_cr() {
    let cb = managed_redis("kv");
    let (ctx, events) = ctx_with(vec![cb.clone()]).await;
    // UID mismatch (forged or CR recreated).
    run(
        &ctx,
        pod("a", &[], &[(BY, "ml/kv"), (BY_UID, "someone-else")]),
    )
    .await;
    // UID annotation absent.
    run(&ctx, pod("b", &[], &[(BY, "ml/kv")])).await;
    // Named CR missing.
    run(
        &ctx,
        pod("c", &[], &[(BY, "ml/gone"), (BY_UID, "uid-gone")]),
    )
    .await;
    // Malformed.
    run(&ctx, pod("d", &[], &[(BY, "kv"), (BY_UID, "uid-kv")])).await;
    assert!(events.events().is_empty());
}

#[tokio::test]
async fn lookup_errors_are_reconcile_errors() {
    let client = ClientBuilder::new()
        .with_resource::<CacheBackend>()
        .with_interceptor_funcs(interceptor::Funcs::new().get(|_ctx| {
            Err(kube_fake_client::Error::Internal(
                "apiserver unavailable".into(),
            ))
        }))
        .build()
        .await
        .unwrap();
    let events = Arc::new(RecordingEventSink::new());
    let ctx = Arc::new(PodEventsContext::new(
        client,
        events.clone(),
        Arc::new(AtomicBool::new(true)),
    ));
    let p = pod("a", &[], &[(BY, "ml/kv"), (BY_UID, "uid-kv")]);
    assert!(reconcile_engine_pod(Arc::new(p), ctx).await.is_err());
    assert!(events.events().is_empty());
}

#[tokio::test]
async fn skipped_by_operator_needs_both_annotations() {
    let (ctx, events) = ctx_with(vec![]).await;
    run(
        &ctx,
        pod(
            "a",
            &[],
            &[(SKIP, "true"), (SKIPPED, "skip-inject-annotation")],
        ),
    )
    .await;
    run(&ctx, pod("b", &[], &[(SKIP, "true")])).await;
    run(&ctx, pod("c", &[], &[(SKIPPED, "skip-inject-annotation")])).await;
    run(
        &ctx,
        pod(
            "d",
            &[],
            &[(SKIP, "false"), (SKIPPED, "skip-inject-annotation")],
        ),
    )
    .await;
    let ev = events.events();
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].event.reason, "SkippedByOperator");
    assert_eq!(ev[0].object, "ml/a");
}

#[tokio::test]
async fn followers_record_nothing() {
    let cb = managed_redis("kv");
    let client = fake_client(vec![cb.clone()]).await;
    let events = Arc::new(RecordingEventSink::new());
    let ctx = Arc::new(PodEventsContext::new(
        client,
        events.clone(),
        Arc::new(AtomicBool::new(false)),
    ));
    run(&ctx, injected_engine("engine-0", &cb, "vllm")).await;
    assert!(events.events().is_empty());
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
