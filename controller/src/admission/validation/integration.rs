//! `spec.integration` rules (spec "Mooncake provider configuration": engine host networking;
//! "SGLang engine support": `spec.integration.role` support).

use ic_shared::crd::{CacheBackend, IntegrationRole, RemoteProvider, Runtime};

use super::{Rule, RuleContext, Violation};

/// The rules of this module, in order.
pub fn rules() -> Vec<Box<dyn Rule>> {
    vec![
        Box::new(EngineHostNetworkOnlyWhereNeeded),
        Box::new(SglangRoleReadWriteOnly),
        Box::new(MooncakeCommandKeepsFixedPorts),
    ]
}

fn is_mooncake(cb: &CacheBackend) -> bool {
    cb.spec
        .remote_storage
        .as_ref()
        .is_some_and(|r| r.provider == RemoteProvider::Mooncake)
}

/// Rule `engine_host_network_only_where_needed`: `spec.integration.engineHostNetwork: true` is
/// rejected unless `remoteStorage.provider` is Mooncake (the only backend whose transfer mesh
/// needs engine pods on the host network), so the privilege can never sit inert. On every
/// Mooncake apply without it, a warning: overlay engine pods transfer zero KV while the backend
/// reports Ready.
pub struct EngineHostNetworkOnlyWhereNeeded;

/// The warning sent on a Mooncake backend without `engineHostNetwork: true`.
pub const MOONCAKE_HOST_NETWORK_WARNING: &str = "spec.integration.engineHostNetwork is not set: \
Mooncake's transfer mesh is dialed from the engine, so engine pods on the pod network transfer \
zero KV while this backend reports Ready; set it to true and roll the engine workload";

impl Rule for EngineHostNetworkOnlyWhereNeeded {
    fn name(&self) -> &'static str {
        "engine_host_network_only_where_needed"
    }

    fn check(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<Violation> {
        let set = cb
            .spec
            .integration
            .as_ref()
            .and_then(|i| i.engine_host_network)
            .unwrap_or(false);
        if !set || is_mooncake(cb) {
            return Vec::new();
        }
        let what = match &cb.spec.remote_storage {
            Some(r) => format!("remoteStorage.provider {}", r.provider.as_str()),
            None => "a backend without remote storage".to_string(),
        };
        vec![Violation::forbidden(
            "spec.integration.engineHostNetwork",
            format!(
                "only Mooncake remote storage needs engine pods on the host network; {what} does \
                 not, so the flag would only grant an unused privilege"
            ),
        )]
    }

    fn warnings(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<String> {
        if is_mooncake(cb) && !cb.spec.engine_host_network() {
            vec![MOONCAKE_HOST_NETWORK_WARNING.to_string()]
        } else {
            Vec::new()
        }
    }
}

/// Rule `sglang_role_read_write_only` (the spec's `rejectUnsupportedSGLangRole`): SGLang's cache
/// integrations have no producer/consumer split, so `spec.integration.role` must be ReadWrite
/// (the default) with `runtime: SGLang`.
pub struct SglangRoleReadWriteOnly;

impl Rule for SglangRoleReadWriteOnly {
    fn name(&self) -> &'static str {
        "sglang_role_read_write_only"
    }

    fn check(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<Violation> {
        if cb.spec.runtime != Runtime::SgLang {
            return Vec::new();
        }
        let role = cb.spec.integration.as_ref().and_then(|i| i.role);
        let shown = match role {
            Some(IntegrationRole::ReadOnly) => "ReadOnly",
            Some(IntegrationRole::WriteOnly) => "WriteOnly",
            _ => return Vec::new(),
        };
        vec![Violation::not_supported_detail(
            "spec.integration.role",
            shown,
            "SGLang has no kv_role split (it always both stores and retrieves); supported \
             values: \"ReadWrite\"",
        )]
    }
}

/// Rule `mooncake_command_keeps_fixed_ports` (warning only): the rendered Service, readiness
/// probe, status endpoint and engine binding use the master's RPC port 50051 and HTTP metadata
/// port 8080, so a `remoteStorage.mooncake.command` that moves them is warned about.
pub struct MooncakeCommandKeepsFixedPorts;

impl Rule for MooncakeCommandKeepsFixedPorts {
    fn name(&self) -> &'static str {
        "mooncake_command_keeps_fixed_ports"
    }

    fn check(&self, _cb: &CacheBackend, _ctx: &RuleContext) -> Vec<Violation> {
        Vec::new()
    }

    fn warnings(&self, cb: &CacheBackend, _ctx: &RuleContext) -> Vec<String> {
        let Some(cmd) = cb
            .spec
            .remote_storage
            .as_ref()
            .and_then(|r| r.mooncake.as_ref())
            .and_then(|m| m.command.as_ref())
        else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (flag, fixed) in [
            ("--rpc_port", "50051"),
            ("--http_metadata_server_port", "8080"),
        ] {
            let mut i = 0;
            while i < cmd.len() {
                let token = cmd[i].as_str();
                let value = if let Some(v) = token.strip_prefix(&format!("{flag}=")) {
                    Some(v)
                } else if token == flag {
                    cmd.get(i + 1).map(String::as_str)
                } else {
                    None
                };
                if let Some(v) = value.filter(|v| *v != fixed) {
                    out.push(format!(
                        "spec.remoteStorage.mooncake.command sets {flag}={v}, but the Service, \
                         readiness probe, status endpoint and engine binding use {fixed}"
                    ));
                }
                i += 1;
            }
        }
        out
    }
}
