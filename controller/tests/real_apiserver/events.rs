//! Events as the real API validates them: `events.k8s.io/v1` limits `note` to 1 024 **bytes**;
//! a note cut at 1 024 characters (non-ASCII text, a long path list) was refused with 422.

use ic_controller::reconcile::cachebackend::events::{
    EventSink, EventSpec, KubeEventSink, Recorded, NOTE_LIMIT_BYTES,
};
use k8s_openapi::api::core::v1::{ConfigMap, ObjectReference};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, PostParams};
use kube::Resource;
use serde_json::json;

use crate::support::Cluster;

#[tokio::test]
async fn long_non_ascii_notes_are_accepted() {
    let c = Cluster::get().await;
    let ns = c.namespace("events").await;
    let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "subject"}})).unwrap();
    let cm = Api::<ConfigMap>::namespaced(c.admin.clone(), &ns)
        .create(&PostParams::default(), &cm)
        .await
        .unwrap();
    let regarding: ObjectReference = cm.object_ref(&());
    let sink = KubeEventSink::new(c.admin.clone(), "inference-cache-controller", None);
    // 1 500 characters of 2-byte UTF-8, then a 4-byte character across the cut.
    let note = format!("{}{}", "é".repeat(511), "🙂".repeat(400));
    sink.publish(
        &regarding,
        &EventSpec::warning("TierDegraded", note.clone()),
    )
    .await
    .unwrap();
    assert_eq!(
        sink.publish_once(
            &regarding,
            &EventSpec::normal("InjectedByCacheBackend", note.clone())
        )
        .await
        .unwrap(),
        Recorded::New
    );
    assert_eq!(
        sink.publish_once(
            &regarding,
            &EventSpec::normal("InjectedByCacheBackend", note)
        )
        .await
        .unwrap(),
        Recorded::AlreadyRecorded,
        "the second create of the once-Event is the apiserver's 409"
    );
    let events = Api::<Event>::namespaced(c.admin.clone(), &ns)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    assert_eq!(events.len(), 2, "{events:?}");
    for e in events {
        let stored = e.note.unwrap();
        assert!(
            stored.len() <= NOTE_LIMIT_BYTES && stored.len() > 1000,
            "{}",
            stored.len()
        );
        assert!(stored.starts_with("éé"));
    }
    c.drop_namespace(&ns).await;
}
