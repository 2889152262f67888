//! Rules that consult the runtime-adapter [`Registry`](crate::adapters::Registry) (spec
//! "Validating": "Runtime/cache pair must be supported by an installed adapter", "Engine wire must
//! accept the provider binding", "spec.integration.engineOverrides cannot touch reserved
//! args/env"; "Reserved declarations and admission hard-reject").

use ic_shared::crd::CacheBackend;

use crate::adapters::{binding_label, providers, BindingKind, RuntimeAdapter};

use super::{path, Rule, RuleContext, Violation};

/// The rules of this module, in order.
pub fn rules() -> Vec<Box<dyn Rule>> {
    vec![
        Box::new(RuntimePairSupported),
        Box::new(EngineWireAcceptsBinding),
        Box::new(EngineOverridesNotReserved),
    ]
}

fn adapter<'a>(cb: &CacheBackend, ctx: &RuleContext<'a>) -> Option<&'a dyn RuntimeAdapter> {
    ctx.registry
        .lookup(cb.spec.runtime, cb.spec.effective_type())
}

fn pair(cb: &CacheBackend) -> String {
    format!(
        "{}/{}",
        cb.spec.runtime.as_str(),
        cb.spec.effective_type().as_str()
    )
}

/// Rule `runtime_pair_supported`: the (runtime, type) pair has a registered runtime adapter;
/// the rejection lists the registry's SupportedPairs.
pub struct RuntimePairSupported;

impl Rule for RuntimePairSupported {
    fn name(&self) -> &'static str {
        "runtime_pair_supported"
    }

    fn check(&self, cb: &CacheBackend, ctx: &RuleContext) -> Vec<Violation> {
        if adapter(cb, ctx).is_some() {
            return Vec::new();
        }
        let t = cb.spec.effective_type();
        vec![Violation::not_supported_detail(
            "spec.type",
            t.as_str(),
            format!(
                "no installed runtime adapter for runtime {} with type {}; supported pairs: {}",
                cb.spec.runtime.as_str(),
                t.as_str(),
                ctx.registry.supported_pairs_text()
            ),
        )]
    }
}

/// Rule `engine_wire_accepts_binding`: the pair's adapter accepts the binding the selected
/// provider emits (`lm`, `resp`, `mooncakestore`) or host-only when `remoteStorage` is omitted.
/// Native SGLang HiCache accepts only host-only. Skipped in EventsOnly mode (no connector is
/// wired; `events_only_forbids_remote_storage` reports remote storage there).
pub struct EngineWireAcceptsBinding;

const ALL_BINDINGS: [Option<BindingKind>; 4] = [
    None,
    Some(BindingKind::Lm),
    Some(BindingKind::Resp),
    Some(BindingKind::MooncakeStore),
];

impl Rule for EngineWireAcceptsBinding {
    fn name(&self) -> &'static str {
        "engine_wire_accepts_binding"
    }

    fn check(&self, cb: &CacheBackend, ctx: &RuleContext) -> Vec<Violation> {
        if cb.spec.is_events_only() {
            return Vec::new();
        }
        let Some(a) = adapter(cb, ctx) else {
            return Vec::new();
        };
        let binding = cb
            .spec
            .remote_storage
            .as_ref()
            .map(|r| providers::provider(r.provider).binding_kind());
        if a.supports_binding(binding) {
            return Vec::new();
        }
        let accepted = ALL_BINDINGS
            .into_iter()
            .filter(|b| a.supports_binding(*b))
            .map(binding_label)
            .collect::<Vec<_>>()
            .join(", ");
        let accepted = if accepted.is_empty() {
            "none".to_string()
        } else {
            accepted
        };
        match &cb.spec.remote_storage {
            Some(rs) => vec![Violation::not_supported_detail(
                "spec.remoteStorage.provider",
                rs.provider.as_str(),
                format!(
                    "runtime adapter {} ({}) does not accept a {} binding; it accepts: {accepted}",
                    a.name(),
                    pair(cb),
                    binding_label(binding)
                ),
            )],
            None => vec![Violation::required(
                "spec.remoteStorage",
                format!(
                    "runtime adapter {} ({}) needs remote storage; it accepts: {accepted}",
                    a.name(),
                    pair(cb)
                ),
            )],
        }
    }
}

/// The leading flag token of an engineOverrides arg entry (`--flag=value`, `--flag value`,
/// `--flag`), normalised so that `--kv_transfer_config` and `--kv-transfer-config` compare
/// equal (vLLM and SGLang accept both spellings).
pub fn normalise_flag(entry: &str) -> String {
    let token = entry
        .trim()
        .split(|c: char| c == '=' || c.is_whitespace())
        .next()
        .unwrap_or("");
    match token.strip_prefix("--") {
        Some(name) => format!("--{}", name.replace('_', "-")),
        None => token.to_string(),
    }
}

/// Rule `engine_overrides_not_reserved`: no `engineOverrides.args`/`suppressArgs` entry may
/// name one of the adapter's ReservedArgs, and no `engineOverrides.env`/`suppressEnv` entry one of
/// its ReservedEnv. The rejection names the flag or variable and the adapter.
pub struct EngineOverridesNotReserved;

impl Rule for EngineOverridesNotReserved {
    fn name(&self) -> &'static str {
        "engine_overrides_not_reserved"
    }

    fn check(&self, cb: &CacheBackend, ctx: &RuleContext) -> Vec<Violation> {
        let Some(ov) = cb
            .spec
            .integration
            .as_ref()
            .and_then(|i| i.engine_overrides.as_ref())
        else {
            return Vec::new();
        };
        let Some(a) = adapter(cb, ctx) else {
            return Vec::new();
        };
        let reserved_args: Vec<String> = a
            .reserved_args()
            .iter()
            .map(|f| normalise_flag(f))
            .collect();
        let reserved_env = a.reserved_env();
        let base = "spec.integration.engineOverrides";
        let mut out = Vec::new();
        let flag_msg = |flag: &str, verb: &str| {
            format!(
                "flag {flag:?} is reserved by runtime adapter {} ({}) and cannot be {verb}; to \
                 leave a pod unwired use the inferencecache.io/skip-inject annotation",
                a.name(),
                pair(cb)
            )
        };
        let env_msg = |name: &str, verb: &str| {
            format!(
                "env var {name:?} is reserved by runtime adapter {} ({}) and cannot be {verb}; to \
                 leave a pod unwired use the inferencecache.io/skip-inject annotation",
                a.name(),
                pair(cb)
            )
        };
        for (i, entry) in ov.args.iter().enumerate() {
            let flag = normalise_flag(entry);
            if reserved_args.contains(&flag) {
                out.push(Violation::forbidden(
                    path::index(&format!("{base}.args"), i),
                    flag_msg(&flag, "overridden"),
                ));
            }
        }
        for (i, entry) in ov.suppress_args.iter().enumerate() {
            let flag = normalise_flag(entry);
            if reserved_args.contains(&flag) {
                out.push(Violation::forbidden(
                    path::index(&format!("{base}.suppressArgs"), i),
                    flag_msg(&flag, "suppressed"),
                ));
            }
        }
        for (i, env) in ov.env.iter().enumerate() {
            if reserved_env.contains(&env.name.as_str()) {
                out.push(Violation::forbidden(
                    format!("{}.name", path::index(&format!("{base}.env"), i)),
                    env_msg(&env.name, "overridden"),
                ));
            }
        }
        for (i, name) in ov.suppress_env.iter().enumerate() {
            if reserved_env.contains(&name.trim()) {
                out.push(Violation::forbidden(
                    path::index(&format!("{base}.suppressEnv"), i),
                    env_msg(name.trim(), "suppressed"),
                ));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalises_flag_spellings() {
        assert_eq!(
            normalise_flag("--kv-transfer-config"),
            "--kv-transfer-config"
        );
        assert_eq!(
            normalise_flag("--kv_transfer_config={}"),
            "--kv-transfer-config"
        );
        assert_eq!(
            normalise_flag(" --kv-transfer-config {\"a\":1}"),
            "--kv-transfer-config"
        );
        assert_eq!(normalise_flag("-x"), "-x");
    }
}
