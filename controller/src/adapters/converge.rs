//! Re-admission of a container the webhook rendered (the LMCache MP worker, the kernel check,
//! the kvevent-subscriber): only the fields the adapter owns converge (issue 14 item 5;
//! `docs/pod-wiring.md` "Idempotency").
//!
//! Another mutating webhook (a mesh, a secrets injector) may add env vars, volume mounts,
//! resource entries or `envFrom` to *our* sidecars. [`converge_rendered`] keeps those and
//! converges the rest on the rendering:
//!
//! - scalar fields (image, command, args, probes, security context, restart policy, ports, …)
//!   are the rendering's;
//! - `env`: an entry the rendering has is replaced in place (duplicates dropped), an entry whose
//!   name the adapter owns but no longer renders is removed, any other entry is kept where it
//!   is; rendered entries not yet present are appended in rendering order;
//! - `volumeMounts`: the same by mount path (a foreign mount at one of our paths is replaced);
//! - `resources.requests`/`limits`/`claims`: the rendering's keys win, other keys are kept —
//!   also a key the adapter rendered once and no longer does: a LimitRanger default or another
//!   webhook's value cannot be told apart from a stale rendering, and removing a limit the
//!   namespace's LimitRange requires would get the pod rejected (the webhook never blocks a pod);
//! - `envFrom`: kept (the webhook renders none).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, EnvVar, ResourceRequirements, VolumeMount};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

fn merge_env(existing: &[EnvVar], rendered: &[EnvVar], owned: &[&str]) -> Vec<EnvVar> {
    let mut out: Vec<EnvVar> = Vec::new();
    let mut placed: Vec<&str> = Vec::new();
    for e in existing {
        match rendered.iter().find(|r| r.name == e.name) {
            Some(r) => {
                if !placed.contains(&r.name.as_str()) {
                    placed.push(r.name.as_str());
                    out.push(r.clone());
                }
            }
            None if owned.contains(&e.name.as_str()) => {}
            None => out.push(e.clone()),
        }
    }
    out.extend(
        rendered
            .iter()
            .filter(|r| !placed.contains(&r.name.as_str()))
            .cloned(),
    );
    out
}

fn merge_mounts(existing: &[VolumeMount], rendered: &[VolumeMount]) -> Vec<VolumeMount> {
    let mut out: Vec<VolumeMount> = Vec::new();
    let mut placed: Vec<&str> = Vec::new();
    for m in existing {
        match rendered.iter().find(|r| r.mount_path == m.mount_path) {
            Some(r) => {
                if !placed.contains(&r.mount_path.as_str()) {
                    placed.push(r.mount_path.as_str());
                    out.push(r.clone());
                }
            }
            // A mount of one of our volumes at a path we no longer render.
            None if rendered.iter().any(|r| r.name == m.name) => {}
            None => out.push(m.clone()),
        }
    }
    out.extend(
        rendered
            .iter()
            .filter(|r| !placed.contains(&r.mount_path.as_str()))
            .cloned(),
    );
    out
}

fn merge_quantities(
    existing: Option<&BTreeMap<String, Quantity>>,
    rendered: Option<&BTreeMap<String, Quantity>>,
) -> Option<BTreeMap<String, Quantity>> {
    let mut out = existing.cloned().unwrap_or_default();
    out.extend(rendered.cloned().unwrap_or_default());
    (!out.is_empty()).then_some(out)
}

fn merge_resources(
    existing: Option<&ResourceRequirements>,
    rendered: Option<&ResourceRequirements>,
) -> Option<ResourceRequirements> {
    let (Some(e), r) = (existing, rendered) else {
        return rendered.cloned();
    };
    let r = r.cloned().unwrap_or_default();
    let mut claims = e.claims.clone().unwrap_or_default();
    for c in r.claims.iter().flatten() {
        if !claims.iter().any(|x| x.name == c.name) {
            claims.push(c.clone());
        }
    }
    let out = ResourceRequirements {
        claims: (!claims.is_empty()).then_some(claims),
        limits: merge_quantities(e.limits.as_ref(), r.limits.as_ref()),
        requests: merge_quantities(e.requests.as_ref(), r.requests.as_ref()),
    };
    (out != ResourceRequirements::default()).then_some(out)
}

/// The container a re-admission leaves: `rendered` with what others added to `existing` kept
/// (module docs). `owned_env` lists env names the adapter owns besides those it renders now
/// (so a variable it stopped rendering is removed rather than kept as foreign).
pub fn converge_rendered(
    existing: &Container,
    rendered: Container,
    owned_env: &[&str],
) -> Container {
    let env = merge_env(
        existing.env.as_deref().unwrap_or(&[]),
        rendered.env.as_deref().unwrap_or(&[]),
        owned_env,
    );
    let mounts = merge_mounts(
        existing.volume_mounts.as_deref().unwrap_or(&[]),
        rendered.volume_mounts.as_deref().unwrap_or(&[]),
    );
    let resources = merge_resources(existing.resources.as_ref(), rendered.resources.as_ref());
    Container {
        env: (!env.is_empty()).then_some(env),
        volume_mounts: (!mounts.is_empty()).then_some(mounts),
        resources,
        env_from: rendered
            .env_from
            .clone()
            .or_else(|| existing.env_from.clone()),
        ..rendered
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapters::env_var;

    #[test]
    fn foreign_additions_survive_owned_fields_converge() {
        let rendered = Container {
            name: "s".into(),
            image: Some("new".into()),
            env: Some(vec![env_var("A", "1"), env_var("B", "2")]),
            volume_mounts: Some(vec![VolumeMount {
                name: "tok".into(),
                mount_path: "/t".into(),
                ..Default::default()
            }]),
            resources: Some(ResourceRequirements {
                requests: Some(BTreeMap::from([("cpu".into(), Quantity("10m".into()))])),
                ..Default::default()
            }),
            ..Default::default()
        };
        let existing = Container {
            name: "s".into(),
            image: Some("old".into()),
            env: Some(vec![
                env_var("MESH", "on"),
                env_var("A", "0"),
                env_var("GONE", "x"),
                env_var("A", "dup"),
            ]),
            volume_mounts: Some(vec![
                VolumeMount {
                    name: "secrets".into(),
                    mount_path: "/s".into(),
                    ..Default::default()
                },
                VolumeMount {
                    name: "tok".into(),
                    mount_path: "/old".into(),
                    ..Default::default()
                },
            ]),
            resources: Some(ResourceRequirements {
                requests: Some(BTreeMap::from([
                    ("cpu".into(), Quantity("1".into())),
                    ("memory".into(), Quantity("1Mi".into())),
                ])),
                ..Default::default()
            }),
            ..Default::default()
        };
        let got = converge_rendered(&existing, rendered.clone(), &["GONE"]);
        assert_eq!(got.image.as_deref(), Some("new"));
        let env: Vec<_> = got
            .env
            .iter()
            .flatten()
            .map(|e| (e.name.as_str(), e.value.as_deref().unwrap()))
            .collect();
        assert_eq!(env, vec![("MESH", "on"), ("A", "1"), ("B", "2")]);
        let mounts: Vec<_> = got
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| m.mount_path.as_str())
            .collect();
        assert_eq!(mounts, vec!["/s", "/t"]);
        let req = got.resources.as_ref().unwrap().requests.as_ref().unwrap();
        assert_eq!(req["cpu"], Quantity("10m".into()));
        assert_eq!(req["memory"], Quantity("1Mi".into()));
        // Converged: a second pass changes nothing; a fresh rendering is the rendering.
        assert_eq!(converge_rendered(&got, rendered.clone(), &["GONE"]), got);
        assert_eq!(
            converge_rendered(&rendered, rendered.clone(), &[]),
            rendered
        );
    }
}
