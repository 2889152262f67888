//! Condition helpers shared by every resource's `status.conditions` (spec 000 "Conditions").
//!
//! All resources use the standard `metav1.Condition` shape
//! ([`k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition`]): `type`, `status`
//! (`True` | `False` | `Unknown`), `reason` (CamelCase), `message`, `lastTransitionTime`,
//! `observedGeneration`. The list is a map keyed by `type` (one entry per type).
//!
//! The rule every writer follows: `lastTransitionTime` moves only when `status` changes. A new
//! reason or message on an unchanged status updates those fields in place and keeps the old
//! transition time, so `kubectl describe` shows how long a state has really lasted.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

/// The three values of `condition.status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConditionStatus {
    /// `True`.
    True,
    /// `False`.
    False,
    /// `Unknown`.
    Unknown,
}

impl ConditionStatus {
    /// The wire spelling: `True`, `False` or `Unknown`.
    pub fn as_str(self) -> &'static str {
        match self {
            ConditionStatus::True => "True",
            ConditionStatus::False => "False",
            ConditionStatus::Unknown => "Unknown",
        }
    }

    /// Parses the wire spelling; anything else is `None`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "True" => Some(ConditionStatus::True),
            "False" => Some(ConditionStatus::False),
            "Unknown" => Some(ConditionStatus::Unknown),
            _ => None,
        }
    }

    /// `True` for `true`, `False` for `false`.
    pub fn from_bool(b: bool) -> Self {
        if b {
            ConditionStatus::True
        } else {
            ConditionStatus::False
        }
    }
}

impl std::fmt::Display for ConditionStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The current time truncated to whole seconds, as a `metav1.Time`.
///
/// `metav1.Time` serializes with second precision, so truncating here keeps an in-memory value
/// equal to the same value read back from the API server.
pub fn now() -> Time {
    let ts = Timestamp::now();
    Time(Timestamp::from_second(ts.as_second()).unwrap_or(ts))
}

/// Builds a condition stamped with `at` as its transition time.
///
/// `observed_generation` is the `.metadata.generation` the condition was computed from, when
/// known.
pub fn new_condition(
    type_: impl Into<String>,
    status: ConditionStatus,
    reason: impl Into<String>,
    message: impl Into<String>,
    observed_generation: Option<i64>,
    at: Time,
) -> Condition {
    Condition {
        type_: type_.into(),
        status: status.as_str().to_string(),
        reason: reason.into(),
        message: message.into(),
        observed_generation,
        last_transition_time: at,
    }
}

/// The condition of type `type_`, if present.
pub fn find_condition<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// The status of the condition of type `type_`, if present and well-formed.
pub fn condition_status(conditions: &[Condition], type_: &str) -> Option<ConditionStatus> {
    find_condition(conditions, type_).and_then(|c| ConditionStatus::parse(&c.status))
}

/// True when the condition of type `type_` is present with status `True`.
pub fn is_condition_true(conditions: &[Condition], type_: &str) -> bool {
    condition_status(conditions, type_) == Some(ConditionStatus::True)
}

/// Inserts or updates `new` in `conditions` (keyed by `type`).
///
/// When a condition of that type already exists with the same `status`, its
/// `lastTransitionTime` is kept and only `reason`, `message` and `observedGeneration` are taken
/// from `new`. When the status differs (or the type is new) `new` is stored as given, transition
/// time included. Returns true when `conditions` changed.
pub fn set_condition(conditions: &mut Vec<Condition>, mut new: Condition) -> bool {
    match conditions.iter_mut().find(|c| c.type_ == new.type_) {
        Some(existing) => {
            if existing.status == new.status {
                new.last_transition_time = existing.last_transition_time.clone();
            }
            if *existing == new {
                false
            } else {
                *existing = new;
                true
            }
        }
        None => {
            conditions.push(new);
            true
        }
    }
}

/// Removes the condition of type `type_`. Returns true when one was removed.
pub fn remove_condition(conditions: &mut Vec<Condition>, type_: &str) -> bool {
    let before = conditions.len();
    conditions.retain(|c| c.type_ != type_);
    conditions.len() != before
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(second: i64) -> Time {
        Time(Timestamp::from_second(second).unwrap_or(Timestamp::UNIX_EPOCH))
    }

    #[test]
    fn set_inserts_new_type() {
        let mut conds = Vec::new();
        let changed = set_condition(
            &mut conds,
            new_condition(
                "Ready",
                ConditionStatus::False,
                "AwaitingFirstKVEvent",
                "",
                Some(1),
                at(10),
            ),
        );
        assert!(changed);
        assert_eq!(conds.len(), 1);
        assert_eq!(
            condition_status(&conds, "Ready"),
            Some(ConditionStatus::False)
        );
    }

    #[test]
    fn same_status_keeps_transition_time_but_takes_reason_and_message() {
        let mut conds = vec![new_condition(
            "Ready",
            ConditionStatus::False,
            "RolloutInProgress",
            "rolling",
            Some(1),
            at(10),
        )];
        let changed = set_condition(
            &mut conds,
            new_condition(
                "Ready",
                ConditionStatus::False,
                "AwaitingFirstKVEvent",
                "waiting",
                Some(2),
                at(99),
            ),
        );
        assert!(changed);
        let c = &conds[0];
        assert_eq!(c.last_transition_time, at(10));
        assert_eq!(c.reason, "AwaitingFirstKVEvent");
        assert_eq!(c.message, "waiting");
        assert_eq!(c.observed_generation, Some(2));
    }

    #[test]
    fn identical_update_reports_no_change() {
        let c = new_condition(
            "Ready",
            ConditionStatus::True,
            "BackendReady",
            "",
            None,
            at(10),
        );
        let mut conds = vec![c.clone()];
        let mut later = c;
        later.last_transition_time = at(50);
        assert!(!set_condition(&mut conds, later));
        assert_eq!(conds[0].last_transition_time, at(10));
    }

    #[test]
    fn status_change_moves_transition_time() {
        let mut conds = vec![new_condition(
            "Ready",
            ConditionStatus::False,
            "AwaitingFirstKVEvent",
            "",
            None,
            at(10),
        )];
        assert!(set_condition(
            &mut conds,
            new_condition(
                "Ready",
                ConditionStatus::True,
                "KVEventsObserved",
                "",
                None,
                at(20)
            ),
        ));
        assert_eq!(conds[0].last_transition_time, at(20));
        assert!(is_condition_true(&conds, "Ready"));
    }

    #[test]
    fn find_and_remove() {
        let mut conds = vec![
            new_condition("Ready", ConditionStatus::True, "R", "", None, at(1)),
            new_condition(
                "Degraded",
                ConditionStatus::False,
                "NotDegraded",
                "",
                None,
                at(1),
            ),
        ];
        assert_eq!(
            find_condition(&conds, "Degraded").map(|c| c.reason.as_str()),
            Some("NotDegraded")
        );
        assert!(find_condition(&conds, "Progressing").is_none());
        assert!(!is_condition_true(&conds, "Degraded"));
        assert!(remove_condition(&mut conds, "Degraded"));
        assert!(!remove_condition(&mut conds, "Degraded"));
        assert_eq!(conds.len(), 1);
    }

    #[test]
    fn status_spellings() {
        for s in [
            ConditionStatus::True,
            ConditionStatus::False,
            ConditionStatus::Unknown,
        ] {
            assert_eq!(ConditionStatus::parse(s.as_str()), Some(s));
        }
        assert_eq!(ConditionStatus::parse("true"), None);
        assert_eq!(ConditionStatus::from_bool(true), ConditionStatus::True);
    }

    #[test]
    fn now_is_whole_seconds() {
        let t = now();
        assert_eq!(t.0.subsec_nanosecond(), 0);
    }
}
