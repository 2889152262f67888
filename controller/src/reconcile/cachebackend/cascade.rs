//! `status.observedServerInstance` and the cascade restart of injected engine Deployments
//! (spec 000 "Status": observedServerInstance).
//!
//! The identifier is `<pod-uid>:<restart-sum>` per Ready cache-server pod, comma-joined and
//! sorted by pod name; `<restart-sum>` counts only the cache-server's own containers (those on
//! the owned workload's pod template), so an injected sidecar's crash-loop never advances it.
//!
//! [`decide`] is the whole state machine:
//!
//! | observation | decision |
//! |---|---|
//! | no Ready server pod | keep the prior value (stale-while-unavailable) |
//! | no prior value | baseline, no cascade |
//! | unchanged | keep |
//! | a prior pod gone, or a persisting pod's restart-sum advanced | cascade (rate-limited) |
//! | strict superset of the prior pods, workload converged | baseline (scale-up), no cascade |
//! | strict superset, not converged | keep (rolling-update midpoint) |

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;

use super::index_view::selector_matches;
use crate::reconcile::clock::add;

/// The engine pod-template annotation value of a cascade for server instance `instance`
/// (`server-<16 hex digits of xxh3(instance)>`): one value per replacement, so repeating a
/// cascade is idempotent.
pub fn trigger_value(instance: &str) -> String {
    format!(
        "server-{:016x}",
        xxhash_rust::xxh3::xxh3_64(instance.as_bytes())
    )
}

/// The merge patch a cascade sends to each engine Deployment for server instance `instance`:
/// only the pod-template annotation
/// [`CACHE_SERVER_RESTART_TRIGGER`](crate::reconcile::annotations::CACHE_SERVER_RESTART_TRIGGER)
/// set to [`trigger_value`] (the chart's ValidatingAdmissionPolicy admits exactly this change on
/// Deployments the controller does not own).
pub fn restart_patch(instance: &str) -> serde_json::Value {
    serde_json::json!({"spec": {"template": {"metadata": {"annotations": {
        crate::reconcile::annotations::CACHE_SERVER_RESTART_TRIGGER: trigger_value(instance),
    }}}}})
}

/// One Ready cache-server pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerPod {
    /// Pod name (sort key).
    pub name: String,
    /// Pod UID.
    pub uid: String,
    /// Sum of restart counts of the cache-server containers.
    pub restarts: i64,
}

/// The cascade decision for one reconcile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CascadeDecision {
    /// Leave `observedServerInstance` as it is.
    Keep,
    /// Persist this value as the new baseline without restarting engines.
    Baseline(String),
    /// The server was replaced: persist this value and restart the injected engines.
    Fire(String),
    /// The server was replaced but a cascade ran less than the minimum interval ago: keep the
    /// old baseline and look again after this long.
    Defer(Duration),
}

/// Whether the owned workload is converged: `spec.replicas == status.readyReplicas ==
/// status.updatedReplicas == live Ready pods` and `observedGeneration >= generation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Convergence {
    /// `spec.replicas` (HPA-written when autoscaled).
    pub spec_replicas: i32,
    /// `status.readyReplicas`.
    pub ready_replicas: i32,
    /// `status.updatedReplicas`.
    pub updated_replicas: i32,
    /// `status.observedGeneration`.
    pub observed_generation: i64,
    /// `metadata.generation`.
    pub generation: i64,
}

impl Convergence {
    /// True when converged against `live_ready` Ready pods seen this reconcile.
    pub fn converged(&self, live_ready: usize) -> bool {
        let live = i32::try_from(live_ready).unwrap_or(i32::MAX);
        self.spec_replicas == self.ready_replicas
            && self.ready_replicas == self.updated_replicas
            && self.updated_replicas == live
            && self.observed_generation >= self.generation
    }
}

fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The Ready pods matching `selector`, sorted by name, with restart sums over
/// `container_names`.
pub fn ready_server_pods(
    pods: &[Pod],
    namespace: &str,
    selector: &BTreeMap<String, String>,
    container_names: &[String],
) -> Vec<ServerPod> {
    let mut out: Vec<ServerPod> = pods
        .iter()
        .filter(|p| p.metadata.namespace.as_deref().unwrap_or_default() == namespace)
        .filter(|p| selector_matches(selector, p))
        .filter(|p| pod_ready(p))
        .filter_map(|p| {
            let restarts = p
                .status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .map(|cs| {
                    cs.iter()
                        .filter(|c| container_names.contains(&c.name))
                        .map(|c| i64::from(c.restart_count))
                        .sum()
                })
                .unwrap_or(0);
            Some(ServerPod {
                name: p.metadata.name.clone()?,
                uid: p.metadata.uid.clone()?,
                restarts,
            })
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// The identifier of a (name-sorted) pod set: `uid:restarts,…`.
pub fn instance_id(pods: &[ServerPod]) -> String {
    pods.iter()
        .map(|p| format!("{}:{}", p.uid, p.restarts))
        .collect::<Vec<_>>()
        .join(",")
}

/// Parses an identifier into uid → restart-sum (malformed entries are skipped).
pub fn parse_instance(id: &str) -> HashMap<String, i64> {
    id.split(',')
        .filter_map(|e| {
            let (uid, n) = e.trim().rsplit_once(':')?;
            Some((uid.to_string(), n.parse().ok()?))
        })
        .collect()
}

/// Decides what to do with `observedServerInstance` (see the module table).
pub fn decide(
    prior: Option<&str>,
    current: &[ServerPod],
    convergence: Option<Convergence>,
    last_cascade: Option<Timestamp>,
    now: Timestamp,
    min_interval: Duration,
) -> CascadeDecision {
    if current.is_empty() {
        return CascadeDecision::Keep;
    }
    let id = instance_id(current);
    let prior = prior.filter(|p| !p.is_empty());
    let Some(prior) = prior else {
        return CascadeDecision::Baseline(id);
    };
    if prior == id {
        return CascadeDecision::Keep;
    }
    let before = parse_instance(prior);
    let after: HashMap<&str, i64> = current
        .iter()
        .map(|p| (p.uid.as_str(), p.restarts))
        .collect();
    let gone = before.keys().any(|uid| !after.contains_key(uid.as_str()));
    let restarted = before
        .iter()
        .any(|(uid, n)| after.get(uid.as_str()).is_some_and(|m| m > n));
    if gone || restarted {
        if let Some(last) = last_cascade {
            let next = add(last, min_interval);
            if now < next {
                let wait = Duration::try_from(next.duration_since(now)).unwrap_or(min_interval);
                return CascadeDecision::Defer(wait.max(Duration::from_secs(1)));
            }
        }
        return CascadeDecision::Fire(id);
    }
    let superset = after.len() > before.len();
    if superset {
        return if convergence.is_some_and(|c| c.converged(current.len())) {
            CascadeDecision::Baseline(id)
        } else {
            CascadeDecision::Keep
        };
    }
    // Same pods, restart sums not advanced (a counter reset): take the new value silently.
    CascadeDecision::Baseline(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sp(name: &str, uid: &str, restarts: i64) -> ServerPod {
        ServerPod {
            name: name.to_string(),
            uid: uid.to_string(),
            restarts,
        }
    }

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }

    const MIN: Duration = Duration::from_secs(30);

    #[test]
    fn table() {
        let conv = Convergence {
            spec_replicas: 2,
            ready_replicas: 2,
            updated_replicas: 2,
            observed_generation: 3,
            generation: 3,
        };
        // Stale-while-unavailable.
        assert_eq!(
            decide(Some("a:0"), &[], None, None, t(0), MIN),
            CascadeDecision::Keep
        );
        // First observation never cascades.
        assert_eq!(
            decide(None, &[sp("p", "a", 0)], None, None, t(0), MIN),
            CascadeDecision::Baseline("a:0".to_string())
        );
        // Unchanged.
        assert_eq!(
            decide(Some("a:0"), &[sp("p", "a", 0)], None, None, t(0), MIN),
            CascadeDecision::Keep
        );
        // Replacement.
        assert_eq!(
            decide(Some("a:0"), &[sp("p", "b", 0)], None, None, t(0), MIN),
            CascadeDecision::Fire("b:0".to_string())
        );
        // In-place restart.
        assert_eq!(
            decide(Some("a:0"), &[sp("p", "a", 1)], None, None, t(0), MIN),
            CascadeDecision::Fire("a:1".to_string())
        );
        // Rate-limited.
        assert_eq!(
            decide(
                Some("a:0"),
                &[sp("p", "b", 0)],
                None,
                Some(t(100)),
                t(110),
                MIN
            ),
            CascadeDecision::Defer(Duration::from_secs(20))
        );
        // Rolling-update midpoint (strict superset, not converged).
        let mid = [sp("p1", "a", 0), sp("p2", "b", 0)];
        let not_conv = Convergence {
            ready_replicas: 1,
            ..conv
        };
        assert_eq!(
            decide(Some("a:0"), &mid, Some(not_conv), None, t(0), MIN),
            CascadeDecision::Keep
        );
        // Converged scale-up.
        assert_eq!(
            decide(Some("a:0"), &mid, Some(conv), None, t(0), MIN),
            CascadeDecision::Baseline("a:0,b:0".to_string())
        );
    }

    #[test]
    fn parse_round_trips() {
        let ids = parse_instance("u1:0,u2:3");
        assert_eq!(ids.get("u1"), Some(&0));
        assert_eq!(ids.get("u2"), Some(&3));
    }
}
