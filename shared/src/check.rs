//! Node-check results: the typed verdict every agent check returns (issue "Node agent checks").
//!
//! A [`CheckResult`] is what `ic-agent check` prints, `/v1/report` serves, the agent's metrics
//! count and the controller stores per node. Status order is `Ok < Unknown < Warning < Critical`
//! for the purpose of the overall verdict ([`CheckStatus::exit_code`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::proto;

/// Reason of the one result of a check pass that could not run at all (the agent's checks
/// thread is gone): check `checks`, subject `host`, Unknown. The controller reads it as
/// CacheNode `Ready=Unknown` with this reason.
pub const CHECKS_UNAVAILABLE: &str = "ChecksUnavailable";

/// Verdict of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CheckStatus {
    /// The surface was inspected and is healthy.
    Ok,
    /// Degraded or suspicious; engines may still run.
    Warning,
    /// Engines on this node will fail (SIGBUS, port clash, dead GPU…).
    Critical,
    /// The check could not run (library or surface missing); says nothing about health.
    Unknown,
}

impl CheckStatus {
    /// Severity rank used to compute the worst status: Ok 0, Unknown 1, Warning 2, Critical 3.
    pub fn severity(self) -> u8 {
        match self {
            CheckStatus::Ok => 0,
            CheckStatus::Unknown => 1,
            CheckStatus::Warning => 2,
            CheckStatus::Critical => 3,
        }
    }

    /// Process exit status for `ic-agent check`: 0 ok (or unknown), 1 warning, 2 critical.
    pub fn exit_code(self) -> i32 {
        match self {
            CheckStatus::Ok | CheckStatus::Unknown => 0,
            CheckStatus::Warning => 1,
            CheckStatus::Critical => 2,
        }
    }

    /// Stable lower-case label for metrics (`ok`, `warning`, `critical`, `unknown`).
    pub fn as_label(self) -> &'static str {
        match self {
            CheckStatus::Ok => "ok",
            CheckStatus::Warning => "warning",
            CheckStatus::Critical => "critical",
            CheckStatus::Unknown => "unknown",
        }
    }

    /// The worst of a set of statuses (`Ok` for an empty set).
    pub fn worst<I: IntoIterator<Item = CheckStatus>>(it: I) -> CheckStatus {
        it.into_iter()
            .max_by_key(|s| s.severity())
            .unwrap_or(CheckStatus::Ok)
    }
}

impl std::fmt::Display for CheckStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            CheckStatus::Ok => "Ok",
            CheckStatus::Warning => "Warning",
            CheckStatus::Critical => "Critical",
            CheckStatus::Unknown => "Unknown",
        };
        f.write_str(s)
    }
}

/// Result of one check on one subject.
///
/// JSON shape (`ic-agent check --json`, `/v1/report`, `/v1/nodes`):
/// `{"name":"shm","subject":"host","status":"Critical","reason":"ShmUndersized","message":"…","observed":{"sizeBytes":"67108864",…}}`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckResult {
    /// Check name: `shm`, `ports`, `gpu`, …
    pub name: String,
    /// What the result is about: `host`, `ns/pod`, `gpu0`, `tcp/8080`.
    pub subject: String,
    /// Verdict.
    pub status: CheckStatus,
    /// CamelCase reason (documented per check in `docs/checks.md`).
    pub reason: String,
    /// Sentence a person can act on.
    pub message: String,
    /// Observed values; keys carry units (`sizeBytes`, `usedBytes`, `temperatureCelsius`).
    #[serde(default)]
    pub observed: BTreeMap<String, String>,
}

impl CheckResult {
    /// A result with no observed values.
    pub fn new(
        name: impl Into<String>,
        subject: impl Into<String>,
        status: CheckStatus,
        reason: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        CheckResult {
            name: name.into(),
            subject: subject.into(),
            status,
            reason: reason.into(),
            message: message.into(),
            observed: BTreeMap::new(),
        }
    }

    /// Adds one observed value (builder style).
    pub fn with(mut self, key: impl Into<String>, value: impl ToString) -> Self {
        self.observed.insert(key.into(), value.to_string());
        self
    }
}

impl From<CheckStatus> for proto::CheckStatus {
    fn from(s: CheckStatus) -> Self {
        match s {
            CheckStatus::Ok => proto::CheckStatus::Ok,
            CheckStatus::Warning => proto::CheckStatus::Warning,
            CheckStatus::Critical => proto::CheckStatus::Critical,
            CheckStatus::Unknown => proto::CheckStatus::Unknown,
        }
    }
}

impl From<proto::CheckStatus> for CheckStatus {
    fn from(s: proto::CheckStatus) -> Self {
        match s {
            proto::CheckStatus::Ok => CheckStatus::Ok,
            proto::CheckStatus::Warning => CheckStatus::Warning,
            proto::CheckStatus::Critical => CheckStatus::Critical,
            proto::CheckStatus::Unknown | proto::CheckStatus::Unspecified => CheckStatus::Unknown,
        }
    }
}

impl From<&CheckResult> for proto::CheckResult {
    fn from(r: &CheckResult) -> Self {
        proto::CheckResult {
            name: r.name.clone(),
            subject: r.subject.clone(),
            status: proto::CheckStatus::from(r.status) as i32,
            reason: r.reason.clone(),
            message: r.message.clone(),
            observed: r.observed.clone().into_iter().collect(),
        }
    }
}

impl From<&proto::CheckResult> for CheckResult {
    fn from(r: &proto::CheckResult) -> Self {
        let status = proto::CheckStatus::try_from(r.status)
            .map(CheckStatus::from)
            .unwrap_or(CheckStatus::Unknown);
        CheckResult {
            name: r.name.clone(),
            subject: r.subject.clone(),
            status,
            reason: r.reason.clone(),
            message: r.message.clone(),
            observed: r.observed.clone().into_iter().collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worst_orders_critical_over_warning_over_unknown() {
        use CheckStatus::*;
        assert_eq!(CheckStatus::worst([Ok, Unknown]), Unknown);
        assert_eq!(CheckStatus::worst([Ok, Warning, Unknown]), Warning);
        assert_eq!(CheckStatus::worst([Critical, Warning]), Critical);
        assert_eq!(CheckStatus::worst([]), Ok);
        assert_eq!(Critical.exit_code(), 2);
        assert_eq!(Warning.exit_code(), 1);
        assert_eq!(Unknown.exit_code(), 0);
    }

    #[test]
    fn proto_round_trip_keeps_everything() {
        let r = CheckResult::new("shm", "host", CheckStatus::Critical, "ShmUndersized", "m")
            .with("sizeBytes", 64u64);
        let p = proto::CheckResult::from(&r);
        assert_eq!(CheckResult::from(&p), r);
    }
}
