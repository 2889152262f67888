//! Which container of a pod runs the engine ([`select_engine_container`]), read once into an
//! [`EnginePod`] with its parsed command, plus the container facts the engine's wiring depends
//! on: the webhook's own rendered containers ([`ENV_COMPONENT`], [`user_containers`]) and the
//! `/dev/shm` mount ([`shm_mount`]).

use ic_shared::crd::Runtime;
use k8s_openapi::api::core::v1::{Container, Pod, VolumeMount};

use super::command::EngineCommand;

/// Env var on containers the webhook renders, naming the component; how an adapter recognises
/// its own prior injection (converge) versus an operator's object squatting a reserved name
/// (reject).
pub const ENV_COMPONENT: &str = "INFERENCECACHE_COMPONENT";

/// Why no engine container could be chosen (the Pod webhook's fail-open reason, the node plan's
/// `EngineNotFound` issue).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectError {
    /// No container launches the engine.
    #[error("no engine container found for {runtime}: {detail}")]
    NoEngineContainer {
        /// Runtime wire spelling.
        runtime: &'static str,
        /// Per-container findings.
        detail: String,
    },
    /// Several containers launch the engine and none is named after the runtime.
    #[error("several containers launch {runtime} ({containers}); name the engine container {preferred:?}")]
    AmbiguousEngine {
        /// Runtime wire spelling.
        runtime: &'static str,
        /// Candidate container names, comma-separated.
        containers: String,
        /// The name that disambiguates.
        preferred: &'static str,
    },
}

/// The container name that disambiguates several engine candidates.
fn runtime_container_name(runtime: Runtime) -> &'static str {
    match runtime {
        Runtime::Vllm => "vllm",
        Runtime::SgLang => "sglang",
    }
}

/// Finds the engine container: the one container whose command launches `runtime` (direct,
/// through a wrapper, or inside a `sh -c` script); several such containers are disambiguated by
/// the name `vllm`/`sglang`. A container without `command` (image entrypoint) is accepted when
/// no command launches the engine and it is the only container, is named after the runtime, or
/// runs an image whose name contains it.
///
/// Errors: [`SelectError::NoEngineContainer`] (with each container's finding),
/// [`SelectError::AmbiguousEngine`].
pub fn select_engine_container(pod: &Pod, runtime: Runtime) -> Result<usize, SelectError> {
    let containers = pod
        .spec
        .as_ref()
        .map(|s| s.containers.as_slice())
        .unwrap_or(&[]);
    if containers.is_empty() {
        return Err(SelectError::NoEngineContainer {
            runtime: runtime.as_str(),
            detail: "the pod has no containers".to_string(),
        });
    }
    let preferred = runtime_container_name(runtime);
    let mut strong = Vec::new();
    let mut weak = Vec::new();
    let mut findings = Vec::new();
    let users: Vec<(usize, &Container)> = user_containers(containers).collect();
    for &(i, c) in &users {
        match EngineCommand::parse(c, runtime) {
            Ok(cmd) if cmd.found_engine => strong.push(i),
            Ok(_) => {
                let image = c.image.as_deref().unwrap_or("").to_ascii_lowercase();
                if users.len() == 1 || c.name == preferred || image.contains(preferred) {
                    weak.push(i);
                } else {
                    findings.push(format!(
                        "container {:?} has no command and its image does not name {}",
                        c.name, preferred
                    ));
                }
            }
            Err(e) => findings.push(e.to_string()),
        }
    }
    let pick = |cands: &[usize]| -> Result<Option<usize>, SelectError> {
        match cands {
            [] => Ok(None),
            [one] => Ok(Some(*one)),
            many => match many.iter().find(|&&i| containers[i].name == preferred) {
                Some(&i) => Ok(Some(i)),
                None => Err(SelectError::AmbiguousEngine {
                    runtime: runtime.as_str(),
                    containers: many
                        .iter()
                        .map(|&i| containers[i].name.clone())
                        .collect::<Vec<_>>()
                        .join(", "),
                    preferred,
                }),
            },
        }
    };
    if let Some(i) = pick(&strong)? {
        return Ok(i);
    }
    if let Some(i) = pick(&weak)? {
        return Ok(i);
    }
    Err(SelectError::NoEngineContainer {
        runtime: runtime.as_str(),
        detail: findings.join("; "),
    })
}

/// The pod's own containers with their indices: those the webhook rendered (carrying
/// [`ENV_COMPONENT`], such as the kvevent-subscriber) are left out, so wiring a pod never changes
/// which container is its engine.
pub fn user_containers(containers: &[Container]) -> impl Iterator<Item = (usize, &Container)> {
    containers.iter().enumerate().filter(|(_, c)| {
        !c.env
            .iter()
            .flatten()
            .any(|e| e.name == ENV_COMPONENT && e.value.is_some())
    })
}

/// A mount path as the kubelet resolves it: repeated and trailing slashes and `.` segments
/// removed (`/dev//shm/` → `/dev/shm`), so two spellings of one directory are one mount.
pub fn normalize_mount_path(path: &str) -> String {
    let segs: Vec<&str> = path
        .split('/')
        .filter(|s| !s.is_empty() && *s != ".")
        .collect();
    let joined = segs.join("/");
    if path.starts_with('/') {
        format!("/{joined}")
    } else {
        joined
    }
}

/// The engine container's mount at `/dev/shm` (any spelling), if any.
pub fn shm_mount(c: &Container) -> Option<&VolumeMount> {
    c.volume_mounts
        .iter()
        .flatten()
        .find(|m| normalize_mount_path(&m.mount_path) == "/dev/shm")
}

/// An engine pod read once: the engine container for `runtime` (chosen by
/// [`select_engine_container`], the rule the Pod webhook wires by) and its parsed command. Its
/// flags' meanings are read from [`EngineCommand::texts`] / [`EngineCommand::literal_texts`] by
/// [`super::flags`] and [`super::kv_events`].
#[derive(Debug, Clone)]
pub struct EnginePod {
    /// The runtime the container was chosen for.
    pub runtime: Runtime,
    /// Index of the engine container in `spec.containers`.
    pub index: usize,
    /// The engine container.
    pub container: Container,
    /// Its parsed command line.
    pub command: EngineCommand,
}

impl EnginePod {
    /// Chooses the engine container of `pod` for `runtime` and parses its command. The error
    /// says why no container was chosen or its command could not be read.
    pub fn read(pod: &Pod, runtime: Runtime) -> Result<Self, String> {
        let index = select_engine_container(pod, runtime).map_err(|e| e.to_string())?;
        let container = pod
            .spec
            .as_ref()
            .and_then(|s| s.containers.get(index))
            .ok_or_else(|| "the engine container is gone".to_string())?;
        let command = EngineCommand::parse(container, runtime).map_err(|e| e.to_string())?;
        Ok(Self {
            runtime,
            index,
            container: container.clone(),
            command,
        })
    }

    /// The engine container's `/dev/shm` mount, if any.
    pub fn shm_mount(&self) -> Option<&VolumeMount> {
        shm_mount(&self.container)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn mount_paths_normalise() {
        assert_eq!(normalize_mount_path("/dev//shm"), "/dev/shm");
        assert_eq!(normalize_mount_path("/dev/shm/"), "/dev/shm");
        assert_eq!(normalize_mount_path("/dev/./shm"), "/dev/shm");
        assert_eq!(normalize_mount_path("/"), "/");
    }
}
