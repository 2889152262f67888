//! CacheBackend validation (spec 000 "Admission" → "Validating", and every other admission rule
//! the spec states).
//!
//! Validation runs in three stages, all aggregated into one list of field-scoped
//! [`Violation`]s so kubectl prints them together:
//!
//! 1. **schema** ([`schema`]): the object is checked against the generated CRD's
//!    `openAPIV3Schema` (types, enums with their supported values, required fields, numeric
//!    bounds, the duration pattern). The apiserver already enforces this before our webhook runs;
//!    we repeat it so that `ic-controller admit` and any caller that bypasses the apiserver get
//!    the same answer, and so that an enum typo names its supported values.
//! 2. **decode**: the object is decoded into [`CacheBackend`]; a failure is reported at its
//!    field path.
//! 3. **rules**: an ordered, pluggable list of [`Rule`]s ([`Validator::builtin`]). Structural rules
//!    come first; the runtime-adapter rules consult the [`Registry`] last (spec: "the
//!    runtime/backend compatibility check runs separately because it needs to consult the shared
//!    Registry").
//!
//! Warnings (e.g. Mooncake without `engineHostNetwork`) never reject; they are returned
//! separately and sent as AdmissionReview `warnings`.
//!
//! [`Validator::validate_update`] drops violations the old object already had, compared by
//! (kind, field, bad value, detail), so an unrelated edit of an object admitted under a laxer
//! rule set is not suddenly rejected, while editing the bad field still is.

pub mod annotations;
pub mod endpoint;
pub mod events_only;
pub mod hicache;
pub mod hierarchy;
pub mod integration;
pub mod lmcache;
pub use crate::quantity;
pub mod replicas;
pub mod resources;
pub mod runtime;
pub mod schema;

use std::collections::HashSet;
use std::fmt;

use ic_shared::crd::CacheBackend;
use serde_json::Value;

use crate::adapters::Registry;
use crate::admission::review::{Operation, Status, StatusCause, StatusDetails};

/// The type of a field error, as Kubernetes' `field.ErrorType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ViolationKind {
    /// A required field is missing (`Required value`).
    Required,
    /// A value is malformed or out of range (`Invalid value`).
    Invalid,
    /// A field may not be set in this configuration (`Forbidden`).
    Forbidden,
    /// A value is not one of the supported values (`Unsupported value`).
    NotSupported,
    /// A value is repeated where it must be unique (`Duplicate value`).
    Duplicate,
    /// A list has too many items (`Too many`).
    TooMany,
}

impl ViolationKind {
    /// The human spelling Kubernetes prints (`Invalid value`, `Required value`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            ViolationKind::Required => "Required value",
            ViolationKind::Invalid => "Invalid value",
            ViolationKind::Forbidden => "Forbidden",
            ViolationKind::NotSupported => "Unsupported value",
            ViolationKind::Duplicate => "Duplicate value",
            ViolationKind::TooMany => "Too many",
        }
    }

    /// The `metav1.CauseType` used in `status.details.causes[].reason`.
    pub fn cause_type(self) -> &'static str {
        match self {
            ViolationKind::Required => "FieldValueRequired",
            ViolationKind::Invalid => "FieldValueInvalid",
            ViolationKind::Forbidden => "FieldValueForbidden",
            ViolationKind::NotSupported => "FieldValueNotSupported",
            ViolationKind::Duplicate => "FieldValueDuplicate",
            ViolationKind::TooMany => "FieldValueTooMany",
        }
    }
}

/// One field-scoped violation, formatted like a Kubernetes field error:
/// `spec.remoteStorage.endpoint: Invalid value: "redis:0": port must be in 1-65535`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Violation {
    /// Error type.
    pub kind: ViolationKind,
    /// Field path (`spec.remoteStorage.endpoint`, `spec.integration.engineOverrides.args[0]`,
    /// `metadata.annotations[inferencecache.io/lmcache-kernel-check]`).
    pub field: String,
    /// The offending value, already rendered as Kubernetes prints it: strings quoted
    /// (`"lm://x"`), numbers bare (`3`). `None` for Required/Forbidden.
    pub bad_value: Option<String>,
    /// What is wrong and how to fix it.
    pub detail: String,
}

impl Violation {
    /// `Required value` at `field`.
    pub fn required(field: impl Into<String>, detail: impl Into<String>) -> Self {
        Violation {
            kind: ViolationKind::Required,
            field: field.into(),
            bad_value: None,
            detail: detail.into(),
        }
    }

    /// `Forbidden` at `field`.
    pub fn forbidden(field: impl Into<String>, detail: impl Into<String>) -> Self {
        Violation {
            kind: ViolationKind::Forbidden,
            field: field.into(),
            bad_value: None,
            detail: detail.into(),
        }
    }

    /// `Invalid value` with a string value (rendered quoted).
    pub fn invalid(field: impl Into<String>, value: &str, detail: impl Into<String>) -> Self {
        Violation {
            kind: ViolationKind::Invalid,
            field: field.into(),
            bad_value: Some(quote(value)),
            detail: detail.into(),
        }
    }

    /// `Invalid value` with a number (rendered bare).
    pub fn invalid_num(field: impl Into<String>, value: i64, detail: impl Into<String>) -> Self {
        Violation {
            kind: ViolationKind::Invalid,
            field: field.into(),
            bad_value: Some(value.to_string()),
            detail: detail.into(),
        }
    }

    /// `Unsupported value` with the supported values listed in the detail
    /// (`supported values: "a", "b"`), as Kubernetes' `field.NotSupported` prints it.
    pub fn not_supported<S: AsRef<str>>(
        field: impl Into<String>,
        value: &str,
        supported: &[S],
    ) -> Self {
        let list = supported
            .iter()
            .map(|s| quote(s.as_ref()))
            .collect::<Vec<_>>()
            .join(", ");
        Violation {
            kind: ViolationKind::NotSupported,
            field: field.into(),
            bad_value: Some(quote(value)),
            detail: format!("supported values: {list}"),
        }
    }

    /// `Unsupported value` with a free-form detail.
    pub fn not_supported_detail(
        field: impl Into<String>,
        value: &str,
        detail: impl Into<String>,
    ) -> Self {
        Violation {
            kind: ViolationKind::NotSupported,
            field: field.into(),
            bad_value: Some(quote(value)),
            detail: detail.into(),
        }
    }

    /// `Duplicate value` with a string value.
    pub fn duplicate(field: impl Into<String>, value: &str) -> Self {
        Violation {
            kind: ViolationKind::Duplicate,
            field: field.into(),
            bad_value: Some(quote(value)),
            detail: String::new(),
        }
    }

    /// The error body without the field (`Invalid value: "x": detail`), as
    /// `field.Error.ErrorBody()`; used in `status.details.causes[].message`.
    pub fn body(&self) -> String {
        let mut s = match (&self.kind, &self.bad_value) {
            (ViolationKind::Required | ViolationKind::Forbidden, _) | (_, None) => {
                self.kind.as_str().to_string()
            }
            (kind, Some(v)) => format!("{}: {v}", kind.as_str()),
        };
        if !self.detail.is_empty() {
            s.push_str(": ");
            s.push_str(&self.detail);
        }
        s
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.body())
    }
}

/// Renders a string value as Kubernetes does (`%q`): JSON string quoting.
pub fn quote(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| format!("\"{s}\""))
}

/// What rules may consult besides the object.
pub struct RuleContext<'a> {
    /// Namespace of the CacheBackend (request namespace, else `metadata.namespace`, else
    /// `default`).
    pub namespace: &'a str,
    /// The runtime-adapter registry (reserved args/env, supported pairs, bindings).
    pub registry: &'a Registry,
    /// CREATE or UPDATE.
    pub operation: Operation,
}

/// One validation rule. Rules are pure: they read the object and the context and return
/// violations; they never panic on any decodable object (a property test enforces it).
pub trait Rule: Send + Sync {
    /// Stable rule name, also the name of its table test (`rule_<name>`) and its entry in
    /// docs/admission.md.
    fn name(&self) -> &'static str;
    /// Violations of this rule on `cb`.
    fn check(&self, cb: &CacheBackend, ctx: &RuleContext) -> Vec<Violation>;
    /// Non-rejecting warnings of this rule on `cb` (default none).
    fn warnings(&self, _cb: &CacheBackend, _ctx: &RuleContext) -> Vec<String> {
        Vec::new()
    }
}

/// Result of validating one object.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outcome {
    /// Violations, in rule order, de-duplicated.
    pub violations: Vec<Violation>,
    /// Warnings, in rule order, de-duplicated.
    pub warnings: Vec<String>,
}

impl Outcome {
    /// True when nothing rejects.
    pub fn is_valid(&self) -> bool {
        self.violations.is_empty()
    }

    /// The violations at `field` (tests use it to assert exact field paths).
    pub fn at(&self, field: &str) -> Vec<&Violation> {
        self.violations
            .iter()
            .filter(|v| v.field == field)
            .collect()
    }

    /// The denial `metav1.Status` for these violations: code 422, reason `Invalid`, message
    /// `CacheBackend.inferencecache.io "name" is invalid: [a, b]`, one cause per violation —
    /// what the apiserver builds from `apierrors.NewInvalid`.
    pub fn to_status(&self, name: &str) -> Status {
        let errors: Vec<String> = self.violations.iter().map(|v| v.to_string()).collect();
        let joined = match errors.len() {
            1 => errors.concat(),
            _ => format!("[{}]", errors.join(", ")),
        };
        Status {
            status: "Failure".to_string(),
            code: 422,
            message: format!(
                "{}.{} {} is invalid: {joined}",
                KIND,
                ic_shared::crd::GROUP,
                quote(name)
            ),
            reason: Some("Invalid".to_string()),
            details: Some(StatusDetails {
                name: name.to_string(),
                group: ic_shared::crd::GROUP.to_string(),
                kind: KIND.to_string(),
                causes: self
                    .violations
                    .iter()
                    .map(|v| StatusCause {
                        reason: v.kind.cause_type().to_string(),
                        message: v.body(),
                        field: v.field.clone(),
                    })
                    .collect(),
            }),
        }
    }

    fn push_unique(&mut self, v: Violation, seen: &mut HashSet<Violation>) {
        if seen.insert(v.clone()) {
            self.violations.push(v);
        }
    }
}

const KIND: &str = "CacheBackend";

/// The ordered rule list and the pipeline around it.
pub struct Validator {
    rules: Vec<Box<dyn Rule>>,
}

impl Validator {
    /// Every built-in rule, in order: structural rules, then the resource rules, then the rules
    /// that consult the runtime-adapter registry.
    pub fn builtin() -> Self {
        let mut rules: Vec<Box<dyn Rule>> = Vec::new();
        rules.extend(hierarchy::rules());
        rules.extend(endpoint::rules());
        rules.extend(replicas::rules());
        rules.extend(integration::rules());
        rules.extend(hicache::rules());
        rules.extend(lmcache::rules());
        rules.extend(annotations::rules());
        rules.extend(events_only::rules());
        rules.extend(resources::rules());
        rules.extend(runtime::rules());
        Validator { rules }
    }

    /// A validator over exactly these rules (tests, extensions).
    pub fn with_rules(rules: Vec<Box<dyn Rule>>) -> Self {
        Validator { rules }
    }

    /// Appends a rule at the end of the list.
    pub fn push(&mut self, rule: Box<dyn Rule>) {
        self.rules.push(rule);
    }

    /// The rule named `name`, if registered.
    pub fn rule(&self, name: &str) -> Option<&dyn Rule> {
        self.rules
            .iter()
            .find(|r| r.name() == name)
            .map(|r| r.as_ref())
    }

    /// Rule names in order.
    pub fn rule_names(&self) -> Vec<&'static str> {
        self.rules.iter().map(|r| r.name()).collect()
    }

    /// Runs the rules on a decoded object.
    pub fn validate(&self, cb: &CacheBackend, ctx: &RuleContext) -> Outcome {
        let mut out = Outcome::default();
        let mut seen = HashSet::new();
        let mut seen_w = HashSet::new();
        for rule in &self.rules {
            for v in rule.check(cb, ctx) {
                out.push_unique(v, &mut seen);
            }
            for w in rule.warnings(cb, ctx) {
                if seen_w.insert(w.clone()) {
                    out.warnings.push(w);
                }
            }
        }
        out
    }

    /// The full pipeline on raw JSON (schema, decode, rules). Schema warnings (unknown fields)
    /// are included in the outcome's warnings.
    pub fn validate_value(&self, obj: &Value, ctx: &RuleContext) -> Outcome {
        let mut out = Outcome::default();
        let mut seen = HashSet::new();
        let schema_out = schema::check(obj);
        for v in schema_out.violations {
            out.push_unique(v, &mut seen);
        }
        out.warnings.extend(schema_out.warnings);
        match schema::decode(obj) {
            Ok(cb) => {
                let rules_out = self.validate(&cb, ctx);
                for v in rules_out.violations {
                    out.push_unique(v, &mut seen);
                }
                for w in rules_out.warnings {
                    if !out.warnings.contains(&w) {
                        out.warnings.push(w);
                    }
                }
            }
            Err(v) => {
                // A decode failure on a field the schema stage already reported adds nothing.
                if !out.violations.iter().any(|o| o.field == v.field) {
                    out.push_unique(v, &mut seen);
                }
            }
        }
        out
    }

    /// ValidateUpdate: the full pipeline on `new`, minus violations `old` already had
    /// (compared by kind, field, bad value and detail). Warnings are kept.
    pub fn validate_update(&self, new: &Value, old: &Value, ctx: &RuleContext) -> Outcome {
        let mut out = self.validate_value(new, ctx);
        let before: HashSet<Violation> = self
            .validate_value(old, ctx)
            .violations
            .into_iter()
            .collect();
        out.violations.retain(|v| !before.contains(v));
        out
    }
}

/// Namespace a CacheBackend lives in: the request's, else `metadata.namespace`, else `default`.
pub fn namespace_of<'a>(request_namespace: Option<&'a str>, obj: &'a Value) -> &'a str {
    request_namespace
        .filter(|s| !s.is_empty())
        .or_else(|| {
            obj.pointer("/metadata/namespace")
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
        })
        .unwrap_or("default")
}

/// Field-path helpers shared by the rules.
pub(crate) mod path {
    /// `spec.remoteStorage.<provider>` for a provider.
    pub fn provider_block(p: ic_shared::crd::RemoteProvider) -> &'static str {
        match p {
            ic_shared::crd::RemoteProvider::Redis => "spec.remoteStorage.redis",
            ic_shared::crd::RemoteProvider::LMCacheServer => "spec.remoteStorage.lmCacheServer",
            ic_shared::crd::RemoteProvider::Mooncake => "spec.remoteStorage.mooncake",
        }
    }

    /// Appends a map key the way Kubernetes field paths do (`limits[nvidia.com/gpu]`).
    pub fn key(base: &str, key: &str) -> String {
        format!("{base}[{key}]")
    }

    /// Appends a list index (`args[0]`).
    pub fn index(base: &str, i: usize) -> String {
        format!("{base}[{i}]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_like_kubernetes_field_errors() {
        let v = Violation::invalid(
            "spec.remoteStorage.endpoint",
            "x y",
            "must not contain whitespace",
        );
        assert_eq!(
            v.to_string(),
            r#"spec.remoteStorage.endpoint: Invalid value: "x y": must not contain whitespace"#
        );
        assert_eq!(
            Violation::required("spec.hiCache", "").to_string(),
            "spec.hiCache: Required value"
        );
        assert_eq!(
            Violation::forbidden("spec.autoscaling", "no workload").to_string(),
            "spec.autoscaling: Forbidden: no workload"
        );
        assert_eq!(
            Violation::not_supported("spec.type", "X", &["LMCache", "SGLangHiCache"]).to_string(),
            r#"spec.type: Unsupported value: "X": supported values: "LMCache", "SGLangHiCache""#
        );
        assert_eq!(
            Violation::invalid_num("spec.replicas", 3, "at most 1").to_string(),
            "spec.replicas: Invalid value: 3: at most 1"
        );
    }

    #[test]
    fn status_aggregates_causes() {
        let out = Outcome {
            violations: vec![
                Violation::required("spec.a", ""),
                Violation::invalid_num("spec.b", 2, "bad"),
            ],
            warnings: vec![],
        };
        let s = out.to_status("cb");
        assert_eq!(s.code, 422);
        assert_eq!(
            s.message,
            r#"CacheBackend.inferencecache.io "cb" is invalid: [spec.a: Required value, spec.b: Invalid value: 2: bad]"#
        );
        let causes = s.details.unwrap().causes;
        assert_eq!(causes[0].reason, "FieldValueRequired");
        assert_eq!(causes[1].field, "spec.b");
        assert_eq!(causes[1].message, "Invalid value: 2: bad");
    }
}
