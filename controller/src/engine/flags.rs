//! What the engine's flags mean, read from its arguments (the logical argument list of
//! [`EngineCommand`]): flag lookup in every spelling ([`flag_value`], [`flag_set`]), the KV block
//! size ([`engine_block_size`]), tensor parallelism ([`tensor_parallel`]), the data-parallel
//! ranks whose publishers run in the pod ([`dp_ranks`], [`resolved_rank_args`]), the HTTP port and
//! the Prometheus endpoint ([`engine_metrics_url`]), and the raw `--kv-events-config`
//! ([`kv_events_config_arg`], parsed by [`super::kv_events::KvEventsConfig::parse`]).

use ic_shared::crd::Runtime;
use k8s_openapi::api::core::v1::{Container, Pod};
use kube::ResourceExt;

use super::command::{normalize_flag, CommandForm, EngineCommand};
use super::kv_events::{host_for, is_loopback, is_wildcard, KV_EVENTS_CONFIG_FLAG};
use super::{host_network, pod_ip};

/// vLLM's default `--block-size`.
pub const VLLM_DEFAULT_BLOCK_SIZE: u32 = 16;
/// SGLang's default `--page-size`.
pub const SGLANG_DEFAULT_PAGE_SIZE: u32 = 1;
/// vLLM's default `--port` (its OpenAI server also serves `/metrics`).
pub const VLLM_DEFAULT_PORT: u16 = 8000;
/// SGLang's default `--port`.
pub const SGLANG_DEFAULT_PORT: u16 = 30000;

/// The value of the last occurrence of any of `names` (long flags in any `_`/`-` spelling,
/// `--flag value` or `--flag=value`; short aliases such as `-tp` verbatim).
pub fn flag_value(args: &[&str], names: &[&str]) -> Option<String> {
    let wanted: Vec<String> = names.iter().map(|n| normalize_flag(n)).collect();
    let mut found = None;
    let mut i = 0;
    while i < args.len() {
        let a = args[i];
        if a.starts_with('-') {
            let (name, inline) = match a.split_once('=') {
                Some((n, v)) => (n, Some(v)),
                None => (a, None),
            };
            if wanted.contains(&normalize_flag(name)) {
                match inline {
                    Some(v) => found = Some(v.to_string()),
                    None => {
                        if let Some(next) = args.get(i + 1) {
                            if !next.starts_with("--") {
                                found = Some((*next).to_string());
                                i += 1;
                            }
                        }
                    }
                }
            }
        }
        i += 1;
    }
    found
}

/// True when any of `names` occurs as a boolean flag (`--flag`, `--flag=true`).
pub fn flag_set(args: &[&str], names: &[&str]) -> bool {
    let wanted: Vec<String> = names.iter().map(|n| normalize_flag(n)).collect();
    args.iter().any(|a| {
        let (name, inline) = match a.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (*a, None),
        };
        wanted.contains(&normalize_flag(name))
            && inline
                .is_none_or(|v| matches!(v.to_ascii_lowercase().as_str(), "true" | "1" | "yes"))
    })
}

/// [`flag_value`] as a `u32` (`None` when absent or not a literal number).
pub fn flag_u32(args: &[&str], names: &[&str]) -> Option<u32> {
    flag_value(args, names).and_then(|v| v.trim().parse().ok())
}

/// The raw value of the engine's last `--kv-events-config` (any spelling), if given.
pub fn kv_events_config_arg(args: &[&str]) -> Option<String> {
    flag_value(args, &[KV_EVENTS_CONFIG_FLAG])
}

/// The engine's last `--kv-events-config` as written in `cmd` (the last one, as argparse keeps
/// it), and whether its value is opaque (a shell expansion the webhook cannot see through).
/// `None` when the flag is absent or has no value.
pub fn kv_events_config_raw(cmd: &EngineCommand) -> Option<(String, bool)> {
    let occ = cmd.find(KV_EVENTS_CONFIG_FLAG).into_iter().last()?;
    let (raw, value_index) = cmd.value_of(&occ)?;
    let opaque = cmd.is_opaque(value_index.unwrap_or(occ.index));
    Some((raw, opaque))
}

/// The engine's last `--kv-events-config` as JSON when its value is literal JSON (any object
/// shape: the caller reads the keys it needs); `None` when absent or not JSON.
pub fn kv_events_config_json(cmd: &EngineCommand) -> Option<serde_json::Value> {
    let (raw, _) = kv_events_config_raw(cmd)?;
    serde_json::from_str(&raw).ok()
}

/// Whether SGLang runs data-parallel attention (`--enable-dp-attention`): only then does it run
/// one KV-event publisher per data-parallel rank.
pub fn dp_attention(args: &[&str]) -> bool {
    flag_set(args, &["--enable-dp-attention"])
}

/// The model a vLLM engine serves: `--model` (its last occurrence), else the first positional
/// argument.
pub fn served_model(cmd: &EngineCommand) -> Option<String> {
    if let Some(occ) = cmd.find("--model").into_iter().last() {
        return cmd.value_of(&occ).map(|(v, _)| v);
    }
    cmd.literal_texts()
        .first()
        .filter(|t| !t.starts_with('-'))
        .map(|t| t.to_string())
}

/// The engine's default HTTP `--port` ([`VLLM_DEFAULT_PORT`], [`SGLANG_DEFAULT_PORT`]).
pub fn default_http_port(runtime: Runtime) -> u16 {
    match runtime {
        Runtime::Vllm => VLLM_DEFAULT_PORT,
        Runtime::SgLang => SGLANG_DEFAULT_PORT,
    }
}

/// The engine's HTTP port as the Pod webhook reserves it: `--port` when it is a literal port
/// number, else the runtime's default ([`default_http_port`]).
pub fn http_port(runtime: Runtime, args: &[&str]) -> u16 {
    flag_value(args, &["--port"])
        .and_then(|v| v.trim().parse::<u16>().ok())
        .unwrap_or(default_http_port(runtime))
}

/// The value of the first data-parallel size or rank flag, in either engine's spelling
/// (`--data-parallel-size`, `-dp`, `--data-parallel-size-local`, `-dpl`,
/// `--data-parallel-start-rank`, `-dpr`, `--data-parallel-rank`, `-dpn`, `--dp-size`, `--dp`),
/// that is not a literal number: the ranks (and so the publishers' ports) are then known only
/// when the engine starts. `None` when every such flag is literal or absent.
pub fn non_literal_dp_flag(args: &[&str]) -> Option<String> {
    [
        "--data-parallel-size",
        "-dp",
        "--data-parallel-size-local",
        "-dpl",
        "--data-parallel-start-rank",
        "-dpr",
        "--data-parallel-rank",
        "-dpn",
        "--dp-size",
        "--dp",
    ]
    .iter()
    .find_map(|f| flag_value(args, &[f]))
    .filter(|v| v.trim().parse::<u32>().is_err())
}

/// The flags [`dp_ranks`] reads for `runtime`.
fn rank_flags(runtime: Runtime) -> &'static [&'static str] {
    match runtime {
        Runtime::Vllm => &[
            "--data-parallel-rank",
            "-dpn",
            "--data-parallel-start-rank",
            "-dpr",
            "--data-parallel-size-local",
            "-dpl",
            "--data-parallel-size",
            "-dp",
        ],
        Runtime::SgLang => &[
            "--node-rank",
            "--nnodes",
            "--data-parallel-size",
            "--dp-size",
            "--dp",
        ],
    }
}

/// The engine arguments [`dp_ranks`] should read: every argument of `cmd` (shell expansions
/// included), with the value of each rank flag ([`rank_flags`]) that is a variable resolved
/// from the engine container's env the way the pod resolves it — a literal `value`, or a
/// `fieldRef` to the pod's own `metadata.name`, `metadata.namespace`,
/// `metadata.labels['…']` or `metadata.annotations['…']` (a StatefulSet's
/// `apps.kubernetes.io/pod-index`, a LeaderWorkerSet's worker index). `$(VAR)` is the
/// kubelet's (any command form); `$VAR` and `${VAR}` only a shell's. The second element lists
/// the `flag value` pairs that stay unknown; those flags are left out of the returned
/// arguments (so [`dp_ranks`] falls back to its defaults for them).
pub fn resolved_rank_args(
    pod: &Pod,
    c: &Container,
    cmd: &EngineCommand,
    runtime: Runtime,
) -> (Vec<String>, Vec<String>) {
    let texts = cmd.texts();
    let flags: Vec<String> = rank_flags(runtime)
        .iter()
        .map(|f| normalize_flag(f))
        .collect();
    let shell = cmd.form == CommandForm::Shell;
    let mut out = Vec::with_capacity(texts.len());
    let mut unknown = Vec::new();
    let mut i = 0;
    while i < texts.len() {
        let a = texts[i];
        let (name, inline) = match a.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (a, None),
        };
        let is_rank_flag = a.starts_with('-') && flags.contains(&normalize_flag(name));
        if !is_rank_flag {
            out.push(a.to_string());
            i += 1;
            continue;
        }
        let (value, consumed) = match inline {
            Some(v) => (Some(v), 1),
            None => match texts.get(i + 1) {
                Some(v) if !v.starts_with("--") => (Some(*v), 2),
                _ => (None, 1),
            },
        };
        match value {
            Some(v) if v.trim().parse::<u32>().is_err() => {
                match resolve_env_ref(pod, c, v.trim(), shell) {
                    Some(r) if r.trim().parse::<u32>().is_ok() => {
                        out.push(name.to_string());
                        out.push(r.trim().to_string());
                    }
                    _ => unknown.push(format!("{name} {v}")),
                }
            }
            Some(v) => {
                out.push(name.to_string());
                out.push(v.to_string());
            }
            None => out.push(a.to_string()),
        }
        i += consumed;
    }
    (out, unknown)
}

/// The value of `text` when it is exactly one variable reference (`$(VAR)`; with `shell` also
/// `$VAR`, `${VAR}`, optionally double-quoted) to an env entry of `c` the plan can evaluate
/// ([`resolved_rank_args`]).
fn resolve_env_ref(pod: &Pod, c: &Container, text: &str, shell: bool) -> Option<String> {
    let text = text.trim_matches('"');
    let var = if let Some(v) = text.strip_prefix("$(").and_then(|t| t.strip_suffix(')')) {
        v
    } else if !shell {
        return None;
    } else if let Some(v) = text.strip_prefix("${").and_then(|t| t.strip_suffix('}')) {
        v
    } else {
        text.strip_prefix('$')?
    };
    if var.is_empty()
        || !var
            .chars()
            .all(|ch| ch.is_ascii_alphanumeric() || ch == '_')
    {
        return None;
    }
    // The last entry of a name is the one the container gets.
    let e = c.env.iter().flatten().rev().find(|e| e.name == var)?;
    if let Some(from) = &e.value_from {
        let path = from.field_ref.as_ref()?.field_path.as_str();
        return pod_field(pod, path);
    }
    e.value.clone()
}

/// A `fieldRef` path of the pod's metadata (`metadata.name`, `metadata.namespace`,
/// `metadata.labels['k']`, `metadata.annotations['k']`).
fn pod_field(pod: &Pod, path: &str) -> Option<String> {
    let keyed = |prefix: &str| {
        path.strip_prefix(prefix)?
            .strip_prefix("['")?
            .strip_suffix("']")
            .map(str::to_string)
    };
    match path {
        "metadata.name" => pod.metadata.name.clone(),
        "metadata.namespace" => pod.metadata.namespace.clone(),
        _ => {
            if let Some(k) = keyed("metadata.labels") {
                pod.labels().get(&k).cloned()
            } else if let Some(k) = keyed("metadata.annotations") {
                pod.annotations().get(&k).cloned()
            } else {
                None
            }
        }
    }
}

/// The global data-parallel ranks whose publishers run in this pod.
pub fn dp_ranks(runtime: Runtime, args: &[&str]) -> Vec<u32> {
    match runtime {
        Runtime::Vllm => {
            if let Some(r) = flag_u32(args, &["--data-parallel-rank", "-dpn"]) {
                return vec![r];
            }
            let size = flag_u32(args, &["--data-parallel-size", "-dp"])
                .unwrap_or(1)
                .max(1);
            let local = flag_u32(args, &["--data-parallel-size-local", "-dpl"])
                .unwrap_or(size)
                .max(1);
            let start = flag_u32(args, &["--data-parallel-start-rank", "-dpr"]).unwrap_or(0);
            (start..start.saturating_add(local)).collect()
        }
        Runtime::SgLang => {
            if !dp_attention(args) {
                return vec![0];
            }
            let size = flag_u32(args, &["--data-parallel-size", "--dp-size", "--dp"])
                .unwrap_or(1)
                .max(1);
            let nnodes = flag_u32(args, &["--nnodes"]).unwrap_or(1).max(1);
            let node_rank = flag_u32(args, &["--node-rank"]).unwrap_or(0);
            let per_node = (size / nnodes).max(1);
            let start = node_rank.saturating_mul(per_node);
            (start..start.saturating_add(per_node)).collect()
        }
    }
}

/// The flag that sets the engine's KV block size in tokens: vLLM `--block-size`, SGLang
/// `--page-size`.
pub fn block_size_flag(runtime: Runtime) -> &'static str {
    match runtime {
        Runtime::Vllm => "--block-size",
        Runtime::SgLang => "--page-size",
    }
}

/// The engine's KV block size in tokens from its (literal) arguments: [`block_size_flag`]'s
/// value, else the engine's default ([`VLLM_DEFAULT_BLOCK_SIZE`], [`SGLANG_DEFAULT_PAGE_SIZE`]);
/// at least 1. The node plan and the Pod webhook's kvevent-subscriber both chain at it.
pub fn engine_block_size(runtime: Runtime, args: &[&str]) -> u32 {
    let default = match runtime {
        Runtime::Vllm => VLLM_DEFAULT_BLOCK_SIZE,
        Runtime::SgLang => SGLANG_DEFAULT_PAGE_SIZE,
    };
    flag_u32(args, &[block_size_flag(runtime)])
        .unwrap_or(default)
        .max(1)
}

/// The raw value of the engine's block-size flag ([`block_size_flag`], its last occurrence) when
/// it is given but is not a literal number: a shell expansion (`$BLOCK`, `$(BLOCK)`), or text no
/// integer parses from. Neither admission nor the node plan can know the size then; both assume
/// the engine's bare default (`engine_block_size(runtime, &[])`: an earlier literal value does
/// not win over a later expansion) and say so — the Pod webhook as an admission warning, the
/// plan (when it plans KV events) as [`crate::reconcile::nodes::plans::issue::BLOCK_SIZE_UNKNOWN`]. `None` when the flag is
/// absent (the engine's default is then the truth) or literal.
pub fn unknown_block_size(cmd: &EngineCommand, runtime: Runtime) -> Option<String> {
    cmd.find(block_size_flag(runtime)).last().and_then(|occ| {
        let (raw, index) = cmd.value_of(occ)?;
        let opaque = index.is_some_and(|i| cmd.is_opaque(i)) || raw.contains('$');
        (opaque || raw.trim().parse::<u32>().is_err()).then_some(raw)
    })
}

/// Tensor-parallel size from the engine args (default 1).
pub fn tensor_parallel(runtime: Runtime, args: &[&str]) -> u32 {
    let names: &[&str] = match runtime {
        Runtime::Vllm => &["--tensor-parallel-size", "-tp"],
        Runtime::SgLang => &["--tensor-parallel-size", "--tp-size", "--tp"],
    };
    flag_u32(args, names).unwrap_or(1).max(1)
}

/// The engine's Prometheus endpoint, `http://<host>:<port>/metrics`, as the node agent can
/// reach it; `args` are every engine argument (shell expansions included, so an unknown
/// `--port $PORT` plans nothing rather than a wrong port).
///
/// Port: `--port` (vLLM default [`VLLM_DEFAULT_PORT`], SGLang [`SGLANG_DEFAULT_PORT`]). Host:
/// the pod IP when the server binds every interface (vLLM's default; `0.0.0.0`, `::`) or an
/// address from an expansion (`$(POD_IP)`); the loopback address only for hostNetwork pods
/// (none otherwise: the agent cannot reach a pod's loopback); another literal host as given.
/// SGLang binds `127.0.0.1` by default and serves `/metrics` only with `--enable-metrics`.
pub fn engine_metrics_url(pod: &Pod, runtime: Runtime, args: &[&str]) -> Option<String> {
    if runtime == Runtime::SgLang && !flag_set(args, &["--enable-metrics"]) {
        return None;
    }
    let port = match flag_value(args, &["--port"]) {
        Some(v) => v.trim().parse::<u16>().ok().filter(|p| *p > 0)?,
        None => match runtime {
            Runtime::Vllm => VLLM_DEFAULT_PORT,
            Runtime::SgLang => SGLANG_DEFAULT_PORT,
        },
    };
    let host = flag_value(args, &["--host"]).map(|h| h.trim().to_string());
    let host = match host.as_deref() {
        None if runtime == Runtime::SgLang => Some("127.0.0.1"),
        h => h,
    };
    let host = match host {
        Some(h) if is_loopback(h) => {
            if !host_network(pod) {
                return None;
            }
            host_for(h.trim_start_matches('[').trim_end_matches(']'))
        }
        Some(h) if !h.is_empty() && !is_wildcard(h) && h != "0.0.0.0" && !h.contains('$') => {
            host_for(h.trim_start_matches('[').trim_end_matches(']'))
        }
        _ => host_for(&pod_ip(pod)?),
    };
    Some(format!("http://{host}:{port}/metrics"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn flags_in_every_spelling() {
        let args = [
            "--tp",
            "2",
            "--kv_events_config={}",
            "-dp",
            "4",
            "--block-size=32",
        ];
        assert_eq!(
            flag_value(&args, &["--tp-size", "--tp"]).as_deref(),
            Some("2")
        );
        assert_eq!(
            flag_value(&args, &["--kv-events-config"]).as_deref(),
            Some("{}")
        );
        assert_eq!(flag_u32(&args, &["--data-parallel-size", "-dp"]), Some(4));
        assert_eq!(flag_u32(&args, &["--block-size"]), Some(32));
        assert!(flag_set(
            &["--enable-dp-attention"],
            &["--enable-dp-attention"]
        ));
        assert!(!flag_set(
            &["--enable-dp-attention=false"],
            &["--enable-dp-attention"]
        ));
    }

    #[test]
    fn dp_ranks_per_engine() {
        assert_eq!(dp_ranks(Runtime::Vllm, &[]), vec![0]);
        assert_eq!(dp_ranks(Runtime::Vllm, &["-dp", "4"]), vec![0, 1, 2, 3]);
        assert_eq!(
            dp_ranks(
                Runtime::Vllm,
                &[
                    "--data-parallel-size",
                    "4",
                    "--data-parallel-size-local",
                    "2",
                    "--data-parallel-start-rank",
                    "2"
                ]
            ),
            vec![2, 3]
        );
        assert_eq!(
            dp_ranks(
                Runtime::Vllm,
                &["--data-parallel-size", "4", "--data-parallel-rank", "3"]
            ),
            vec![3]
        );
        assert_eq!(dp_ranks(Runtime::SgLang, &["--dp-size", "4"]), vec![0]);
        assert_eq!(
            dp_ranks(
                Runtime::SgLang,
                &["--dp-size", "4", "--enable-dp-attention"]
            ),
            vec![0, 1, 2, 3]
        );
        assert_eq!(
            dp_ranks(
                Runtime::SgLang,
                &[
                    "--dp-size",
                    "4",
                    "--enable-dp-attention",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    "1"
                ]
            ),
            vec![2, 3]
        );
    }
}
