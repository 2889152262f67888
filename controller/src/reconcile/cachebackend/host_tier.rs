//! The advisory `HiCacheHostTier` condition of `(SGLang, SGLangHiCache)` backends (issue 19
//! item 4; `docs/kv-events.md` "SGLang HiCache readiness"). Pure: pods and index replicas in,
//! the condition out.
//!
//! The spec publishes no Ready on this path (Pod readiness says SGLang serves, not that its
//! host tier takes writes and serves reads); this condition says whether it did, from the
//! engines' own counters as the node agents scrape them (`/metrics`, which SGLang serves only
//! with `--enable-metrics`): per matched engine pod, the tokens its ranks backed up GPU → host
//! (the sum of its streams' `written_tokens`) and the prompt tokens it served from the host
//! tier (`served_tokens`, the pod's own on each stream, so the largest of them).
//!
//! | status | reason | when |
//! |---|---|---|
//! | True | `HostTierRoundTrip` | some matched pod has written > 0 and served > 0 |
//! | Unknown | `HostTierNotExercised` | some matched pod has a current reading, none both |
//! | Unknown | `HostTierSignalUnavailable` | no matched pod has a current reading |
//!
//! Readings are current ones only ([`crate::ingest::host_tier`]): an agent that disconnected, a
//! failed scrape (an engine restarting), an engine that stopped exporting them all remove them,
//! and a restarted engine counts from 0. The verdict also counts a reading only for a Running
//! pod that is not being deleted, and only when it was observed after the pod's latest (re)start
//! (`status.startTime`, containers' `startedAt`): a pod replaced under the same name, or an
//! engine restarted between two scrapes, is never credited with its predecessor's numbers —
//! the condition never reads True from the numbers of an engine or a connection that is gone. It never gates Ready and emits no Event (as its
//! sibling T2Degraded).

use ic_shared::crd::{
    backend_reason as reason, CacheBackend, CacheBackendSpec, CacheType, ConditionStatus, Runtime,
};
use ic_shared::kv::coverage::AGENT_DISCONNECTED;
use k8s_openapi::api::core::v1::Pod;

use super::engine;
use super::index_view::{IndexUnavailable, ReplicaObservation};

/// The message of `HostTierSignalUnavailable` the doc's table gives: SGLang's precondition.
pub const ENABLE_METRICS_HINT: &str = "SGLang exposes its host-tier counters only with \
    --enable-metrics (checked in 0.5.23); add it to the engine to get this condition";

/// Most pods a message names.
const MAX_NAMED: usize = 5;

/// The condition's value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostTierVerdict {
    /// True or Unknown.
    pub status: ConditionStatus,
    /// One of the three reasons.
    pub reason: &'static str,
    /// What was observed, in numbers (tokens) and pod names.
    pub message: String,
}

/// True for the backends the condition is published on: `(SGLang, SGLangHiCache)` in Offload
/// mode (events-only wires no host tier).
pub fn applies(spec: &CacheBackendSpec) -> bool {
    spec.runtime == Runtime::SgLang
        && spec.effective_type() == CacheType::SGLangHiCache
        && !spec.is_events_only()
}

/// One matched pod's host-tier totals.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PodReading {
    pod: String,
    written: u64,
    served: u64,
}

/// Why a matched pod has no current reading.
fn missing_why(replicas: &[&ReplicaObservation]) -> &'static str {
    if replicas.is_empty() {
        "no KV-event stream (the agent scrapes /metrics only of engines whose KV events it follows)"
    } else if replicas
        .iter()
        .all(|r| r.coverage_reason == Some(AGENT_DISCONNECTED))
    {
        "its node agent is disconnected"
    } else if replicas.iter().all(|r| {
        matches!(
            r.coverage_reason,
            Some(AGENT_DISCONNECTED | ic_shared::kv::coverage::NOT_REPORTED)
        )
    }) {
        "its node agent has not reported its KV-event stream (since the controller started, or at all)"
    } else {
        "no host-tier counters on its /metrics"
    }
}

/// Why a matched pod cannot have a current reading whatever the index holds: it is being
/// deleted, or not running (a Pending pod is loading, or is a replacement under the old pod's
/// name, whose reading may still be held).
fn not_serving(pod: &Pod) -> Option<&'static str> {
    if pod.metadata.deletion_timestamp.is_some() {
        return Some("being deleted");
    }
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    (phase != Some("Running")).then_some("not running")
}

/// Unix ms of the pod's latest (re)start: its `status.startTime` or a running container's
/// `state.running.startedAt`, whichever is later. A reading observed before it belongs to an
/// earlier engine (a pod replaced under the same name, a restarted container) and does not
/// count. `None` when the status gives no time.
fn last_start_unix_ms(pod: &Pod) -> Option<i64> {
    let status = pod.status.as_ref()?;
    let containers = status
        .container_statuses
        .iter()
        .flatten()
        .filter_map(|c| c.state.as_ref()?.running.as_ref()?.started_at.as_ref());
    status
        .start_time
        .iter()
        .chain(containers)
        .map(|t| t.0.as_millisecond())
        .max()
}

fn named(items: &[String]) -> String {
    let mut s = items
        .iter()
        .take(MAX_NAMED)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if items.len() > MAX_NAMED {
        s.push_str(&format!(" and {} more", items.len() - MAX_NAMED));
    }
    s
}

/// The `HiCacheHostTier` condition of `cb` from the namespace's pods and the index replicas
/// (see the module docs). A failed pod list or index read reads `HostTierSignalUnavailable`
/// with the error, never the previous verdict.
pub fn verdict(
    cb: &CacheBackend,
    pods: Option<&[Pod]>,
    index: &Result<Vec<ReplicaObservation>, IndexUnavailable>,
) -> HostTierVerdict {
    let unavailable = |detail: String| HostTierVerdict {
        status: ConditionStatus::Unknown,
        reason: reason::HOST_TIER_SIGNAL_UNAVAILABLE,
        message: format!("{ENABLE_METRICS_HINT} ({detail})."),
    };
    let Some(pods) = pods else {
        return unavailable("the controller could not list the engine pods".to_string());
    };
    let replicas = match index {
        Ok(r) => r,
        Err(e) => return unavailable(format!("the controller could not read the index: {e}")),
    };
    let ns = cb.metadata.namespace.as_deref().unwrap_or_default();
    let mut engines: Vec<&Pod> = engine::engine_pods(cb, pods)
        .into_iter()
        .filter(|p| {
            !matches!(
                p.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Succeeded" | "Failed")
            )
        })
        .collect();
    engines.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    if engines.is_empty() {
        return unavailable("no engine pod matches this backend".to_string());
    }
    let mut readings: Vec<PodReading> = Vec::new();
    let mut missing: Vec<String> = Vec::new();
    for pod in engines {
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        if let Some(why) = not_serving(pod) {
            missing.push(format!("{name}: {why}"));
            continue;
        }
        let mine: Vec<&ReplicaObservation> = replicas
            .iter()
            .filter(|r| r.tenant == ns && r.pod_name() == name)
            .collect();
        let started = last_start_unix_ms(pod);
        let with_reading: Vec<_> = mine.iter().filter_map(|r| r.host_tier).collect();
        let current: Vec<_> = with_reading
            .iter()
            .filter(|r| started.is_none_or(|t| r.observed_at_unix_ms >= t))
            .collect();
        if current.is_empty() {
            let why = if with_reading.is_empty() {
                missing_why(&mine)
            } else {
                "no reading since its containers last started (the one held predates them)"
            };
            missing.push(format!("{name}: {why}"));
            continue;
        }
        readings.push(PodReading {
            pod: name.to_string(),
            written: current
                .iter()
                .fold(0u64, |a, r| a.saturating_add(r.written_tokens)),
            served: current.iter().map(|r| r.served_tokens).max().unwrap_or(0),
        });
    }
    if let Some(r) = readings.iter().find(|r| r.written > 0 && r.served > 0) {
        return HostTierVerdict {
            status: ConditionStatus::True,
            reason: reason::HOST_TIER_ROUND_TRIP,
            message: format!(
                "{}: {} tokens written to and {} served from the host tier",
                r.pod, r.written, r.served
            ),
        };
    }
    if !readings.is_empty() {
        let written = readings
            .iter()
            .fold(0u64, |a, r| a.saturating_add(r.written));
        let served = readings
            .iter()
            .fold(0u64, |a, r| a.saturating_add(r.served));
        return HostTierVerdict {
            status: ConditionStatus::Unknown,
            reason: reason::HOST_TIER_NOT_EXERCISED,
            message: format!(
                "no host-tier write and read observed yet ({written} tokens written, {served} \
                 served)"
            ),
        };
    }
    unavailable(format!(
        "no current host-tier reading from {}",
        named(&missing)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ingest::host_tier::HostTierReading;
    use ic_shared::crd::{CacheBackendSpec, IntegrationMode, IntegrationSpec};
    use k8s_openapi::api::core::v1::PodStatus;
    use std::collections::BTreeMap;

    fn backend() -> CacheBackend {
        let mut cb = CacheBackend::new(
            "hicache",
            CacheBackendSpec {
                runtime: Runtime::SgLang,
                type_: Some(CacheType::SGLangHiCache),
                engine_selector: Some(
                    serde_json::from_value(serde_json::json!({"matchLabels": {"app": "sglang"}}))
                        .unwrap(),
                ),
                ..Default::default()
            },
        );
        cb.metadata.namespace = Some("ml".into());
        cb
    }

    fn pod(name: &str, phase: &str) -> Pod {
        let mut p = Pod::default();
        p.metadata.name = Some(name.into());
        p.metadata.namespace = Some("ml".into());
        p.metadata.labels = Some(BTreeMap::from([("app".to_string(), "sglang".to_string())]));
        p.status = Some(PodStatus {
            phase: Some(phase.into()),
            ..Default::default()
        });
        p
    }

    fn replica(replica: &str, host: Option<(u64, u64)>) -> ReplicaObservation {
        ReplicaObservation {
            tenant: "ml".into(),
            replica: replica.into(),
            host_tier: host.map(|(w, s)| HostTierReading {
                written_tokens: w,
                served_tokens: s,
                observed_at_unix_ms: 1,
            }),
            ..Default::default()
        }
    }

    #[test]
    fn applies_only_to_offload_hicache_on_sglang() {
        let mut spec = backend().spec;
        assert!(applies(&spec));
        spec.integration = Some(IntegrationSpec {
            mode: Some(IntegrationMode::EventsOnly),
            ..Default::default()
        });
        assert!(!applies(&spec));
        assert!(!applies(&CacheBackendSpec::default()));
    }

    #[test]
    fn ranks_add_their_writes_and_share_the_pod_s_reads() {
        let pods = [pod("sg-0", "Running")];
        let v = verdict(
            &backend(),
            Some(&pods),
            &Ok(vec![
                replica("sg-0", Some((2048, 1024))),
                replica("sg-0#1", Some((1000, 1024))),
            ]),
        );
        assert_eq!(
            (v.status, v.reason, v.message.as_str()),
            (
                ConditionStatus::True,
                reason::HOST_TIER_ROUND_TRIP,
                "sg-0: 3048 tokens written to and 1024 served from the host tier"
            )
        );
    }

    #[test]
    fn a_write_and_a_read_on_different_pods_are_no_round_trip() {
        let pods = [pod("sg-0", "Running"), pod("sg-1", "Running")];
        let v = verdict(
            &backend(),
            Some(&pods),
            &Ok(vec![
                replica("sg-0", Some((64, 0))),
                replica("sg-1", Some((0, 32))),
            ]),
        );
        assert_eq!(
            (v.status, v.reason, v.message.as_str()),
            (
                ConditionStatus::Unknown,
                reason::HOST_TIER_NOT_EXERCISED,
                "no host-tier write and read observed yet (64 tokens written, 32 served)"
            )
        );
    }

    fn at(ms: i64) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::Time {
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::from_millisecond(ms).unwrap(),
        )
    }

    fn observed(replica_id: &str, w: u64, s: u64, at_ms: i64) -> ReplicaObservation {
        let mut r = replica(replica_id, Some((w, s)));
        if let Some(h) = r.host_tier.as_mut() {
            h.observed_at_unix_ms = at_ms;
        }
        r
    }

    /// A StatefulSet replacement under the same name, a container restarted between two
    /// scrapes, a pod not running or being deleted: the reading held is its predecessor's and
    /// never makes the condition True.
    #[test]
    fn a_reading_from_before_the_pods_latest_start_does_not_count() {
        use k8s_openapi::api::core::v1::{ContainerState, ContainerStateRunning, ContainerStatus};
        let mut replaced = pod("sg-0", "Running");
        replaced.status.as_mut().unwrap().start_time = Some(at(10_000));
        let old = Ok(vec![observed("sg-0", 3072, 2048, 5_000)]);
        let v = verdict(&backend(), Some(std::slice::from_ref(&replaced)), &old);
        assert_eq!(
            (v.status, v.reason),
            (
                ConditionStatus::Unknown,
                reason::HOST_TIER_SIGNAL_UNAVAILABLE
            )
        );
        assert!(
            v.message
                .contains("sg-0: no reading since its containers last started"),
            "{}",
            v.message
        );
        let fresh = Ok(vec![observed("sg-0", 3072, 2048, 20_000)]);
        let v = verdict(&backend(), Some(std::slice::from_ref(&replaced)), &fresh);
        assert_eq!(v.reason, reason::HOST_TIER_ROUND_TRIP);
        // The engine container restarted at 30 s: the 20 s reading is its predecessor's.
        replaced.status.as_mut().unwrap().container_statuses = Some(vec![ContainerStatus {
            name: "sglang".into(),
            state: Some(ContainerState {
                running: Some(ContainerStateRunning {
                    started_at: Some(at(30_000)),
                }),
                ..Default::default()
            }),
            ..Default::default()
        }]);
        let v = verdict(&backend(), Some(std::slice::from_ref(&replaced)), &fresh);
        assert_eq!(
            v.reason,
            reason::HOST_TIER_SIGNAL_UNAVAILABLE,
            "{}",
            v.message
        );
        // Not running, or being deleted: no reading counts.
        let pending = pod("sg-0", "Pending");
        let v = verdict(&backend(), Some(std::slice::from_ref(&pending)), &fresh);
        assert!(v.message.contains("sg-0: not running"), "{}", v.message);
        let mut deleting = pod("sg-0", "Running");
        deleting.metadata.deletion_timestamp = Some(at(40_000));
        let v = verdict(&backend(), Some(std::slice::from_ref(&deleting)), &fresh);
        assert!(v.message.contains("sg-0: being deleted"), "{}", v.message);
    }

    #[test]
    fn no_current_reading_says_why_per_pod() {
        let pods = [
            pod("sg-0", "Running"),
            pod("sg-1", "Running"),
            pod("sg-2", "Running"),
            pod("sg-3", "Running"),
            pod("old", "Succeeded"),
        ];
        let mut gone = replica("sg-1", None);
        gone.coverage = "Unknown";
        gone.coverage_reason = Some(AGENT_DISCONNECTED);
        // Planned, but its agent has not resynced since the controller started.
        let mut unreported = replica("sg-3", None);
        unreported.coverage = "Unknown";
        unreported.coverage_reason = Some(ic_shared::kv::coverage::NOT_REPORTED);
        // A finished pod's reading, another namespace's and an unmatched pod's do not count.
        let mut other_ns = replica("sg-0", Some((5, 5)));
        other_ns.tenant = "other".into();
        let v = verdict(
            &backend(),
            Some(&pods),
            &Ok(vec![
                replica("sg-0", None),
                gone,
                unreported,
                replica("old", Some((5, 5))),
                other_ns,
            ]),
        );
        assert_eq!(
            (v.status, v.reason),
            (
                ConditionStatus::Unknown,
                reason::HOST_TIER_SIGNAL_UNAVAILABLE
            )
        );
        assert_eq!(
            v.message,
            format!(
                "{ENABLE_METRICS_HINT} (no current host-tier reading from sg-0: no host-tier \
                 counters on its /metrics, sg-1: its node agent is disconnected, sg-2: no \
                 KV-event stream (the agent scrapes /metrics only of engines whose KV events it \
                 follows), sg-3: its node agent has not reported its KV-event stream (since the \
                 controller started, or at all))."
            )
        );
        let none = verdict(&backend(), Some(&[]), &Ok(vec![]));
        assert!(
            none.message
                .ends_with("(no engine pod matches this backend)."),
            "{}",
            none.message
        );
        let failed = verdict(
            &backend(),
            Some(&pods),
            &Err(IndexUnavailable("boom".into())),
        );
        assert_eq!(failed.reason, reason::HOST_TIER_SIGNAL_UNAVAILABLE);
        assert!(
            failed.message.contains("prefix index unavailable: boom"),
            "{}",
            failed.message
        );
        assert_eq!(
            verdict(&backend(), None, &Ok(vec![])).reason,
            reason::HOST_TIER_SIGNAL_UNAVAILABLE
        );
    }
}
