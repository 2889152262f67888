//! Replica and autoscaling rules (spec "Validating": "spec.replicas=0 + autoscaling requires
//! explicit minReplicas"; "Mooncake provider configuration": the master is a singleton; the
//! `minReplicas <= maxReplicas` CEL rule of the CRD).

use ic_shared::crd::{CacheBackend, RemoteProvider};

use super::{Rule, RuleContext, Violation};

/// The rules of this module, in order.
pub fn rules() -> Vec<Box<dyn Rule>> {
    vec![
        Box::new(ReplicasZeroAutoscalingRequiresMinReplicas),
        Box::new(AutoscalingMinNotAboveMax),
        Box::new(MooncakeSingleton),
    ]
}

/// Rule `replicas_zero_autoscaling_requires_min_replicas`: `spec.replicas: 0` with
/// `spec.autoscaling` and no `minReplicas`. The defaulter declines to copy 0 into
/// `minReplicas` (schema minimum 1), and without this rule the HPA would silently pick 1 and
/// override the operator's scale-to-zero intent.
pub struct ReplicasZeroAutoscalingRequiresMinReplicas;

impl Rule for ReplicasZeroAutoscalingRequiresMinReplicas {
    fn name(&self) -> &'static str {
        "replicas_zero_autoscaling_requires_min_replicas"
    }

    fn check(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<Violation> {
        let spec = &cb.spec;
        match (&spec.autoscaling, spec.replicas) {
            (Some(a), Some(0)) if a.min_replicas.is_none() => vec![Violation::required(
                "spec.autoscaling.minReplicas",
                "spec.replicas is 0 and spec.autoscaling is set: set \
                 spec.autoscaling.minReplicas explicitly, or remove spec.autoscaling to scale to \
                 zero unconditionally",
            )],
            _ => Vec::new(),
        }
    }
}

/// Rule `autoscaling_min_not_above_max`: `minReplicas <= maxReplicas` (mirrors the CRD's CEL
/// rule for callers that bypass the apiserver).
pub struct AutoscalingMinNotAboveMax;

impl Rule for AutoscalingMinNotAboveMax {
    fn name(&self) -> &'static str {
        "autoscaling_min_not_above_max"
    }

    fn check(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<Violation> {
        match &cb.spec.autoscaling {
            Some(a) => match a.min_replicas {
                Some(min) if min > a.max_replicas => vec![Violation::invalid_num(
                    "spec.autoscaling.minReplicas",
                    i64::from(min),
                    format!(
                        "must be less than or equal to spec.autoscaling.maxReplicas ({})",
                        a.max_replicas
                    ),
                )],
                _ => Vec::new(),
            },
            None => Vec::new(),
        }
    }
}

/// Rule `mooncake_singleton`: with `remoteStorage.provider: Mooncake`, `spec.replicas` must be 0
/// or 1 and `spec.autoscaling` is forbidden — a second master either cannot bind its host ports
/// or silently splits the store.
pub struct MooncakeSingleton;

impl Rule for MooncakeSingleton {
    fn name(&self) -> &'static str {
        "mooncake_singleton"
    }

    fn check(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<Violation> {
        let spec = &cb.spec;
        let mooncake = spec
            .remote_storage
            .as_ref()
            .is_some_and(|r| r.provider == RemoteProvider::Mooncake);
        if !mooncake {
            return Vec::new();
        }
        let mut out = Vec::new();
        if let Some(r) = spec.replicas.filter(|r| *r > 1) {
            out.push(Violation::invalid_num(
                "spec.replicas",
                i64::from(r),
                "the Mooncake master is a singleton on the host network: use 1 (or 0 to \
                 disable); a second replica cannot bind its node ports or splits the store",
            ));
        }
        if spec.autoscaling.is_some() {
            out.push(Violation::forbidden(
                "spec.autoscaling",
                "the Mooncake master is a singleton and cannot be autoscaled",
            ));
        }
        out
    }
}
