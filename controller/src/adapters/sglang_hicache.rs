//! (SGLang, SGLangHiCache): SGLang's native hierarchical cache (spec 000 "SGLang native
//! HiCache").
//!
//! The adapter adds `--enable-hierarchical-cache` and the `--hicache-*` flags rendered from
//! `spec.hiCache` to the engine container, and nothing else (no env, volumes, `/dev/shm` or
//! resources: HiCache host memory is the engine container's own):
//!
//! | `spec.hiCache` | flag |
//! |---|---|
//! | `ratio` | `--hicache-ratio <ratio>` |
//! | `sizeGB` | `--hicache-size <sizeGB>` |
//! | `writePolicy` | `--hicache-write-policy <v>` |
//! | `ioBackend` | `--hicache-io-backend <v>` |
//! | `memoryLayout` | `--hicache-mem-layout <v>` |
//!
//! Engine container: the only container of a one-container pod (any name), else the container
//! named `sglang`. Every reserved argument is validated against the original pod before any
//! change: a matching operator-supplied argument (ratio compared numerically) is left byte for
//! byte; a missing one is appended once; a different value, the opposite capacity flag, a
//! malformed or duplicate argument, or SGLang LMCache flags (`--enable-lmcache`,
//! `--lmcache-config-file`) fail the whole injection, so the pod is admitted without partial
//! HiCache wiring.

use ic_shared::crd::{CacheType, EngineOverrides, HiCacheSpec, Runtime};
use k8s_openapi::api::core::v1::{Container, Pod};

use super::{
    engine_mut, engine_ref, BindingKind, InjectContext, InjectError, InjectReport, RuntimeAdapter,
};
use crate::engine::command::{normalize_flag, Edit, EngineCommand};
use crate::engine::container::user_containers;

/// The container name a multi-container pod must give its engine.
pub const ENGINE_CONTAINER: &str = "sglang";

const RESERVED_ARGS: &[&str] = &["--enable-hierarchical-cache"];
const RESERVED_ENV: &[&str] = &[];

/// The (SGLang, SGLangHiCache) adapter.
pub struct SglangHiCache;

/// How a rendered value compares with what the pod has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Compare {
    /// Exact string.
    Text,
    /// Finite decimal, compared numerically.
    Decimal,
    /// Integer.
    Integer,
}

/// One flag the adapter renders: (flag, value, comparison). `None` value = boolean flag.
type Want = (&'static str, Option<String>, Compare);

fn enum_text<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_value(v)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// The flags `hi` renders, in order, plus the opposite capacity flag.
fn wanted(hi: &HiCacheSpec) -> Result<(Vec<Want>, &'static str), InjectError> {
    let mut out: Vec<Want> = vec![("--enable-hierarchical-cache", None, Compare::Text)];
    let opposite = match (&hi.ratio, hi.size_gb) {
        (Some(ratio), None) => {
            match ratio.trim().parse::<f64>() {
                Ok(r) if r.is_finite() && r > 0.0 => {}
                _ => {
                    return Err(InjectError::InvalidSpec {
                        field: "spec.hiCache.ratio",
                        detail: format!("{ratio:?} is not a finite number greater than zero"),
                    })
                }
            }
            out.push((
                "--hicache-ratio",
                Some(ratio.trim().to_string()),
                Compare::Decimal,
            ));
            "--hicache-size"
        }
        (None, Some(size)) => {
            if size < 1 {
                return Err(InjectError::InvalidSpec {
                    field: "spec.hiCache.sizeGB",
                    detail: format!("{size} is below 1"),
                });
            }
            out.push(("--hicache-size", Some(size.to_string()), Compare::Integer));
            "--hicache-ratio"
        }
        _ => {
            return Err(InjectError::InvalidSpec {
                field: "spec.hiCache",
                detail: "exactly one of ratio and sizeGB must be set".to_string(),
            })
        }
    };
    if let Some(v) = &hi.write_policy {
        out.push(("--hicache-write-policy", Some(enum_text(v)), Compare::Text));
    }
    if let Some(v) = &hi.io_backend {
        out.push(("--hicache-io-backend", Some(enum_text(v)), Compare::Text));
    }
    if let Some(v) = &hi.memory_layout {
        out.push(("--hicache-mem-layout", Some(enum_text(v)), Compare::Text));
    }
    Ok((out, opposite))
}

fn same(have: &str, want: &str, cmp: Compare) -> Option<bool> {
    match cmp {
        Compare::Text => Some(have == want),
        Compare::Decimal => {
            let h: f64 = have.trim().parse().ok().filter(|h: &f64| h.is_finite())?;
            let w: f64 = want.parse().ok()?;
            Some(h == w)
        }
        Compare::Integer => {
            let h: i64 = have.trim().parse().ok()?;
            let w: i64 = want.parse().ok()?;
            Some(h == w)
        }
    }
}

/// Applies `engineOverrides` to the rendered flags: an `args` entry replaces the value the
/// adapter renders for that flag and a `suppressArgs` entry drops it, so the adapter validates
/// and converges on what the pod ends up with (re-admission then changes nothing). Reserved
/// flags are not affected.
fn with_overrides(
    mut want: Vec<Want>,
    opposite: &'static str,
    ov: Option<&EngineOverrides>,
) -> (Vec<Want>, Option<&'static str>) {
    let Some(ov) = ov else {
        return (want, Some(opposite));
    };
    let mut ignored = Vec::new();
    for group in super::overrides::groups(&ov.args, &mut ignored) {
        let Some(head) = group.first() else { continue };
        let name = normalize_flag(head);
        if RESERVED_ARGS.contains(&name.as_str()) {
            continue;
        }
        let value = super::overrides::group_value(&group);
        for w in want.iter_mut().filter(|w| w.0 == name && w.1.is_some()) {
            if let Some(v) = &value {
                w.1 = Some(v.clone());
                if w.2 != Compare::Text && same(v, v, w.2).is_none() {
                    w.2 = Compare::Text;
                }
            }
        }
    }
    let suppressed: Vec<String> = ov
        .suppress_args
        .iter()
        .map(|s| normalize_flag(s))
        .filter(|s| !RESERVED_ARGS.contains(&s.as_str()))
        .collect();
    let capacity_kept = want
        .get(1)
        .is_some_and(|w| !suppressed.iter().any(|s| s == w.0));
    want.retain(|w| !suppressed.iter().any(|s| s == w.0));
    (want, capacity_kept.then_some(opposite))
}

/// Edits that add the missing HiCache flags, or the reason the pod cannot be wired.
fn edits(
    cmd: &EngineCommand,
    hi: &HiCacheSpec,
    ov: Option<&EngineOverrides>,
) -> Result<Vec<Edit>, InjectError> {
    let container = cmd.container.clone();
    for flag in ["--enable-lmcache", "--lmcache-config-file"] {
        if !cmd.find(flag).is_empty() {
            return Err(InjectError::ConflictingIntegration {
                container,
                flag: flag.to_string(),
                detail: "SGLang LMCache is already configured on this engine; HiCache and LMCache are alternative hierarchical caches",
            });
        }
    }
    let (want, opposite) = wanted(hi)?;
    let capacity = want.get(1).cloned();
    let (want, opposite) = with_overrides(want, opposite, ov);
    if let (Some(opposite), Some((flag, value, _))) = (opposite, capacity) {
        if let Some(occ) = cmd.find(opposite).first() {
            let have = cmd.value_of(occ).map(|(v, _)| v).unwrap_or_default();
            let value = want
                .iter()
                .find(|w| w.0 == flag)
                .and_then(|w| w.1.clone())
                .or(value)
                .unwrap_or_default();
            return Err(InjectError::HiCacheConflict {
                container,
                flag: opposite.to_string(),
                have,
                want: format!("{flag} {value}"),
            });
        }
    }
    let mut append = Vec::new();
    for (flag, value, cmp) in &want {
        let occs = cmd.find(flag);
        let occ = match occs.as_slice() {
            [] => {
                append.push(flag.to_string());
                if let Some(v) = value {
                    append.push(v.clone());
                }
                continue;
            }
            [occ] => occ,
            _ => {
                return Err(InjectError::DuplicateFlag {
                    container,
                    flag: flag.to_string(),
                })
            }
        };
        let written = cmd.args[occ.index].text.clone();
        let Some(want_value) = value else {
            if occ.inline.is_some() {
                return Err(InjectError::MalformedFlag {
                    container,
                    flag: flag.to_string(),
                    value: written,
                });
            }
            continue;
        };
        let Some((have, value_index)) = cmd.value_of(occ) else {
            return Err(InjectError::MissingFlagValue {
                container,
                flag: flag.to_string(),
            });
        };
        if cmd.is_opaque(value_index.unwrap_or(occ.index)) {
            return Err(InjectError::OpaqueFlag {
                container,
                flag: flag.to_string(),
                value: have,
            });
        }
        match same(&have, want_value, *cmp) {
            Some(true) => {}
            Some(false) => {
                return Err(InjectError::HiCacheConflict {
                    container,
                    flag: flag.to_string(),
                    have,
                    want: want_value.clone(),
                })
            }
            None => {
                return Err(InjectError::MalformedFlag {
                    container,
                    flag: flag.to_string(),
                    value: have,
                })
            }
        }
    }
    Ok(if append.is_empty() {
        Vec::new()
    } else {
        vec![Edit::Append(append)]
    })
}

impl RuntimeAdapter for SglangHiCache {
    fn name(&self) -> &'static str {
        "sglang+hicache"
    }

    fn runtime(&self) -> Runtime {
        Runtime::SgLang
    }

    fn cache_type(&self) -> CacheType {
        CacheType::SGLangHiCache
    }

    fn reserved_args(&self) -> &'static [&'static str] {
        RESERVED_ARGS
    }

    fn reserved_env(&self) -> &'static [&'static str] {
        RESERVED_ENV
    }

    fn supports_binding(&self, binding: Option<BindingKind>) -> bool {
        binding.is_none()
    }

    /// One-container pods: that container; otherwise the container named `sglang`
    /// ([`InjectError::HiCacheEngineName`] when there is none).
    fn select_engine(&self, pod: &Pod) -> Result<usize, InjectError> {
        let containers = pod
            .spec
            .as_ref()
            .map(|s| s.containers.as_slice())
            .unwrap_or(&[]);
        let users: Vec<(usize, &Container)> = user_containers(containers).collect();
        match users.as_slice() {
            [] => Err(InjectError::NoEngineContainer {
                runtime: Runtime::SgLang.as_str(),
                detail: "the pod has no containers".to_string(),
            }),
            [(i, _)] => Ok(*i),
            many => many
                .iter()
                .find(|(_, c)| c.name == ENGINE_CONTAINER)
                .map(|(i, _)| *i)
                .ok_or_else(|| InjectError::HiCacheEngineName {
                    containers: many
                        .iter()
                        .map(|(_, c)| c.name.clone())
                        .collect::<Vec<_>>()
                        .join(", "),
                }),
        }
    }

    fn inject_engine_config(
        &self,
        ctx: &InjectContext<'_>,
        pod: &mut Pod,
        engine: usize,
    ) -> Result<InjectReport, InjectError> {
        let binding_kind = ctx.binding.map(|b| b.kind);
        if !self.supports_binding(binding_kind) {
            return Err(InjectError::UnsupportedBinding {
                adapter: self.name(),
                binding: super::binding_label(binding_kind),
            });
        }
        let Some(hi) = ctx.backend.spec.hi_cache.as_ref() else {
            return Err(InjectError::InvalidSpec {
                field: "spec.hiCache",
                detail: "required for type SGLangHiCache".to_string(),
            });
        };
        let original = engine_ref(pod, engine)?.clone();
        let cmd = EngineCommand::parse(&original, Runtime::SgLang)?;
        if let Some((variable, flag)) = cmd.hidden_flag(
            &original,
            &[
                "--enable-hierarchical-cache",
                "--hicache-",
                "--enable-lmcache",
                "--lmcache-config-file",
            ],
        ) {
            return Err(InjectError::HiddenFlag {
                container: original.name.clone(),
                variable,
                flag,
            });
        }
        let ov = ctx
            .backend
            .spec
            .integration
            .as_ref()
            .and_then(|i| i.engine_overrides.as_ref());
        let edits = edits(&cmd, hi, ov)?;
        let c = cmd.apply(&original, &edits)?;
        *engine_mut(pod, engine)? = c;
        Ok(InjectReport {
            warnings: cmd.warnings.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapters::providers::Binding;
    use ic_shared::crd::{
        CacheBackend, CacheBackendSpec, HiCacheIoBackend, HiCacheMemoryLayout, HiCacheWritePolicy,
    };
    use k8s_openapi::api::core::v1::{Container, PodSpec};

    fn pod(names: &[&str], args: &[&str]) -> Pod {
        Pod {
            spec: Some(PodSpec {
                containers: names
                    .iter()
                    .map(|n| Container {
                        name: n.to_string(),
                        command: Some(vec![
                            "python3".into(),
                            "-m".into(),
                            "sglang.launch_server".into(),
                        ]),
                        args: Some(args.iter().map(|s| s.to_string()).collect()),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn cb(hi: HiCacheSpec) -> CacheBackend {
        CacheBackend::new(
            "cb",
            CacheBackendSpec {
                runtime: Runtime::SgLang,
                type_: Some(CacheType::SGLangHiCache),
                hi_cache: Some(hi),
                ..Default::default()
            },
        )
    }

    fn ratio(r: &str) -> HiCacheSpec {
        HiCacheSpec {
            ratio: Some(r.into()),
            ..Default::default()
        }
    }

    fn run(p: &mut Pod, hi: HiCacheSpec) -> Result<InjectReport, InjectError> {
        let b = cb(hi);
        let i = SglangHiCache.select_engine(p)?;
        SglangHiCache.inject_engine_config(
            &InjectContext {
                backend: &b,
                binding: None,
                lmcache_worker_image: None,
                kernel_check_image: None,
            },
            p,
            i,
        )
    }

    fn args(p: &Pod, i: usize) -> Vec<String> {
        p.spec.as_ref().unwrap().containers[i].args.clone().unwrap()
    }

    #[test]
    fn renders_every_field() {
        let mut p = pod(&["anything"], &["--model-path", "Q"]);
        run(
            &mut p,
            HiCacheSpec {
                size_gb: Some(64),
                write_policy: Some(HiCacheWritePolicy::WriteThrough),
                io_backend: Some(HiCacheIoBackend::Kernel),
                memory_layout: Some(HiCacheMemoryLayout::PageFirst),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(
            args(&p, 0),
            vec![
                "--model-path",
                "Q",
                "--enable-hierarchical-cache",
                "--hicache-size",
                "64",
                "--hicache-write-policy",
                "write_through",
                "--hicache-io-backend",
                "kernel",
                "--hicache-mem-layout",
                "page_first"
            ]
        );
        let once = p.clone();
        run(
            &mut p,
            HiCacheSpec {
                size_gb: Some(64),
                write_policy: Some(HiCacheWritePolicy::WriteThrough),
                io_backend: Some(HiCacheIoBackend::Kernel),
                memory_layout: Some(HiCacheMemoryLayout::PageFirst),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(p, once);
    }

    #[test]
    fn matching_args_are_left_byte_for_byte() {
        let mut p = pod(
            &["e"],
            &["--hicache-ratio=2", "--enable-hierarchical-cache"],
        );
        run(&mut p, ratio("2.0")).unwrap();
        assert_eq!(
            args(&p, 0),
            vec!["--hicache-ratio=2", "--enable-hierarchical-cache"]
        );
    }

    #[test]
    fn multi_container_pods_need_an_sglang_container() {
        let mut p = pod(&["main", "engine"], &[]);
        assert_eq!(
            run(&mut p, ratio("2")).unwrap_err().to_string(),
            "SGLang HiCache: a multi-container pod must name its engine container \"sglang\" (containers: main, engine)"
        );
        let mut p = pod(&["main", "sglang"], &[]);
        run(&mut p, ratio("2")).unwrap();
        assert!(args(&p, 1).contains(&"--enable-hierarchical-cache".to_string()));
        assert!(args(&p, 0).is_empty());
    }

    #[test]
    fn conflicts_fail_without_partial_wiring() {
        for (a, want) in [
            (
                vec!["--hicache-ratio", "3"],
                "sets --hicache-ratio 3, the CacheBackend asks for 2",
            ),
            (
                vec!["--hicache-size", "10"],
                "sets --hicache-size 10, the CacheBackend asks for --hicache-ratio 2",
            ),
            (vec!["--hicache-ratio", "x"], "malformed --hicache-ratio"),
            (vec!["--hicache-ratio"], "--hicache-ratio has no value"),
            (
                vec!["--enable-hierarchical-cache=1"],
                "malformed --enable-hierarchical-cache",
            ),
            (
                vec!["--enable-hierarchical-cache", "--enable-hierarchical-cache"],
                "more than once",
            ),
            (vec!["--enable-lmcache"], "already sets --enable-lmcache"),
        ] {
            let mut p = pod(&["e"], &a);
            let before = p.clone();
            let err = run(&mut p, ratio("2")).unwrap_err();
            assert!(err.to_string().contains(want), "{err}");
            assert_eq!(p, before);
        }
    }

    #[test]
    fn only_host_only_bindings() {
        let b = Binding {
            kind: BindingKind::Resp,
            host: "r".into(),
            port: 1,
        };
        let backend = cb(ratio("2"));
        let mut p = pod(&["e"], &[]);
        assert!(matches!(
            SglangHiCache.inject_engine_config(
                &InjectContext {
                    backend: &backend,
                    binding: Some(&b),
                    lmcache_worker_image: None,
                    kernel_check_image: None
                },
                &mut p,
                0
            ),
            Err(InjectError::UnsupportedBinding { .. })
        ));
    }
}
