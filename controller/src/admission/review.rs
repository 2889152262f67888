//! `admission.k8s.io/v1` AdmissionReview wire types, our own (DESIGN.md "Data flows" 1; TESTING.md
//! "Admission wire format").
//!
//! The response serializes exactly as kube-apiserver accepts it:
//!
//! ```json
//! {"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview",
//!  "response":{"uid":"<request.uid>","allowed":true,
//!              "patch":"W3sib3AiOi…","patchType":"JSONPatch","warnings":["…"]}}
//! ```
//!
//! - `uid` echoes `request.uid`;
//! - `patch` is a **base64 string** of a JSON Patch document (RFC 6902), never a JSON array of
//!   byte values (kube-core's `AdmissionResponse` does the latter, kube-rs/kube#1781);
//! - `patchType: "JSONPatch"` appears only together with a patch (the apiserver rejects a
//!   `patchType` without a patch), and an empty patch (`[]`) is sent as no patch at all;
//! - `status` is a `metav1.Status` (`code`, `message`, `reason`, `details.causes[]`) for denials;
//! - `warnings` is a list of plain strings, omitted when empty.

use std::collections::BTreeMap;

use base64::Engine as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

/// `apiVersion` of every review we read and write.
pub const API_VERSION: &str = "admission.k8s.io/v1";
/// `kind` of every review we read and write.
pub const KIND: &str = "AdmissionReview";
/// The only patch type the apiserver accepts.
pub const PATCH_TYPE_JSON_PATCH: &str = "JSONPatch";

/// An `admission.k8s.io/v1` AdmissionReview: a request from the apiserver, or our response.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AdmissionReview {
    /// Always `admission.k8s.io/v1` on what we send.
    #[serde(default)]
    pub api_version: String,
    /// Always `AdmissionReview`.
    #[serde(default)]
    pub kind: String,
    /// The apiserver's request (absent on responses).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<AdmissionRequest>,
    /// Our response (absent on requests).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response: Option<AdmissionResponse>,
}

impl AdmissionReview {
    /// A review carrying a request (what the apiserver sends; `ic-controller admit` builds one in
    /// memory).
    pub fn from_request(request: AdmissionRequest) -> Self {
        AdmissionReview {
            api_version: API_VERSION.to_string(),
            kind: KIND.to_string(),
            request: Some(request),
            response: None,
        }
    }

    /// A review carrying only a response, as the apiserver expects back.
    pub fn from_response(response: AdmissionResponse) -> Self {
        AdmissionReview {
            api_version: API_VERSION.to_string(),
            kind: KIND.to_string(),
            request: None,
            response: Some(response),
        }
    }
}

/// `metav1.GroupVersionKind`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupVersionKind {
    /// API group (empty for the core group).
    #[serde(default)]
    pub group: String,
    /// API version.
    #[serde(default)]
    pub version: String,
    /// Kind.
    #[serde(default)]
    pub kind: String,
}

/// `metav1.GroupVersionResource`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupVersionResource {
    /// API group (empty for the core group).
    #[serde(default)]
    pub group: String,
    /// API version.
    #[serde(default)]
    pub version: String,
    /// Plural resource name.
    #[serde(default)]
    pub resource: String,
}

/// `request.operation`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Operation {
    /// CREATE.
    #[default]
    #[serde(rename = "CREATE")]
    Create,
    /// UPDATE.
    #[serde(rename = "UPDATE")]
    Update,
    /// DELETE.
    #[serde(rename = "DELETE")]
    Delete,
    /// CONNECT.
    #[serde(rename = "CONNECT")]
    Connect,
}

impl Operation {
    /// The wire spelling (`CREATE`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Create => "CREATE",
            Operation::Update => "UPDATE",
            Operation::Delete => "DELETE",
            Operation::Connect => "CONNECT",
        }
    }
}

/// `authenticationv1.UserInfo` of the requester.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct UserInfo {
    /// User name.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub username: String,
    /// User uid.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub uid: String,
    /// Groups.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<String>,
    /// Extra attributes.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub extra: BTreeMap<String, Vec<String>>,
}

/// `admissionv1.AdmissionRequest`. Objects stay raw JSON: defaulting diffs the object it was
/// given, and the Pod webhook reads pods as they were written.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AdmissionRequest {
    /// Identifier to echo in `response.uid`.
    pub uid: String,
    /// Kind of the object as sent.
    #[serde(default)]
    pub kind: GroupVersionKind,
    /// Resource being requested.
    #[serde(default)]
    pub resource: GroupVersionResource,
    /// Subresource (`status`, …), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sub_resource: Option<String>,
    /// Kind of the original request when it was converted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_kind: Option<GroupVersionKind>,
    /// Resource of the original request when it was converted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_resource: Option<GroupVersionResource>,
    /// Subresource of the original request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_sub_resource: Option<String>,
    /// Object name (may be empty on CREATE with `generateName`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Object namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// CREATE, UPDATE, DELETE or CONNECT.
    #[serde(default)]
    pub operation: Operation,
    /// Requesting user.
    #[serde(default)]
    pub user_info: UserInfo,
    /// The new object (CREATE, UPDATE).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object: Option<Value>,
    /// The existing object (UPDATE, DELETE).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old_object: Option<Value>,
    /// Whether the request is a dry run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dry_run: Option<bool>,
    /// The operation's options (`CreateOptions`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub options: Option<Value>,
}

/// `metav1.StatusCause`: one field-scoped reason of a denial.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct StatusCause {
    /// Machine-readable cause (`FieldValueInvalid`, `FieldValueRequired`, …).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// Human-readable description (the field error's body).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// Field path (`spec.remoteStorage.endpoint`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub field: String,
}

/// `metav1.StatusDetails`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct StatusDetails {
    /// Object name.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// API group.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub group: String,
    /// Kind.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub kind: String,
    /// Field-scoped causes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub causes: Vec<StatusCause>,
}

/// `metav1.Status` as carried in `response.status`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct Status {
    /// `Success` or `Failure`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub status: String,
    /// HTTP-like code (`422` for invalid objects, `400` for undecodable requests, `200` on allow).
    #[serde(default)]
    pub code: u16,
    /// Human-readable message; kubectl prints it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// Machine-readable reason (`Invalid`, `BadRequest`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Field-scoped causes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub details: Option<StatusDetails>,
}

/// `admissionv1.AdmissionResponse`.
///
/// Build it with [`AdmissionResponse::allow`] / [`AdmissionResponse::deny`] and
/// [`AdmissionResponse::with_patch`]: the patch is held as the JSON Patch document's bytes and
/// serialized as base64 with `patchType: JSONPatch`; without a patch neither key is written.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AdmissionResponse {
    /// Echo of `request.uid`.
    pub uid: String,
    /// Whether the request is admitted.
    pub allowed: bool,
    /// Result detail: the denial (code, message, causes) or an informational allow message.
    pub status: Option<Status>,
    /// JSON Patch document bytes (`[{"op":…}]`); `None` = no patch.
    patch: Option<Vec<u8>>,
    /// Warnings shown to the client (kubectl prints `Warning: …`).
    pub warnings: Vec<String>,
    /// Audit annotations (keys are prefixed with the webhook name by the apiserver).
    pub audit_annotations: BTreeMap<String, String>,
}

impl AdmissionResponse {
    /// Allows the request with no patch.
    pub fn allow(uid: impl Into<String>) -> Self {
        AdmissionResponse {
            uid: uid.into(),
            allowed: true,
            ..Default::default()
        }
    }

    /// Allows with an informational message in `status` (code 200), as controller-runtime's
    /// `Allowed(reason)` does; the Pod webhook uses it to say why a pod was (not) wired.
    pub fn allow_with_message(uid: impl Into<String>, message: impl Into<String>) -> Self {
        let message = message.into();
        let mut r = AdmissionResponse::allow(uid);
        if !message.is_empty() {
            r.status = Some(Status {
                code: 200,
                message,
                ..Default::default()
            });
        }
        r
    }

    /// Denies with the given status (its `status` string is forced to `Failure`).
    pub fn deny(uid: impl Into<String>, mut status: Status) -> Self {
        status.status = "Failure".to_string();
        AdmissionResponse {
            uid: uid.into(),
            allowed: false,
            status: Some(status),
            ..Default::default()
        }
    }

    /// Denies a request that could not be decoded (code 400, reason `BadRequest`).
    pub fn bad_request(uid: impl Into<String>, message: impl Into<String>) -> Self {
        AdmissionResponse::deny(
            uid,
            Status {
                code: 400,
                message: message.into(),
                reason: Some("BadRequest".to_string()),
                ..Default::default()
            },
        )
    }

    /// Attaches a JSON Patch given as its operations (`json_patch::PatchOperation` or JSON
    /// values). An empty operation list means "no patch" (no `patch`, no `patchType`). Fails only
    /// if the operations cannot be serialized.
    pub fn with_patch<T: Serialize>(mut self, ops: &[T]) -> Result<Self, serde_json::Error> {
        self.patch = if ops.is_empty() {
            None
        } else {
            Some(serde_json::to_vec(ops)?)
        };
        Ok(self)
    }

    /// Appends warnings.
    pub fn with_warnings(mut self, warnings: impl IntoIterator<Item = String>) -> Self {
        self.warnings.extend(warnings);
        self
    }

    /// The JSON Patch document bytes, if any.
    pub fn patch_bytes(&self) -> Option<&[u8]> {
        self.patch.as_deref()
    }

    /// The patch decoded into operations (`Ok(vec![])` without a patch).
    pub fn patch_operations(&self) -> Result<Vec<json_patch::PatchOperation>, serde_json::Error> {
        match &self.patch {
            Some(bytes) => serde_json::from_slice(bytes),
            None => Ok(Vec::new()),
        }
    }
}

/// The exact wire shape of a response (decoding).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireResponse {
    uid: String,
    allowed: bool,
    #[serde(default)]
    status: Option<Status>,
    #[serde(default)]
    patch: Option<String>,
    #[serde(default)]
    patch_type: Option<String>,
    #[serde(default)]
    warnings: Vec<String>,
    #[serde(default)]
    audit_annotations: BTreeMap<String, String>,
}

/// The wire shape, borrowed, for serializing without copies.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct WireResponseRef<'a> {
    uid: &'a str,
    allowed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<&'a Status>,
    #[serde(skip_serializing_if = "Option::is_none")]
    patch: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    patch_type: Option<&'static str>,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    warnings: &'a [String],
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    audit_annotations: &'a BTreeMap<String, String>,
}

impl Serialize for AdmissionResponse {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let patch = self
            .patch
            .as_ref()
            .map(|p| base64::engine::general_purpose::STANDARD.encode(p));
        let patch_type = patch.as_ref().map(|_| PATCH_TYPE_JSON_PATCH);
        WireResponseRef {
            uid: &self.uid,
            allowed: self.allowed,
            status: self.status.as_ref(),
            patch,
            patch_type,
            warnings: &self.warnings,
            audit_annotations: &self.audit_annotations,
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for AdmissionResponse {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let wire = WireResponse::deserialize(deserializer)?;
        match (&wire.patch, wire.patch_type.as_deref()) {
            (Some(_), Some(PATCH_TYPE_JSON_PATCH)) | (None, None) => {}
            (None, Some(_)) => {
                return Err(serde::de::Error::custom("patchType without patch"));
            }
            (Some(_), other) => {
                return Err(serde::de::Error::custom(format!(
                    "patch with patchType {other:?}, not \"JSONPatch\""
                )));
            }
        }
        let patch = match wire.patch {
            Some(b64) => Some(
                base64::engine::general_purpose::STANDARD
                    .decode(b64.as_bytes())
                    .map_err(serde::de::Error::custom)?,
            ),
            None => None,
        };
        Ok(AdmissionResponse {
            uid: wire.uid,
            allowed: wire.allowed,
            status: wire.status,
            patch,
            warnings: wire.warnings,
            audit_annotations: wire.audit_annotations,
        })
    }
}

/// Best-effort `request.uid` of a body that did not decode as an AdmissionReview, so that even a
/// malformed review gets an answer the apiserver can match: the body is read as a stream and
/// the uid kept as soon as it is seen, so a review that breaks (bad JSON, nesting past
/// serde_json's limit, a truncated body) after `request.uid` — where the apiserver writes it,
/// first — still yields it. Empty when no uid precedes the damage.
pub fn uid_of_raw(body: &[u8]) -> String {
    let mut uid = None;
    let mut de = serde_json::Deserializer::from_slice(body);
    let _ = serde::de::DeserializeSeed::deserialize(UidSeed::Review(&mut uid), &mut de);
    uid.unwrap_or_default()
}

/// Walks `{"request": {"uid": …}}`, ignoring everything else, storing the uid when found.
enum UidSeed<'a> {
    Review(&'a mut Option<String>),
    Request(&'a mut Option<String>),
}

impl<'de> serde::de::DeserializeSeed<'de> for UidSeed<'_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> serde::de::Visitor<'de> for UidSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an AdmissionReview object")
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        use serde::de::IgnoredAny;
        match self {
            UidSeed::Review(uid) => {
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    if key == "request" {
                        map.next_value_seed(UidSeed::Request(&mut *uid))?;
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
            }
            UidSeed::Request(uid) => {
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    if key == "uid" {
                        *uid = Some(map.next_value::<String>()?);
                        // The rest need not decode: the uid is all we want.
                        return Ok(());
                    }
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn add_op() -> json_patch::PatchOperation {
        serde_json::from_value(json!({"op": "add", "path": "/spec/x", "value": 1})).unwrap()
    }

    #[test]
    fn the_uid_of_a_review_that_breaks_after_it_is_still_read() {
        let deep = format!(
            r#"{{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{{"uid":"u-7","object":{}{}}}}}"#,
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        assert!(serde_json::from_str::<Value>(&deep).is_err());
        assert_eq!(uid_of_raw(deep.as_bytes()), "u-7");
        let truncated = br#"{"request":{"uid":"u-8","kind":{"group":"","#;
        assert_eq!(uid_of_raw(truncated), "u-8");
        let garbage = br#"{"request":{"kind":"#;
        assert_eq!(uid_of_raw(garbage), "");
        assert_eq!(uid_of_raw(b"\xff\x00"), "");
    }

    #[test]
    fn patch_is_a_base64_string_with_patch_type() {
        let r = AdmissionResponse::allow("u-1")
            .with_patch(&[add_op()])
            .unwrap();
        let text = serde_json::to_string(&AdmissionReview::from_response(r)).unwrap();
        assert!(text.contains(r#""patch":"W3si"#), "{text}");
        assert!(text.contains(r#""patchType":"JSONPatch""#), "{text}");
        assert!(text.contains(r#""uid":"u-1""#), "{text}");
        assert!(!text.contains(r#""patch":["#), "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        let b64 = v["response"]["patch"].as_str().unwrap();
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap();
        assert_eq!(
            serde_json::from_slice::<Value>(&decoded).unwrap(),
            json!([{"op": "add", "path": "/spec/x", "value": 1}])
        );
    }

    #[test]
    fn no_patch_type_without_patch_and_empty_patch_is_no_patch() {
        for r in [
            AdmissionResponse::allow("u"),
            AdmissionResponse::allow("u")
                .with_patch::<Value>(&[])
                .unwrap(),
        ] {
            let text = serde_json::to_string(&r).unwrap();
            assert_eq!(text, r#"{"uid":"u","allowed":true}"#);
        }
    }

    #[test]
    fn response_round_trips() {
        let r = AdmissionResponse::deny(
            "u",
            Status {
                code: 422,
                message: "m".into(),
                reason: Some("Invalid".into()),
                details: Some(StatusDetails {
                    causes: vec![StatusCause {
                        reason: "FieldValueInvalid".into(),
                        message: "Invalid value: \"x\"".into(),
                        field: "spec.a".into(),
                    }],
                    ..Default::default()
                }),
                ..Default::default()
            },
        )
        .with_warnings(["w".to_string()]);
        let text = serde_json::to_string(&r).unwrap();
        assert!(text.contains(r#""warnings":["w"]"#));
        assert!(text.contains(r#""status":"Failure""#));
        let back: AdmissionResponse = serde_json::from_str(&text).unwrap();
        assert_eq!(back, r);
        let p = AdmissionResponse::allow("u")
            .with_patch(&[add_op()])
            .unwrap();
        let back: AdmissionResponse =
            serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back.patch_operations().unwrap(), vec![add_op()]);
    }

    #[test]
    fn decoding_refuses_patch_type_without_patch() {
        assert!(serde_json::from_str::<AdmissionResponse>(
            r#"{"uid":"u","allowed":true,"patchType":"JSONPatch"}"#
        )
        .is_err());
        assert!(serde_json::from_str::<AdmissionResponse>(
            r#"{"uid":"u","allowed":true,"patch":"W10="}"#
        )
        .is_err());
    }

    #[test]
    fn request_decodes_apiserver_json() {
        let review: AdmissionReview = serde_json::from_value(json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
                "requestResource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": "ml",
                "operation": "CREATE",
                "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller",
                             "uid": "1", "groups": ["system:serviceaccounts"]},
                "object": {"apiVersion": "v1", "kind": "Pod"},
                "oldObject": null,
                "dryRun": false,
                "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}
            }
        }))
        .unwrap();
        let req = review.request.unwrap();
        assert_eq!(req.operation, Operation::Create);
        assert_eq!(req.namespace.as_deref(), Some("ml"));
        assert!(req.old_object.is_none());
        assert_eq!(req.kind.kind, "Pod");
    }

    #[test]
    fn uid_of_raw_is_best_effort() {
        assert_eq!(uid_of_raw(br#"{"request":{"uid":"abc"}}"#), "abc");
        assert_eq!(uid_of_raw(b"not json"), "");
    }
}
