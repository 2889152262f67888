//! `ic-controller`: thin binary over the `ic_controller` library.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use ic_shared::proto::{router_service_client::RouterServiceClient, LookupRouteRequest};
use ic_shared::telemetry::{self, LogFormat};

/// inference-cache controller: KV-prefix index, agent ingest, router (and, in cluster, the
/// CRDs' reconcilers and admission webhooks).
#[derive(Parser)]
#[command(name = "ic-controller", version, about, long_about = None)]
struct Cli {
    /// Log line format.
    #[arg(long, env = "IC_LOG_FORMAT", value_enum, default_value_t = LogFormat::Plain, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the index, agent ingest, router and HTTP endpoints on this machine, without a cluster.
    Standalone(StandaloneArgs),
    /// Write the CustomResourceDefinitions (one YAML file per CRD).
    Crds {
        /// Output directory.
        #[arg(long, env = "IC_CRDS_OUT", default_value = "chart/crds")]
        out: PathBuf,
    },
    /// Ask a running controller's RouterService where a prompt's prefix is cached.
    Lookup(LookupArgs),
}

#[derive(clap::Args)]
struct StandaloneArgs {
    /// gRPC listen address: AgentService (agents), RouterService (gateways), grpc.health.v1.
    #[arg(long, env = "IC_GRPC_ADDR", default_value = "127.0.0.1:50051")]
    grpc_addr: SocketAddr,
    /// HTTP listen address: /healthz, /readyz, /metrics, /snapshot, /v1/nodes.
    #[arg(long, env = "IC_HTTP_ADDR", default_value = "127.0.0.1:8080")]
    http_addr: SocketAddr,
    /// Seconds a disconnected agent's index entries are kept before they are dropped.
    #[arg(long, env = "IC_AGENT_EXPIRY_SECONDS", default_value_t = 120)]
    agent_expiry_seconds: u64,
    /// LookupRoute answers NO_HINT for matches shorter than this many tokens
    /// (CachePolicy.spec.minimumPrefixTokens in cluster).
    #[arg(long, env = "IC_MINIMUM_PREFIX_TOKENS", default_value_t = 0)]
    minimum_prefix_tokens: u32,
}

#[derive(clap::Args)]
struct LookupArgs {
    /// Controller gRPC URL.
    #[arg(long, env = "IC_CONTROLLER", default_value = "http://127.0.0.1:50051")]
    controller: String,
    /// Prompt token ids: a comma list ("1,2,3") and/or ranges ("0..32" = 0 to 31).
    #[arg(long)]
    tokens: String,
    /// Tenant (namespace); empty matches any.
    #[arg(long, default_value = "")]
    tenant: String,
    /// Model id; empty matches any.
    #[arg(long, default_value = "")]
    model: String,
    /// Hash scheme (vllm|sglang); empty matches any.
    #[arg(long, default_value = "")]
    hash_scheme: String,
    /// LoRA adapter name; empty = base model.
    #[arg(long, default_value = "")]
    adapter: String,
    /// Block size in tokens; 0 = every size registered for the scheme.
    #[arg(long, default_value_t = 0)]
    block_size: u32,
}

fn parse_tokens(spec: &str) -> anyhow::Result<Vec<u32>> {
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if let Some((a, b)) = part.split_once("..") {
            let a: u32 = a
                .trim()
                .parse()
                .with_context(|| format!("bad range start in {part:?}"))?;
            let b: u32 = b
                .trim()
                .parse()
                .with_context(|| format!("bad range end in {part:?}"))?;
            out.extend(a..b);
        } else {
            out.push(
                part.parse()
                    .with_context(|| format!("bad token id {part:?}"))?,
            );
        }
    }
    if out.is_empty() {
        bail!("--tokens names no token ids");
    }
    Ok(out)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    telemetry::init(cli.log_format);
    match cli.command {
        Command::Standalone(a) => {
            let cfg = ic_controller::standalone::StandaloneConfig {
                grpc_addr: a.grpc_addr,
                http_addr: a.http_addr,
                agent_expiry: Duration::from_secs(a.agent_expiry_seconds),
                policy: ic_controller::state::LookupPolicy {
                    minimum_prefix_tokens: a.minimum_prefix_tokens,
                },
            };
            let running = ic_controller::standalone::start(cfg, async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await?;
            running.wait().await?;
        }
        Command::Crds { out } => {
            for path in ic_controller::crdgen::write(&out)
                .with_context(|| format!("writing CRDs into {}", out.display()))?
            {
                println!("{}", path.display());
            }
        }
        Command::Lookup(a) => {
            let channel = tonic::transport::Endpoint::from_shared(a.controller.clone())
                .with_context(|| format!("invalid controller URL {:?}", a.controller))?
                .connect()
                .await
                .with_context(|| format!("connecting to {}", a.controller))?;
            let mut client = RouterServiceClient::new(channel);
            let resp = client
                .lookup_route(LookupRouteRequest {
                    tenant: a.tenant,
                    model: a.model,
                    hash_scheme: a.hash_scheme,
                    adapter: a.adapter,
                    token_ids: parse_tokens(&a.tokens)?,
                    content_keys: vec![],
                    block_size: a.block_size,
                })
                .await?
                .into_inner();
            println!("{}", serde_json::to_string_pretty(&lookup_json(&resp))?);
        }
    }
    Ok(())
}

fn lookup_json(r: &ic_shared::proto::LookupRouteResponse) -> serde_json::Value {
    use ic_shared::proto::{Decision, Tier};
    let decision = Decision::try_from(r.decision)
        .map(|d| d.as_str_name())
        .unwrap_or("DECISION_UNSPECIFIED");
    serde_json::json!({
        "decision": decision,
        "reason": r.reason,
        "blockSize": r.block_size,
        "requestBlocks": r.request_blocks,
        "replicas": r.replicas.iter().map(|m| serde_json::json!({
            "replica": m.replica,
            "streamId": m.stream_id,
            "node": m.node,
            "dpRank": m.dp_rank,
            "matchedBlocks": m.matched_blocks,
            "matchedTokens": m.matched_tokens,
            "tier": Tier::try_from(m.tier).map(|t| t.as_str_name()).unwrap_or("TIER_UNSPECIFIED"),
            "backend": m.backend,
        })).collect::<Vec<_>>(),
    })
}
