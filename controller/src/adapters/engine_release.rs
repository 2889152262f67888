//! Engine-release gates: which engine release has the flags and behaviours the wiring depends
//! on (spec 000 "Mutating Pod webhook", "SGLang engine support", "Supported-model matrix";
//! `docs/pod-wiring.md` "Engine releases").
//!
//! The release is read from the pod: the annotation [`ANNOTATION_ENGINE_VERSION`] (what the
//! engine's own `--version` printed, recorded by the operator or the image build) wins, else the
//! engine container's image tag (`vllm/vllm-openai:v0.11.1`, `lmsysorg/sglang:v0.5.13-cu126`).
//! A tag that names no release (`latest`, `nightly`, a digest only, a pre-release such as
//! `0.11.1rc2`, a private build tag) is [`Release::Unknown`]: the pod is wired as before and the
//! admission warns that the gate could not be checked — never a crash, never a blocked pod.
//!
//! | gate | first release with it | below it | source |
//! |---|---|---|---|
//! | SGLang `--lmcache-config-file` (MP wire) | 0.5.13 | unwired with the reason: SGLang's argparse exits on the unknown flag | `sglang` wheels: `server_args.py` adds `--lmcache-config-file` in 0.5.13 (absent in 0.5.12, whose LMCache path reads `LMCACHE_CONFIG_FILE`) |
//! | SGLang `--enable-lmcache` | 0.5.2 | (covered by the row above) | `sglang` wheels: `server_args.py` 0.5.2 (absent in 0.5.1) |
//! | vLLM `--kv-events-config` without `"publisher"` | 0.11.1 | warning: the publisher defaults to `null` and sends nothing | `vllm` wheels: `vllm/config/kv_events.py` 0.11.0 `publisher: str = "null"`; 0.11.1 sets `"zmq"` when `enable_kv_cache_events` |
//! | vLLM `--kv-transfer-config` (LMCacheConnectorV1) on a sliding-window model | every release | warning: a KV connector turns the hybrid KV-cache manager off, so sliding-window layers keep full-length KV (less cache, more memory) | `vllm` wheels 0.24.0/0.33.0: `vllm/config/vllm.py` turns the hybrid manager off for a connector without `SupportsHMA` ("models with sliding window attention will run with reduced performance"); `LMCacheConnectorV1` does not implement it; 0.11.0: off for any connector |

use k8s_openapi::api::core::v1::{Container, Pod};

use ic_shared::crd::Runtime;

use super::InjectError;
use crate::engine::command::EngineCommand;
use crate::engine::flags::{kv_events_config_json, served_model};

/// Pod annotation recording the engine's release as its own `--version` prints it (`0.11.1`,
/// `v0.5.13`). Wins over the image tag (a private image built from the engine has its own
/// tags).
pub const ANNOTATION_ENGINE_VERSION: &str = "inferencecache.io/engine-version";

/// First SGLang release with `--lmcache-config-file` (the MP wire the adapter renders).
pub const SGLANG_LMCACHE_CONFIG_FILE_SINCE: Version = Version(0, 5, 13);
/// First vLLM release whose KV-event publisher defaults to `zmq` when events are enabled.
pub const VLLM_KV_EVENTS_ZMQ_DEFAULT_SINCE: Version = Version(0, 11, 1);

/// A release `major.minor.patch` (a `.postN` suffix is the same release for these gates).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version(pub u32, pub u32, pub u32);

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

/// The engine's release as the pod tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Release {
    /// Read from the annotation or the image tag; `from` says which (`image tag "v0.5.13"`).
    Known {
        /// The release.
        version: Version,
        /// Where it was read, for messages.
        from: String,
    },
    /// No release could be read; the text says why (for the admission warning).
    Unknown(String),
}

/// Parses a release from a version text or image tag: an optional `v`, then `X.Y` or `X.Y.Z`,
/// then the end, a `.postN`, or a build suffix after `-`/`_`/`+` (`-cu126`, `+cu128`).
/// Pre-releases (`rc`, `a`, `b`, `dev` right after the numbers) and anything else → `None`.
pub fn parse_version(text: &str) -> Option<Version> {
    let t = text.trim();
    let t = t.strip_prefix(['v', 'V']).unwrap_or(t);
    // A build suffix (`-cu126`, `+cu128`, `_amd64`) does not change the release.
    let main = t.split(['-', '_', '+']).next().unwrap_or(t);
    // A post-release (`0.5.3.post1`) has the release's flags.
    let main = match main.split_once(".post") {
        Some((m, n)) if !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()) => m,
        Some(_) => return None,
        None => main,
    };
    let parts: Vec<u32> = main
        .split('.')
        .map(|p| {
            (!p.is_empty() && p.chars().all(|c| c.is_ascii_digit()))
                .then(|| p.parse::<u32>().ok())
                .flatten()
        })
        .collect::<Option<_>>()?;
    match parts.as_slice() {
        [a, b] => Some(Version(*a, *b, 0)),
        [a, b, c] => Some(Version(*a, *b, *c)),
        _ => None,
    }
}

/// The tag of an image reference (`None` for no tag, e.g. `repo@sha256:…` or `repo`).
fn image_tag(image: &str) -> Option<&str> {
    let no_digest = image.split('@').next().unwrap_or(image);
    let last = no_digest.rsplit('/').next().unwrap_or(no_digest);
    last.split_once(':').map(|(_, t)| t)
}

/// The engines' own image repositories, whose tags are their releases (any registry or mirror
/// prefix): `vllm/vllm-openai` (vLLM's Docker Hub image) and `lmsysorg/sglang` (SGLang's).
/// Another image's tag is its own numbering (`ghcr.io/llm-d/llm-d:v0.2.0` is llm-d 0.2.0, not
/// vLLM 0.2.0), so it is never read as the engine's release.
pub const UPSTREAM_IMAGES: &[(Runtime, &str)] = &[
    (Runtime::Vllm, "vllm/vllm-openai"),
    (Runtime::SgLang, "lmsysorg/sglang"),
];

/// The repository path of an image without its registry host, tag and digest
/// (`docker.io/lmsysorg/sglang:v0.5.13` → `lmsysorg/sglang`).
fn repository(image: &str) -> &str {
    let no_digest = image.split('@').next().unwrap_or(image);
    let (head, last) = match no_digest.rsplit_once('/') {
        Some((h, l)) => (Some(h), l),
        None => (None, no_digest),
    };
    let name_end = no_digest.len() - last.len() + last.find(':').unwrap_or(last.len());
    let path = &no_digest[..name_end];
    match (head, path.split_once('/')) {
        (Some(_), Some((host, rest))) if host.contains(['.', ':']) || host == "localhost" => rest,
        _ => path,
    }
}

/// Reads the engine's release from `pod` (annotation) and its engine container `engine` (the
/// image tag, only for the engine's own image, [`UPSTREAM_IMAGES`]). Never fails: what cannot
/// be read is [`Release::Unknown`] with the reason.
pub fn engine_release(pod: &Pod, engine: &Container, runtime: Runtime) -> Release {
    if let Some(v) = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_ENGINE_VERSION))
    {
        return match parse_version(v) {
            Some(version) => Release::Known {
                version,
                from: format!("annotation {ANNOTATION_ENGINE_VERSION}={v:?}"),
            },
            None => Release::Unknown(format!(
                "annotation {ANNOTATION_ENGINE_VERSION}={v:?} is not a release (write it as X.Y.Z)"
            )),
        };
    }
    let image = engine.image.as_deref().unwrap_or("").trim();
    let upstream = UPSTREAM_IMAGES
        .iter()
        .any(|(r, repo)| *r == runtime && repository(image) == *repo);
    if !upstream {
        return Release::Unknown(format!(
            "container {:?} runs image {image:?}, not the engine's own image ({}), so its tag is not the engine's release",
            engine.name,
            UPSTREAM_IMAGES
                .iter()
                .filter(|(r, _)| *r == runtime)
                .map(|(_, repo)| *repo)
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    match image_tag(image) {
        None if image.contains('@') => Release::Unknown(format!(
            "container {:?} runs image {image:?} by digest, which names no release",
            engine.name
        )),
        None => Release::Unknown(format!(
            "container {:?} runs image {image:?} without a tag (latest), which names no release",
            engine.name
        )),
        Some(tag) => match parse_version(tag) {
            Some(version) => Release::Known {
                version,
                from: format!("image tag {tag:?}"),
            },
            None => Release::Unknown(format!(
                "container {:?} runs image tag {tag:?}, which names no release",
                engine.name
            )),
        },
    }
}

/// The hint appended to every unknown-release warning.
fn record_hint() -> String {
    format!(
        "record the engine's --version in the pod annotation {ANNOTATION_ENGINE_VERSION} (or run the engine's own image with a release tag)"
    )
}

/// SGLang + LMCache MP gate: `Ok(Some(warning))` for an unknown release, `Ok(None)` for one
/// with `--lmcache-config-file`; [`InjectError::UnsupportedRelease`] for one without it (the
/// engine would exit on the unknown flag, so the pod is left unwired with this reason).
pub fn sglang_lmcache_gate(pod: &Pod, engine: &Container) -> Result<Option<String>, InjectError> {
    match engine_release(pod, engine, Runtime::SgLang) {
        Release::Known { version, .. } if version >= SGLANG_LMCACHE_CONFIG_FILE_SINCE => Ok(None),
        Release::Known { version, from } => Err(InjectError::UnsupportedRelease {
            container: engine.name.clone(),
            detail: format!(
                "SGLang {version} (from {from}), which has no --lmcache-config-file (added in SGLang {SGLANG_LMCACHE_CONFIG_FILE_SINCE}): its argument parser exits on the unknown flag, so the engine would never start; upgrade the engine to SGLang {SGLANG_LMCACHE_CONFIG_FILE_SINCE} or later"
            ),
        }),
        Release::Unknown(why) => Ok(Some(format!(
            "the SGLang release could not be read ({why}); --enable-lmcache and --lmcache-config-file are injected as for SGLang >= {SGLANG_LMCACHE_CONFIG_FILE_SINCE} (an older SGLang exits on the unknown flag): {}",
            record_hint()
        ))),
    }
}

/// The engine's `--kv-events-config` (the last one, as argparse keeps it) as JSON, if literal.
fn kv_events_config(engine: &Container, runtime: Runtime) -> Option<serde_json::Value> {
    let cmd = EngineCommand::parse(engine, runtime).ok()?;
    kv_events_config_json(&cmd)
}

/// vLLM KV-event publisher gate: a warning when the engine enables KV-cache events without
/// naming a `publisher` and the release is below 0.11.1 (its default publisher is `null`: no
/// event is sent, so the subscriber and the index see nothing) or unknown. `None` otherwise
/// (and for every other runtime).
pub fn vllm_kv_events_publisher_warning(
    pod: &Pod,
    engine: &Container,
    runtime: Runtime,
) -> Option<String> {
    if runtime != Runtime::Vllm {
        return None;
    }
    let cfg = kv_events_config(engine, runtime)?;
    let enabled = cfg.get("enable_kv_cache_events") == Some(&serde_json::Value::Bool(true));
    let unnamed = cfg.get("publisher").is_none_or(|p| p.is_null());
    if !(enabled && unnamed) {
        return None;
    }
    match engine_release(pod, engine, runtime) {
        Release::Known { version, .. } if version >= VLLM_KV_EVENTS_ZMQ_DEFAULT_SINCE => None,
        Release::Known { version, from } => Some(format!(
            "container {:?}: vLLM {version} ({from}) enables KV-cache events in --kv-events-config without a \"publisher\"; before vLLM {VLLM_KV_EVENTS_ZMQ_DEFAULT_SINCE} the publisher then defaults to \"null\" and sends nothing, so no KV event reaches the index — add \"publisher\":\"zmq\"",
            engine.name
        )),
        Release::Unknown(why) => Some(format!(
            "container {:?}: --kv-events-config enables KV-cache events without a \"publisher\", which sends nothing on vLLM before {VLLM_KV_EVENTS_ZMQ_DEFAULT_SINCE}, and the release could not be read ({why}) — add \"publisher\":\"zmq\", or {}",
            engine.name,
            record_hint()
        )),
    }
}

/// Model-name fragments (lower case) of model families whose attention uses a sliding window
/// (or chunked local attention) in some layers, which vLLM's hybrid KV-cache manager sizes
/// per layer: Gemma 2/3, gpt-oss, Mistral 7B v0.1, Command R7B / Command A, Llama 4.
pub const SLIDING_WINDOW_MODELS: &[&str] = &[
    "gemma-2",
    "gemma-3",
    "gemma2",
    "gemma3",
    "gpt-oss",
    "mistral-7b-v0.1",
    "mistral-7b-instruct-v0.1",
    "command-r7b",
    "command-a",
    "llama-4",
];

/// The model a vLLM engine serves: `--model`, else the first positional argument.
fn vllm_model(engine: &Container) -> Option<String> {
    let cmd = EngineCommand::parse(engine, Runtime::Vllm).ok()?;
    served_model(&cmd)
}

/// vLLM + LMCache on a sliding-window model: a warning (the wiring proceeds — the engine starts,
/// with less KV cache than without the connector). `None` for other models.
pub fn vllm_sliding_window_warning(engine: &Container) -> Option<String> {
    let model = vllm_model(engine)?;
    let lower = model.to_ascii_lowercase();
    let family = SLIDING_WINDOW_MODELS.iter().find(|f| lower.contains(*f))?;
    Some(format!(
        "container {:?} serves {model:?} ({family}: sliding-window attention layers); the LMCache connector turns off vLLM's hybrid KV-cache manager, so those layers keep KV for the full context — less KV cache and more GPU memory than without the connector. For routing only, use spec.integration.mode: EventsOnly",
        engine.name
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_from_tags_and_texts() {
        assert_eq!(parse_version("v0.11.1"), Some(Version(0, 11, 1)));
        assert_eq!(parse_version("0.5.13-cu126"), Some(Version(0, 5, 13)));
        assert_eq!(
            parse_version("v0.5.3.post1-cu129-amd64"),
            Some(Version(0, 5, 3))
        );
        assert_eq!(parse_version("0.10"), Some(Version(0, 10, 0)));
        assert_eq!(parse_version("0.11.1+cu128"), Some(Version(0, 11, 1)));
        for bad in [
            "latest",
            "nightly",
            "0.11.1rc2",
            "0.11.1.dev3",
            "",
            "v",
            "1",
            "main-abc",
        ] {
            assert_eq!(parse_version(bad), None, "{bad}");
        }
        assert!(Version(0, 5, 12) < SGLANG_LMCACHE_CONFIG_FILE_SINCE);
        assert!(Version(0, 11, 0) < VLLM_KV_EVENTS_ZMQ_DEFAULT_SINCE);
    }

    #[test]
    fn repositories() {
        assert_eq!(repository("vllm/vllm-openai:v0.11.1"), "vllm/vllm-openai");
        assert_eq!(
            repository("docker.io/lmsysorg/sglang:latest"),
            "lmsysorg/sglang"
        );
        assert_eq!(
            repository("mirror.corp:5000/lmsysorg/sglang@sha256:ab"),
            "lmsysorg/sglang"
        );
        assert_eq!(repository("localhost/vllm/vllm-openai"), "vllm/vllm-openai");
        assert_eq!(repository("ghcr.io/llm-d/llm-d:v0.2.0"), "llm-d/llm-d");
        assert_eq!(repository("python:3.11"), "python");
    }

    #[test]
    fn image_tags() {
        assert_eq!(image_tag("vllm/vllm-openai:v0.11.1"), Some("v0.11.1"));
        assert_eq!(image_tag("registry:5000/sglang:0.5.13"), Some("0.5.13"));
        assert_eq!(image_tag("registry:5000/sglang"), None);
        assert_eq!(image_tag("lmsysorg/sglang@sha256:abcd"), None);
        assert_eq!(
            image_tag("lmsysorg/sglang:v0.5.13@sha256:abcd"),
            Some("v0.5.13")
        );
    }
}
