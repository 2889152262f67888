//! The storage capability catalog (spec 004 "Capability catalog"; issue 8 deliverable 1).
//!
//! Release data, not runtime state: the chart ships it as a ConfigMap
//! (`chart/files/catalog.json` → ConfigMap [`DEFAULT_CONFIG_MAP`], key [`DEFAULT_KEY`]), the
//! packaged JSON Schema [`SCHEMA`] validates it, and [`Catalog::parse`] enforces the same rules
//! when the controller loads it:
//!
//! ```yaml
//! drivers:
//!   - name: nvmesh-csi.excelero.com        # exact StorageClass.provisioner
//!     provider: nvmesh                     # diagnostics only
//!     accessModes: [ReadWriteOnce, ReadOnlyMany]
//!     readerMountOptions: [ro, norecovery, nouuid]
//!     encryptionSupported: true
//!     volumeHandleNamespace: { separator: ":", segment: 3 }   # NVMesh 3.2: namespace last of 4
//!   - name: csi.weka.io
//!     provider: weka
//!     accessModes: []
//!     readerMountOptions: []
//! ```
//!
//! Rules (schema and loader alike, except where noted):
//!
//! - the document is `{drivers: [...]}` and nothing else; each entry has exactly the fields
//!   above (`name`, `provider`, `accessModes`, `readerMountOptions` required);
//! - `name` is a CSI driver name (1–63 characters, alphanumeric ends, `-` `.` inside);
//! - `accessModes` ⊆ {`ReadWriteOnce`, `ReadOnlyMany`, `ReadWriteMany`}, no repeats;
//!   `readerMountOptions` are non-empty, without commas or spaces, no repeats;
//! - `ReadWriteOnce` + `ReadOnlyMany` must list `ro` in `readerMountOptions`;
//! - `ReadOnlyMany` without a writer mode (`ReadWriteOnce` or `ReadWriteMany`) is rejected;
//! - driver names are unique — **loader only**: JSON Schema cannot express uniqueness by key.
//!
//! Flow derivation ([`derive_flow`]): `ReadWriteMany` → `rwxReadOnly`; `ReadWriteOnce` and
//! `ReadOnlyMany` → `roxReadOnly`; anything else → off. [`Catalog::decide`] adds the request's
//! constraints: readers in other namespaces need `rwxReadOnly` or a driver whose volume handle
//! encodes the namespace (`volumeHandleNamespace`, the spec's NVMesh rule as data); encryption
//! happens only when the `ModelCacheEncryption` flag asks for it, and then needs a driver that
//! lists `encryptionSupported` and the `roxReadOnly` shape (the only one that implements it).

use std::collections::BTreeMap;

use ic_shared::crd::{AccessMode, BindingDecision, Flow, VolumeHandleNamespace};
use k8s_openapi::api::core::v1::ConfigMap;
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The packaged JSON Schema (draft 2020-12) of the catalog document.
pub const SCHEMA: &str = include_str!("catalog.schema.json");

/// Default name of the catalog ConfigMap (in the controller's namespace).
pub const DEFAULT_CONFIG_MAP: &str = "inference-cache-storage-capabilities";

/// Default data key of the catalog in that ConfigMap.
pub const DEFAULT_KEY: &str = "catalog.json";

/// Longest CSI driver name (CSI spec: 63 characters).
pub const MAX_DRIVER_NAME: usize = 63;

/// One catalog entry: what a qualification run proved for one exact provisioner.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DriverEntry {
    /// Exact CSI provisioner (`StorageClass.provisioner`).
    pub name: String,
    /// Diagnostics label (`nvmesh`, `weka`); gates nothing.
    pub provider: String,
    /// Qualified access modes.
    pub access_modes: Vec<AccessMode>,
    /// mountOptions of every derived reader PV.
    pub reader_mount_options: Vec<String>,
    /// An encrypted cache has been qualified on this driver.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub encryption_supported: bool,
    /// The driver's volume handle encodes the consuming namespace at this segment.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "strict_handle"
    )]
    pub volume_handle_namespace: Option<VolumeHandleNamespace>,
}

/// `volumeHandleNamespace` as the catalog accepts it: exactly `separator` and `segment`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StrictHandle {
    separator: String,
    segment: u32,
}

/// An absent field is `None` (serde default); a present one must be an object — `null` is
/// rejected, as the schema's `"type": "object"` rejects it.
fn strict_handle<'de, D>(d: D) -> Result<Option<VolumeHandleNamespace>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    let h = StrictHandle::deserialize(d)?;
    Ok(Some(VolumeHandleNamespace {
        separator: h.separator,
        segment: h.segment,
    }))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Document {
    drivers: Vec<DriverEntry>,
}

/// One rule a catalog broke.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Where: `drivers[2].readerMountOptions`, or `$` for the document.
    pub path: String,
    /// What is wrong, as a sentence.
    pub message: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Why a catalog could not be loaded.
#[derive(Debug, Error)]
pub enum CatalogError {
    /// The ConfigMap has no data under the catalog key.
    #[error("ConfigMap {config_map} has no key {key}")]
    MissingKey {
        /// ConfigMap name.
        config_map: String,
        /// Data key.
        key: String,
    },
    /// The text is not YAML/JSON, or does not have the catalog's shape.
    #[error("catalog does not parse: {0}")]
    Parse(String),
    /// The catalog breaks one or more rules (every problem is listed).
    #[error("catalog is invalid: {}", problems.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("; "))]
    Invalid {
        /// Every rule broken, in document order.
        problems: Vec<Problem>,
    },
}

/// A loaded catalog: entries indexed by exact provisioner.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Catalog {
    drivers: BTreeMap<String, DriverEntry>,
}

/// What a request needs of the storage, beyond the provisioner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowRequest<'a> {
    /// Exact provisioner of the cache StorageClass.
    pub provisioner: &'a str,
    /// Readers run in namespaces other than the writer's (`helmModelCache`).
    pub cross_namespace: bool,
    /// The `ModelCacheEncryption` feature flag asks for an encrypted cache.
    pub encryption_requested: bool,
}

/// Why no durable flow could be derived (spec 004 "Runtime flow" 2: "No derivable flow: no
/// durable cache").
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum NoFlow {
    /// No entry names the provisioner.
    #[error("provisioner {0} has no entry in the storage capability catalog")]
    NotInCatalog(String),
    /// The entry's modes derive no flow (empty, or `ReadWriteOnce` alone).
    #[error("the catalog qualifies no cache flow for provisioner {provisioner} (access modes: [{modes}])")]
    NoQualifiedModes {
        /// Provisioner.
        provisioner: String,
        /// Its listed modes, comma-joined.
        modes: String,
    },
    /// Readers in other namespaces need `ReadWriteMany` or a namespace-encoding volume handle.
    #[error("readers in other namespaces need ReadWriteMany or a volume handle that encodes the namespace; provisioner {0} qualifies roxReadOnly without volumeHandleNamespace")]
    CrossNamespaceUnsupported(String),
    /// Encryption was asked for but the driver or flow does not support it.
    #[error(
        "ModelCacheEncryption asks for an encrypted cache, but provisioner {provisioner} {why}"
    )]
    EncryptionUnsupported {
        /// Provisioner.
        provisioner: String,
        /// `does not list encryptionSupported` or `derives rwxReadOnly, …`.
        why: String,
    },
}

impl NoFlow {
    /// The CamelCase condition reason (see `ic_shared::crd::model_cache_reason`).
    pub fn reason(&self) -> &'static str {
        use ic_shared::crd::model_cache_reason as r;
        match self {
            NoFlow::NotInCatalog(_) => r::PROVISIONER_NOT_IN_CATALOG,
            NoFlow::NoQualifiedModes { .. } => r::NO_QUALIFIED_MODES,
            NoFlow::CrossNamespaceUnsupported(_) => r::CROSS_NAMESPACE_UNSUPPORTED,
            NoFlow::EncryptionUnsupported { .. } => r::ENCRYPTION_UNSUPPORTED,
        }
    }
}

/// The flow a set of qualified modes derives: `ReadWriteMany` → `rwxReadOnly`;
/// `ReadWriteOnce` + `ReadOnlyMany` → `roxReadOnly`; otherwise `None` (off).
pub fn derive_flow(modes: &[AccessMode]) -> Option<Flow> {
    if modes.contains(&AccessMode::ReadWriteMany) {
        Some(Flow::RwxReadOnly)
    } else if modes.contains(&AccessMode::ReadWriteOnce)
        && modes.contains(&AccessMode::ReadOnlyMany)
    {
        Some(Flow::RoxReadOnly)
    } else {
        None
    }
}

/// The access modes a flow requires, writer mode first, reader mode last:
/// `rwxReadOnly` → `[ReadWriteMany]`; `roxReadOnly` → `[ReadWriteOnce, ReadOnlyMany]`.
pub fn required_modes(flow: Flow) -> Vec<AccessMode> {
    match flow {
        Flow::RwxReadOnly => vec![AccessMode::ReadWriteMany],
        Flow::RoxReadOnly => vec![AccessMode::ReadWriteOnce, AccessMode::ReadOnlyMany],
    }
}

/// Lower-case hex SHA-256 of `bytes` (64 characters).
pub fn sha256_hex(bytes: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    hex::encode(digest.as_ref())
}

/// SHA-256 of an entry's canonical JSON without its `provider` label: the catalog profile a
/// decision came from. `provider` is for diagnostics and gates nothing (spec 004), so a label
/// edit neither changes the profile nor counts as drift.
pub fn profile_digest(entry: &DriverEntry) -> String {
    let gating = DriverEntry {
        provider: String::new(),
        ..entry.clone()
    };
    sha256_hex(&serde_json::to_vec(&gating).unwrap_or_default())
}

fn valid_driver_name(name: &str) -> bool {
    let b = name.as_bytes();
    if b.is_empty() || b.len() > MAX_DRIVER_NAME {
        return false;
    }
    let alnum = |c: &u8| c.is_ascii_alphanumeric();
    alnum(&b[0]) && alnum(&b[b.len() - 1]) && b.iter().all(|c| alnum(c) || *c == b'-' || *c == b'.')
}

/// Checks one entry against every rule but uniqueness; problems get `path` as prefix.
pub fn check_entry(entry: &DriverEntry, path: &str) -> Vec<Problem> {
    let mut out = Vec::new();
    let mut problem = |field: &str, message: String| {
        out.push(Problem {
            path: if field.is_empty() {
                path.to_string()
            } else {
                format!("{path}.{field}")
            },
            message,
        })
    };
    if !valid_driver_name(&entry.name) {
        problem(
            "name",
            format!(
                "{:?} is not a CSI driver name (1-63 characters, alphanumeric at both ends, '-' and '.' between)",
                entry.name
            ),
        );
    }
    if entry.provider.is_empty() {
        problem("provider", "must not be empty".to_string());
    }
    for (i, m) in entry.access_modes.iter().enumerate() {
        if *m == AccessMode::ReadWriteOncePod {
            problem(
                &format!("accessModes[{i}]"),
                "ReadWriteOncePod is not a cache access mode".to_string(),
            );
        }
        if entry.access_modes[..i].contains(m) {
            problem(
                &format!("accessModes[{i}]"),
                format!("{} is listed twice", m.as_str()),
            );
        }
    }
    for (i, o) in entry.reader_mount_options.iter().enumerate() {
        if o.is_empty() || o.contains(',') || o.chars().any(char::is_whitespace) {
            problem(
                &format!("readerMountOptions[{i}]"),
                format!("{o:?} is not one mount option (non-empty, no commas or spaces)"),
            );
        }
        if entry.reader_mount_options[..i].contains(o) {
            problem(
                &format!("readerMountOptions[{i}]"),
                format!("{o:?} is listed twice"),
            );
        }
    }
    if let Some(rule) = &entry.volume_handle_namespace {
        if rule.separator.is_empty() {
            problem(
                "volumeHandleNamespace.separator",
                "must not be empty".to_string(),
            );
        }
    }
    let has = |m: AccessMode| entry.access_modes.contains(&m);
    if has(AccessMode::ReadWriteOnce)
        && has(AccessMode::ReadOnlyMany)
        && !entry.reader_mount_options.iter().any(|o| o == "ro")
    {
        problem(
            "readerMountOptions",
            "the ReadWriteOnce plus ReadOnlyMany shape must list `ro`: reader PVs are mounted read-only".to_string(),
        );
    }
    if has(AccessMode::ReadOnlyMany)
        && !has(AccessMode::ReadWriteOnce)
        && !has(AccessMode::ReadWriteMany)
    {
        problem(
            "accessModes",
            "ReadOnlyMany without a writer mode (ReadWriteOnce or ReadWriteMany): nothing would populate the cache".to_string(),
        );
    }
    out
}

impl Catalog {
    /// Parses and validates a catalog document (YAML or JSON).
    ///
    /// Errors: [`CatalogError::Parse`] when the text is not YAML or lacks the catalog's shape
    /// (unknown or missing fields, wrong types, an unknown access mode); [`CatalogError::Invalid`]
    /// listing every broken rule otherwise (duplicates included).
    pub fn parse(text: &str) -> Result<Catalog, CatalogError> {
        let value: serde_json::Value =
            serde_yaml::from_str(text).map_err(|e| CatalogError::Parse(e.to_string()))?;
        Self::from_value(&value)
    }

    /// Validates an already-parsed document (same rules and errors as [`Catalog::parse`]).
    pub fn from_value(value: &serde_json::Value) -> Result<Catalog, CatalogError> {
        let doc: Document = serde_path_to_error::deserialize(value)
            .map_err(|e| CatalogError::Parse(format!("{}: {}", e.path(), e.inner())))?;
        let mut problems = Vec::new();
        let mut drivers = BTreeMap::new();
        for (i, entry) in doc.drivers.into_iter().enumerate() {
            let path = format!("drivers[{i}]");
            problems.extend(check_entry(&entry, &path));
            if drivers.contains_key(&entry.name) {
                problems.push(Problem {
                    path: format!("{path}.name"),
                    message: format!(
                        "provisioner {} is listed twice; each provisioner has one entry",
                        entry.name
                    ),
                });
            } else {
                drivers.insert(entry.name.clone(), entry);
            }
        }
        if problems.is_empty() {
            Ok(Catalog { drivers })
        } else {
            Err(CatalogError::Invalid { problems })
        }
    }

    /// Loads the catalog from `key` of a ConfigMap (`data`, else UTF-8 `binaryData`).
    pub fn from_config_map(cm: &ConfigMap, key: &str) -> Result<Catalog, CatalogError> {
        let text = cm
            .data
            .as_ref()
            .and_then(|d| d.get(key).cloned())
            .or_else(|| {
                cm.binary_data
                    .as_ref()
                    .and_then(|d| d.get(key))
                    .and_then(|b| String::from_utf8(b.0.clone()).ok())
            })
            .ok_or_else(|| CatalogError::MissingKey {
                config_map: cm.metadata.name.clone().unwrap_or_default(),
                key: key.to_string(),
            })?;
        Self::parse(&text)
    }

    /// The entry for an exact provisioner.
    pub fn driver(&self, provisioner: &str) -> Option<&DriverEntry> {
        self.drivers.get(provisioner)
    }

    /// Every entry, by provisioner.
    pub fn drivers(&self) -> impl Iterator<Item = &DriverEntry> {
        self.drivers.values()
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.drivers.len()
    }

    /// True without entries.
    pub fn is_empty(&self) -> bool {
        self.drivers.is_empty()
    }

    /// The storage decision for a request: the entry for `req.provisioner`, its derived flow, the
    /// cross-namespace and encryption rules. The result is what a new binding records in
    /// `spec.decision` (never re-read afterwards).
    pub fn decide(&self, req: &FlowRequest<'_>) -> Result<BindingDecision, NoFlow> {
        let entry = self
            .driver(req.provisioner)
            .ok_or_else(|| NoFlow::NotInCatalog(req.provisioner.to_string()))?;
        let flow = derive_flow(&entry.access_modes).ok_or_else(|| NoFlow::NoQualifiedModes {
            provisioner: entry.name.clone(),
            modes: entry
                .access_modes
                .iter()
                .map(|m| m.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        })?;
        if req.cross_namespace
            && flow == Flow::RoxReadOnly
            && entry.volume_handle_namespace.is_none()
        {
            return Err(NoFlow::CrossNamespaceUnsupported(entry.name.clone()));
        }
        if req.encryption_requested {
            if !entry.encryption_supported {
                return Err(NoFlow::EncryptionUnsupported {
                    provisioner: entry.name.clone(),
                    why: "does not list encryptionSupported".to_string(),
                });
            }
            if flow != Flow::RoxReadOnly {
                return Err(NoFlow::EncryptionUnsupported {
                    provisioner: entry.name.clone(),
                    why: format!(
                        "derives {}; only the roxReadOnly shape implements encryption",
                        flow.as_str()
                    ),
                });
            }
        }
        Ok(BindingDecision {
            provider: entry.provider.clone(),
            provisioner: entry.name.clone(),
            flow,
            access_modes: required_modes(flow),
            reader_mount_options: entry.reader_mount_options.clone(),
            volume_handle_namespace: entry.volume_handle_namespace.clone(),
            encrypted: req.encryption_requested,
            catalog_profile_digest: profile_digest(entry),
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    const SPEC_EXAMPLE: &str = r#"
drivers:
  - name: nvmesh-csi.excelero.com
    provider: nvmesh
    accessModes: [ReadWriteOnce, ReadOnlyMany]
    readerMountOptions: [ro, norecovery, nouuid]
    encryptionSupported: true
  - name: csi.weka.io
    provider: weka
    accessModes: []
    readerMountOptions: []
"#;

    fn req(p: &str) -> FlowRequest<'_> {
        FlowRequest {
            provisioner: p,
            cross_namespace: false,
            encryption_requested: false,
        }
    }

    #[test]
    fn the_spec_example_loads_and_derives() {
        let c = Catalog::parse(SPEC_EXAMPLE).unwrap();
        assert_eq!(c.len(), 2);
        let d = c.decide(&req("nvmesh-csi.excelero.com")).unwrap();
        assert_eq!(d.flow, Flow::RoxReadOnly);
        assert_eq!(
            d.access_modes,
            vec![AccessMode::ReadWriteOnce, AccessMode::ReadOnlyMany]
        );
        assert_eq!(d.reader_mount_options, vec!["ro", "norecovery", "nouuid"]);
        assert_eq!(d.catalog_profile_digest.len(), 64);
        assert!(matches!(
            c.decide(&req("csi.weka.io")),
            Err(NoFlow::NoQualifiedModes { .. })
        ));
        assert_eq!(
            c.decide(&req("ebs.csi.aws.com")).unwrap_err().reason(),
            "ProvisionerNotInCatalog"
        );
    }

    #[test]
    fn flow_table() {
        use AccessMode::*;
        assert_eq!(derive_flow(&[ReadWriteMany]), Some(Flow::RwxReadOnly));
        assert_eq!(
            derive_flow(&[ReadWriteOnce, ReadOnlyMany, ReadWriteMany]),
            Some(Flow::RwxReadOnly)
        );
        assert_eq!(
            derive_flow(&[ReadOnlyMany, ReadWriteOnce]),
            Some(Flow::RoxReadOnly)
        );
        assert_eq!(derive_flow(&[ReadWriteOnce]), None);
        assert_eq!(derive_flow(&[]), None);
    }

    #[test]
    fn cross_namespace_and_encryption_rules() {
        let c = Catalog::parse(SPEC_EXAMPLE).unwrap();
        let mut r = req("nvmesh-csi.excelero.com");
        r.cross_namespace = true;
        assert!(matches!(
            c.decide(&r),
            Err(NoFlow::CrossNamespaceUnsupported(_))
        ));
        let with_rule = Catalog::parse(
            r#"{"drivers":[{"name":"nvmesh-csi.excelero.com","provider":"nvmesh","accessModes":["ReadWriteOnce","ReadOnlyMany"],"readerMountOptions":["ro"],"encryptionSupported":true,"volumeHandleNamespace":{"separator":"/","segment":1}}]}"#,
        )
        .unwrap();
        r.encryption_requested = true;
        let d = with_rule.decide(&r).unwrap();
        assert!(d.encrypted);
        assert_eq!(d.volume_handle_namespace.unwrap().segment, 1);
        let rwx = Catalog::parse(
            r#"{"drivers":[{"name":"fss.csi.oraclecloud.com","provider":"oci-fss","accessModes":["ReadWriteMany"],"readerMountOptions":[],"encryptionSupported":true}]}"#,
        )
        .unwrap();
        let mut r = req("fss.csi.oraclecloud.com");
        r.cross_namespace = true;
        assert_eq!(rwx.decide(&r).unwrap().flow, Flow::RwxReadOnly);
        r.encryption_requested = true;
        assert_eq!(
            rwx.decide(&r).unwrap_err().reason(),
            "EncryptionUnsupported"
        );
        let mut r = req("csi.weka.io");
        r.encryption_requested = true;
        let weka = Catalog::parse(
            r#"{"drivers":[{"name":"csi.weka.io","provider":"weka","accessModes":["ReadWriteOnce","ReadOnlyMany"],"readerMountOptions":["ro"]}]}"#,
        )
        .unwrap();
        assert!(matches!(
            weka.decide(&r),
            Err(NoFlow::EncryptionUnsupported { .. })
        ));
    }

    #[test]
    fn every_problem_is_listed_with_its_path() {
        let err = Catalog::parse(
            r#"{"drivers":[
              {"name":"a.b","provider":"x","accessModes":["ReadWriteOnce","ReadOnlyMany"],"readerMountOptions":[]},
              {"name":"a.b","provider":"","accessModes":["ReadOnlyMany"],"readerMountOptions":["ro,nouuid"]}
            ]}"#,
        )
        .unwrap_err();
        let CatalogError::Invalid { problems } = err else {
            panic!("not Invalid")
        };
        let paths: Vec<&str> = problems.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            vec![
                "drivers[0].readerMountOptions",
                "drivers[1].provider",
                "drivers[1].readerMountOptions[0]",
                "drivers[1].accessModes",
                "drivers[1].name",
            ]
        );
    }

    #[test]
    fn shape_errors_name_the_field() {
        let err = Catalog::parse(r#"{"drivers":[{"name":"a","provider":"p","accessModes":[],"readerMountOptions":[],"flow":"rwx"}]}"#).unwrap_err();
        assert!(err.to_string().contains("flow"), "{err}");
        assert!(matches!(
            Catalog::parse("drivers: 3"),
            Err(CatalogError::Parse(_))
        ));
    }
}
