//! `ic-controller upgrade-crds`: the chart's pre-upgrade hook that brings the cluster's
//! CustomResourceDefinitions to the ones this binary serves.
//!
//! Helm installs `crds/` on the first install only and never upgrades or deletes them, so a
//! `helm upgrade` alone leaves the old schemas in place: new fields are pruned by the API server
//! on every write and new CRDs (e.g. one added in a later release) never appear. The hook runs
//! the new image before Helm touches the release's templates and server-side applies every CRD of
//! [`crdgen::all_crds`](crate::crdgen::all_crds) — the same objects `chart/crds/` holds (a test
//! fails on drift) — with the field manager [`FIELD_MANAGER`], forcing ownership away from
//! whoever applied them before (Helm's install, `kubectl apply`).
//!
//! The chart runs it with `--crds-dir`: the CRDs then come from the chart's own `crds/` (a hook
//! ConfigMap mounted into the Job, read by [`load_dir`]), not from the image, so that a release
//! pinned to an older `controller.image.tag` still upgrades the CRDs to its chart's.
//!
//! It refuses, before writing anything, when an upgrade would make stored objects unreadable:
//! a version in a CRD's `status.storedVersions` that the new CRD no longer serves (a downgrade
//! across a version removal, or a removal without a storage migration). Exit 1 then names the
//! CRD and the version; Helm stops the upgrade and nothing was changed.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};

/// Field manager of the hook's server-side apply.
pub const FIELD_MANAGER: &str = "inference-cache-crd-upgrade";

/// What the hook does to one CRD.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrdAction {
    /// Not in the cluster: created.
    Create,
    /// In the cluster: applied (schemas, versions, printer columns replaced by this release's).
    Update,
}

/// Why the upgrade stops.
#[derive(Debug, thiserror::Error)]
pub enum CrdUpgradeError {
    /// A stored version would no longer be served.
    #[error(
        "CRD {crd}: objects are stored as {version}, which this release no longer serves \
         (served: {served}); migrate them to a served version first (kubectl get {crd} -A -o yaml | \
         kubectl replace -f -, then remove {version} from status.storedVersions), or install the \
         release that serves it"
    )]
    StoredVersionNotServed {
        /// CRD name (`<plural>.<group>`).
        crd: String,
        /// The stored version.
        version: String,
        /// The versions the new CRD serves, comma-separated.
        served: String,
    },
    /// A file of `--crds-dir` could not be read or is not one CustomResourceDefinition.
    #[error("{path}: {reason}")]
    File {
        /// The file.
        path: String,
        /// What was wrong.
        reason: String,
    },
    /// Reading or applying failed.
    #[error("CRD {crd}: {source}")]
    Api {
        /// CRD name.
        crd: String,
        /// The API error (boxed: `kube::Error` is large).
        source: Box<kube::Error>,
    },
}

/// The CustomResourceDefinitions in `dir`: every `*.yaml` file (sorted by name), one CRD each (the
/// layout of the chart's `crds/`). Hidden files (a mounted ConfigMap's `..data` links) are
/// skipped.
///
/// Errors: [`CrdUpgradeError::File`] naming the file that cannot be read, does not parse as a
/// CustomResourceDefinition, or when `dir` holds none.
pub fn load_dir(dir: &std::path::Path) -> Result<Vec<CustomResourceDefinition>, CrdUpgradeError> {
    let file_err = |path: &std::path::Path, reason: String| CrdUpgradeError::File {
        path: path.display().to_string(),
        reason,
    };
    let mut paths: Vec<std::path::PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| file_err(dir, e.to_string()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            !name.starts_with('.') && name.ends_with(".yaml")
        })
        .collect();
    paths.sort();
    if paths.is_empty() {
        return Err(file_err(
            dir,
            "no *.yaml CustomResourceDefinition here".into(),
        ));
    }
    paths
        .iter()
        .map(|p| {
            let text = std::fs::read_to_string(p).map_err(|e| file_err(p, e.to_string()))?;
            let crd: CustomResourceDefinition = serde_yaml::from_str(&text)
                .map_err(|e| file_err(p, format!("not a CustomResourceDefinition: {e}")))?;
            Ok(crd)
        })
        .collect()
}

/// Decides the action for one CRD from what the cluster has (`current`, `None` when absent).
///
/// Errors: [`CrdUpgradeError::StoredVersionNotServed`] when a version in
/// `current.status.storedVersions` is not served by `desired`.
pub fn plan(
    current: Option<&CustomResourceDefinition>,
    desired: &CustomResourceDefinition,
) -> Result<CrdAction, CrdUpgradeError> {
    let Some(current) = current else {
        return Ok(CrdAction::Create);
    };
    let served: Vec<&str> = desired
        .spec
        .versions
        .iter()
        .filter(|v| v.served)
        .map(|v| v.name.as_str())
        .collect();
    let stored = current
        .status
        .as_ref()
        .and_then(|s| s.stored_versions.as_deref())
        .unwrap_or_default();
    if let Some(version) = stored.iter().find(|v| !served.contains(&v.as_str())) {
        return Err(CrdUpgradeError::StoredVersionNotServed {
            crd: name(desired),
            version: version.clone(),
            served: served.join(","),
        });
    }
    Ok(CrdAction::Update)
}

fn name(crd: &CustomResourceDefinition) -> String {
    crd.metadata.name.clone().unwrap_or_default()
}

/// Plans every CRD of `desired` against the cluster, then (only when every plan passed) applies
/// them in order. Returns each CRD's name and action.
///
/// Errors: the first refusal (nothing written) or API failure (CRDs before it were applied; the
/// hook can be re-run: applying is idempotent).
pub async fn upgrade(
    client: &kube::Client,
    desired: &[CustomResourceDefinition],
) -> Result<Vec<(String, CrdAction)>, CrdUpgradeError> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut planned = Vec::with_capacity(desired.len());
    for crd in desired {
        let n = name(crd);
        let current = api
            .get_opt(&n)
            .await
            .map_err(|source| CrdUpgradeError::Api {
                crd: n.clone(),
                source: Box::new(source),
            })?;
        planned.push((n, plan(current.as_ref(), crd)?, crd));
    }
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let mut out = Vec::with_capacity(planned.len());
    for (n, action, crd) in planned {
        api.patch(&n, &params, &Patch::Apply(crd))
            .await
            .map_err(|source| CrdUpgradeError::Api {
                crd: n.clone(),
                source: Box::new(source),
            })?;
        out.push((n, action));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinitionStatus;

    fn stored(mut crd: CustomResourceDefinition, versions: &[&str]) -> CustomResourceDefinition {
        crd.status = Some(CustomResourceDefinitionStatus {
            stored_versions: Some(versions.iter().map(|v| v.to_string()).collect()),
            ..Default::default()
        });
        crd
    }

    #[test]
    fn absent_is_created_served_stored_versions_are_updated_unserved_ones_refused() {
        let desired = crate::crdgen::all_crds().remove(0);
        let version = desired.spec.versions[0].name.clone();
        assert_eq!(plan(None, &desired).unwrap(), CrdAction::Create);
        let current = stored(desired.clone(), &[&version]);
        assert_eq!(plan(Some(&current), &desired).unwrap(), CrdAction::Update);
        // No status yet (just created, not yet reconciled by the API server): nothing stored.
        assert_eq!(
            plan(Some(&desired.clone()), &desired).unwrap(),
            CrdAction::Update
        );
        let old = stored(desired.clone(), &["v1alpha0", &version]);
        let err = plan(Some(&old), &desired).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("v1alpha0") && msg.contains(&name(&desired)),
            "{msg}"
        );
        // A version still listed but no longer served counts as not served.
        let mut not_served = desired.clone();
        not_served.spec.versions[0].served = false;
        assert!(plan(Some(&current), &not_served).is_err());
    }

    #[test]
    fn the_charts_crds_dir_loads_as_the_crds_this_binary_serves() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../chart/crds");
        let loaded = load_dir(&dir).unwrap();
        let mut built = crate::crdgen::all_crds();
        built.sort_by_key(|c| c.metadata.name.clone());
        let names = |v: &[CustomResourceDefinition]| {
            v.iter()
                .map(|c| c.metadata.name.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&loaded), names(&built));
        for (l, b) in loaded.iter().zip(&built) {
            assert_eq!(
                serde_json::to_value(&l.spec).unwrap(),
                serde_json::to_value(&b.spec).unwrap(),
                "{:?}",
                l.metadata.name
            );
        }
    }

    #[test]
    fn a_crds_dir_without_crds_or_with_a_stranger_is_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let err = load_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains("no *.yaml"), "{err}");
        // A mounted ConfigMap's hidden entries are skipped; a non-CRD file is named.
        std::fs::write(dir.path().join("..data"), "not read").unwrap();
        std::fs::write(
            dir.path().join("a.yaml"),
            "kind: ConfigMap\nmetadata: {name: x}\n",
        )
        .unwrap();
        let err = load_dir(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("a.yaml") && err.contains("not a CustomResourceDefinition"),
            "{err}"
        );
    }
}
