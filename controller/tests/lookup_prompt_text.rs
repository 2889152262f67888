//! `RouterService.LookupRoute` with `prompt_text` over real gRPC against a standalone
//! controller (issue 19 item 1): the text is tokenized with the model's tokenizer
//! (`--tokenizer`), chunked and hashed as the agent keys the engine's blocks, and every way it
//! cannot be answered is NO_HINT with a reason, never an error. The tokenizer file is mounted
//! the way a ConfigMap volume is (`tokenizer.json -> ..data/tokenizer.json`, `..data` a symlink
//! swapped on update) and hot-reloaded; a bad update keeps the last good tokenizer.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use ic_controller::standalone::{self, Running, StandaloneConfig};
use ic_controller::tokenize::{TokenizerConfig, TokenizerSpec};
use ic_shared::kv::content_key::chain;
use ic_shared::proto::{
    self, router_service_client::RouterServiceClient, Decision, LookupRouteRequest,
    LookupRouteResponse,
};
use tonic::transport::Channel;

const DEEPSEEK: &str = "deepseek-ai/DeepSeek-V4-Flash";
const SWAPPED: &str = "team/swapped-model";
const MISSING: &str = "team/missing-model";
const BLOCK: usize = 16;

fn testdata(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/tokenizers")
        .join(rel)
}

/// The `long` case of a tokenizer's reference: its text and the engine's ids.
fn long_case(name: &str) -> (String, Vec<u32>) {
    let r: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(testdata(name).join("reference.json")).unwrap(),
    )
    .unwrap();
    let c = r["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "long" && c["add_special_tokens"] == true)
        .unwrap();
    (
        c["text"].as_str().unwrap().to_string(),
        serde_json::from_value(c["ids"].clone()).unwrap(),
    )
}

/// A ConfigMap volume as the kubelet lays it out: `..<ts>/tokenizer.json`, `..data -> ..<ts>`,
/// `tokenizer.json -> ..data/tokenizer.json`. Each update writes a new `..<ts>` and swaps
/// `..data` with a rename.
struct ConfigMapDir {
    dir: tempfile::TempDir,
    version: u32,
}

impl ConfigMapDir {
    fn new(content: &[u8]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut d = ConfigMapDir { dir, version: 0 };
        d.update(content);
        std::os::unix::fs::symlink("..data/tokenizer.json", d.path()).unwrap();
        d
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("tokenizer.json")
    }

    fn update(&mut self, content: &[u8]) {
        self.version += 1;
        let ts = format!("..2026_12_01_00_00_0{}", self.version);
        std::fs::create_dir(self.dir.path().join(&ts)).unwrap();
        std::fs::write(self.dir.path().join(&ts).join("tokenizer.json"), content).unwrap();
        let tmp = self.dir.path().join("..data_tmp");
        std::os::unix::fs::symlink(&ts, &tmp).unwrap();
        std::fs::rename(&tmp, self.dir.path().join("..data")).unwrap();
    }
}

async fn start(swapped: &Path) -> Running {
    standalone::start(
        StandaloneConfig {
            tokenizers: TokenizerConfig {
                specs: vec![
                    TokenizerSpec {
                        model: DEEPSEEK.into(),
                        path: testdata("deepseek-v4/tokenizer.json"),
                    },
                    TokenizerSpec {
                        model: SWAPPED.into(),
                        path: swapped.to_path_buf(),
                    },
                    TokenizerSpec {
                        model: MISSING.into(),
                        path: "/nonexistent/tokenizer.json".into(),
                    },
                ],
                reload_interval: Duration::from_millis(50),
            },
            ..StandaloneConfig::ephemeral()
        },
        std::future::pending(),
    )
    .await
    .unwrap()
}

/// An engine replica of `model` holding `ids` (full blocks) in GPU memory, keyed as the agent
/// keys the engine's BlockStored token ids.
fn engine_holds(running: &Running, model: &str, pod: &str, ids: &[u32]) {
    let desc = proto::StreamDescriptor {
        stream_id: format!("team/{pod}#0"),
        replica: pod.into(),
        tenant: "team".into(),
        model: model.into(),
        hash_scheme: "vllm".into(),
        ..Default::default()
    };
    running.shared.index.write().resync_node(
        pod,
        &[proto::StreamSnapshot {
            stream: Some(desc),
            coverage: proto::Coverage::Exact as i32,
            entries: chain(ids, BLOCK)
                .into_iter()
                .map(|k| proto::BlockEntry {
                    block_size: BLOCK as u32,
                    content_key: k,
                    tier: proto::Tier::T1 as i32,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }],
    );
}

async fn client(running: &Running) -> RouterServiceClient<Channel> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", running.grpc_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    RouterServiceClient::new(ch).max_encoding_message_size(8 << 20)
}

fn text_req(model: &str, text: &str) -> LookupRouteRequest {
    LookupRouteRequest {
        tenant: "team".into(),
        model: model.into(),
        prompt_text: Some(text.into()),
        ..Default::default()
    }
}

async fn ask(c: &mut RouterServiceClient<Channel>, req: LookupRouteRequest) -> LookupRouteResponse {
    c.lookup_route(req).await.unwrap().into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_text_routes_to_the_replica_holding_the_engines_blocks() {
    let cm = ConfigMapDir::new(b"{}");
    let running = start(&cm.path()).await;
    let (text, ids) = long_case("deepseek-v4");
    let full = ids.len() / BLOCK * BLOCK;
    // One replica holds the whole prompt, another only its first 10 blocks.
    engine_holds(&running, DEEPSEEK, "whole", &ids);
    engine_holds(&running, DEEPSEEK, "part", &ids[..10 * BLOCK]);
    let mut c = client(&running).await;

    let a = ask(&mut c, text_req(DEEPSEEK, &text)).await;
    assert_eq!(a.decision, Decision::PrefixMatch as i32, "{a:?}");
    assert_eq!(a.prompt_tokens as usize, ids.len());
    assert_eq!(a.block_size as usize, BLOCK);
    assert_eq!(a.request_blocks as usize, ids.len() / BLOCK);
    assert!(a.warnings.is_empty(), "{:?}", a.warnings);
    let got: Vec<(&str, u32)> = a
        .replicas
        .iter()
        .map(|m| (m.replica.as_str(), m.matched_tokens))
        .collect();
    assert_eq!(
        got,
        vec![("whole", full as u32), ("part", 10 * BLOCK as u32)]
    );

    // The same answer as sending the engine's ids: the text takes the token_ids path.
    let by_ids = ask(
        &mut c,
        LookupRouteRequest {
            tenant: "team".into(),
            model: DEEPSEEK.into(),
            token_ids: ids.clone(),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(by_ids.replicas, a.replicas);

    // A prompt that shares only the first paragraphs matches only the blocks it shares.
    let cut = text.find("Paragraph 3:").unwrap();
    let shorter = format!("{} Something else entirely follows here.", &text[..cut]);
    let b = ask(&mut c, text_req(DEEPSEEK, &shorter)).await;
    assert_eq!(b.decision, Decision::PrefixMatch as i32, "{b:?}");
    assert!(b
        .replicas
        .iter()
        .all(|m| m.matched_tokens < 10 * BLOCK as u32));
    assert_eq!(b.replicas.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_text_that_cannot_be_tokenized_answers_no_hint_with_a_reason() {
    let cm = ConfigMapDir::new(b"{}");
    let running = start(&cm.path()).await;
    let mut c = client(&running).await;
    let no_hint = |a: &LookupRouteResponse, reason: &str| {
        assert_eq!(a.decision, Decision::NoHint as i32, "{a:?}");
        assert_eq!(a.reason, reason, "{a:?}");
        assert!(a.replicas.is_empty());
    };
    no_hint(
        &ask(&mut c, text_req("someone/else", "hi")).await,
        "NoTokenizerForModel",
    );
    no_hint(
        &ask(&mut c, text_req("", "hi")).await,
        "PromptTextWithoutModel",
    );
    no_hint(
        &ask(&mut c, text_req(MISSING, "hi")).await,
        "TokenizerUnavailable",
    );
    // The ConfigMap holds `{}`, not a tokenizer: never loaded.
    no_hint(
        &ask(&mut c, text_req(SWAPPED, "hi")).await,
        "TokenizerUnavailable",
    );
    let big = "a".repeat(ic_shared::limits::MAX_PROMPT_TEXT_BYTES + 1);
    no_hint(
        &ask(&mut c, text_req(DEEPSEEK, &big)).await,
        "PromptTextTooLarge",
    );
    // Shorter text is tokenized (and this index holds nothing).
    let a = ask(&mut c, text_req(DEEPSEEK, &"a ".repeat(4096))).await;
    assert_eq!(a.reason, "NoBlockSizeRegistered", "{a:?}");
    // "a", 4 095 × " a", the trailing " " (the Python tokenizers package says 4 097 too).
    assert_eq!(a.prompt_tokens, 4097, "{a:?}");
    // Empty text is a prompt of zero tokens, not a missing field.
    let e = ask(&mut c, text_req(DEEPSEEK, "")).await;
    assert_eq!(e.decision, Decision::NoHint as i32);
    assert_eq!(e.prompt_tokens, 0);

    // Text together with ids is a caller bug, refused at once.
    let mut both = text_req(DEEPSEEK, "hi");
    both.token_ids = vec![1, 2, 3];
    let err = c.lookup_route(both).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");

    let metrics = running.shared.metrics.render();
    for (reason, n) in [
        ("no_tokenizer", 1),
        ("no_model", 1),
        ("tokenizer_unavailable", 2),
        ("too_large", 1),
        ("tokenization_failed", 0),
    ] {
        let line = format!(
            "inferencecache_controller_prompt_text_refusals_total{{reason=\"{reason}\"}} {n}"
        );
        assert!(metrics.contains(&line), "{line} not in\n{metrics}");
    }
    for line in [
        format!("inferencecache_controller_tokenizer_load_failing{{model=\"{MISSING}\"}} 1"),
        format!("inferencecache_controller_tokenizer_load_failing{{model=\"{SWAPPED}\"}} 1"),
        format!("inferencecache_controller_tokenizer_load_failing{{model=\"{DEEPSEEK}\"}} 0"),
    ] {
        assert!(metrics.contains(&line), "{line} not in\n{metrics}");
    }
}

/// Polls until `f` holds for the answer to `req` (the reload runs every 50 ms).
async fn until(
    c: &mut RouterServiceClient<Channel>,
    req: &LookupRouteRequest,
    what: &str,
    f: impl Fn(&LookupRouteResponse) -> bool,
) -> LookupRouteResponse {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let a = ask(c, req.clone()).await;
        if f(&a) {
            return a;
        }
        assert!(tokio::time::Instant::now() < deadline, "{what}: {a:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_update_is_picked_up_and_a_bad_one_keeps_the_last_good_tokenizer() {
    let bert = std::fs::read(testdata("all-minilm-l6-v2/tokenizer.json")).unwrap();
    let deepseek = std::fs::read(testdata("deepseek-v4/tokenizer.json")).unwrap();
    let mut cm = ConfigMapDir::new(&bert);
    let running = start(&cm.path()).await;
    let mut c = client(&running).await;
    let req = text_req(
        SWAPPED,
        "Hello, world! The quick brown fox jumps over the lazy dog.",
    );
    // Loaded before the controller serves: BERT's ids with [CLS] … [SEP] (reference.json).
    let a = ask(&mut c, req.clone()).await;
    assert_eq!((a.prompt_tokens, a.warnings.len()), (16, 0), "{a:?}");
    let mut no_special = req.clone();
    no_special.add_special_tokens = Some(false);
    assert_eq!(ask(&mut c, no_special).await.prompt_tokens, 14);

    // The ConfigMap now holds DeepSeek's tokenizer: 14 ids for the same text.
    cm.update(&deepseek);
    until(&mut c, &req, "new tokenizer picked up", |a| {
        a.prompt_tokens == 14
    })
    .await;

    // A broken update: the last good tokenizer stays, answers say so, the metric too.
    cm.update(b"{\"version\": \"1.0\", \"truncated");
    let a = until(&mut c, &req, "bad file flagged", |a| !a.warnings.is_empty()).await;
    assert_eq!(a.warnings, vec!["TokenizerStale".to_string()]);
    assert_eq!(a.prompt_tokens, 14);
    let metrics = running.shared.metrics.render();
    for line in [
        format!("inferencecache_controller_tokenizer_load_failing{{model=\"{SWAPPED}\"}} 1"),
        format!(
            "inferencecache_controller_tokenizer_loads_total{{model=\"{SWAPPED}\",outcome=\"failed\"}} 1"
        ),
        format!(
            "inferencecache_controller_tokenizer_loads_total{{model=\"{SWAPPED}\",outcome=\"loaded\"}} 2"
        ),
    ] {
        assert!(metrics.contains(&line), "{line} not in\n{metrics}");
    }
    let st = running.shared.tokenizers.status(SWAPPED).unwrap();
    assert!(st.loaded);
    assert!(
        st.last_error
            .as_deref()
            .unwrap()
            .contains("not a tokenizer.json"),
        "{st:?}"
    );

    // Fixed again: back to BERT, no warning.
    cm.update(&bert);
    until(&mut c, &req, "fixed file picked up", |a| {
        a.prompt_tokens == 16 && a.warnings.is_empty()
    })
    .await;
}
