//! Server-side tokenization of `LookupRouteRequest.prompt_text` with each model's own HF
//! `tokenizer.json` (spec 000, "Block-size alignment for server-derived lookups": gateways call
//! LookupRoute "with raw token_ids / prompt_text").
//!
//! Configured per model with `--tokenizer MODEL=PATH` (repeatable; MODEL is the model id the
//! engine streams report, `observation.modelID`). A flag rather than a CachePolicy field: a
//! tokenizer belongs to a model, not to a namespace (two namespaces' policies could name two
//! files for one model id), and reading ConfigMaps named on namespaced objects would need the
//! controller to read ConfigMaps in every namespace. In cluster the file comes from a ConfigMap
//! (or any volume) mounted into the controller pod (chart value `router.tokenizers`).
//!
//! Loading: once at start, then every `--tokenizer-reload-seconds` the file is stat'ed
//! (following symlinks, so a ConfigMap volume's `..data` symlink swap shows as a new inode) and
//! read again when its device, inode, size or mtime changed. A file that cannot be read or
//! parsed keeps the last good tokenizer: the failure is logged, counted
//! (`inferencecache_controller_tokenizer_loads_total{outcome="failed"}`), flagged
//! (`inferencecache_controller_tokenizer_load_failing{model} 1`) and every lookup answered with
//! the old tokenizer carries the warning [`TOKENIZER_STALE`]. A model whose file never loaded
//! answers NO_HINT / [`PromptRefusal::TokenizerUnavailable`].
//!
//! Encoding matches what the engine computes for the same text: `Tokenizer::encode(text,
//! add_special_tokens)` of the same `tokenizer.json` (what `transformers`' fast tokenizers run),
//! with truncation and padding off (as `transformers` calls it). `add_special_tokens` defaults
//! to true, vLLM's default on its completions path (`CompletionRequest.add_special_tokens`);
//! a gateway sending a chat prompt it rendered with the chat template sends false, as vLLM's
//! chat path does. Settings only `tokenizer_config.json` holds (`add_bos_token` of Llama-style
//! tokenizers) are not read: the `tokenizer.json` must carry the post-processor the engine
//! uses (what `save_pretrained` writes).
//!
//! The ids then take the same path as `token_ids`: chunked at each candidate partition's block
//! size and hashed with [`ic_shared::kv::content_key::chain`], the one definition the agent
//! uses for engine token ids.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use ic_shared::limits::{
    read_bounded, MAX_LOOKUP_TOKENS, MAX_PROMPT_TEXT_BYTES, MAX_TOKENIZER_BYTES,
};
use parking_lot::RwLock;
use thiserror::Error;
use tokenizers::Tokenizer;
use tracing::{error, info, warn};

pub use crate::metrics::labels::PromptRefusal;
use crate::metrics::ControllerMetrics;

/// Warning on a LookupRoute answer whose prompt text was tokenized with the last good
/// tokenizer because the model's file on disk failed to load since.
pub const TOKENIZER_STALE: &str = "TokenizerStale";

/// Default seconds between two checks of the tokenizer files.
pub const DEFAULT_RELOAD_INTERVAL: Duration = Duration::from_secs(10);

/// One `--tokenizer MODEL=PATH`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizerSpec {
    /// Model id, as the engine streams report it (`observation.modelID`).
    pub model: String,
    /// Path of the model's HF `tokenizer.json`.
    pub path: PathBuf,
}

/// A `--tokenizer` value that is not `MODEL=PATH` with both parts non-empty.
#[derive(Debug, Error, PartialEq, Eq)]
#[error(
    "--tokenizer {0:?}: expected MODEL=PATH (the model id, then the path of its tokenizer.json)"
)]
pub struct BadTokenizerSpec(pub String);

impl FromStr for TokenizerSpec {
    type Err = BadTokenizerSpec;

    /// Splits at the first `=` (model ids hold no `=`; paths may).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once('=') {
            Some((model, path)) if !model.trim().is_empty() && !path.is_empty() => {
                Ok(TokenizerSpec {
                    model: model.trim().to_string(),
                    path: PathBuf::from(path),
                })
            }
            _ => Err(BadTokenizerSpec(s.to_string())),
        }
    }
}

/// Tokenizer settings of a controller (standalone or in cluster).
#[derive(Debug, Clone)]
pub struct TokenizerConfig {
    /// One entry per model.
    pub specs: Vec<TokenizerSpec>,
    /// How often the files are checked for changes.
    pub reload_interval: Duration,
}

impl Default for TokenizerConfig {
    fn default() -> Self {
        TokenizerConfig {
            specs: Vec::new(),
            reload_interval: DEFAULT_RELOAD_INTERVAL,
        }
    }
}

/// The command-line flags of [`TokenizerConfig`] (flattened into `standalone` and `run`).
#[derive(Debug, Clone, clap::Args)]
pub struct TokenizerArgs {
    /// Tokenizer of a model for LookupRoute prompt_text: MODEL=PATH, MODEL the model id the
    /// engines report (observation.modelID), PATH its HF tokenizer.json (a mounted ConfigMap
    /// works: its updates are picked up). Repeat per model; IC_TOKENIZERS takes a comma list.
    #[arg(
        long = "tokenizer",
        env = "IC_TOKENIZERS",
        value_delimiter = ',',
        value_name = "MODEL=PATH"
    )]
    pub tokenizers: Vec<TokenizerSpec>,
    /// Seconds between checks of the tokenizer files for changes.
    #[arg(long, env = "IC_TOKENIZER_RELOAD_SECONDS", default_value_t = 10)]
    pub tokenizer_reload_seconds: u64,
}

impl TokenizerArgs {
    /// The settings these flags say.
    pub fn config(&self) -> TokenizerConfig {
        TokenizerConfig {
            specs: self.tokenizers.clone(),
            reload_interval: Duration::from_secs(self.tokenizer_reload_seconds.max(1)),
        }
    }
}

/// Two `--tokenizer` flags name the same model.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("--tokenizer names model {0:?} twice")]
pub struct DuplicateModel(pub String);

/// Token ids of one prompt text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// The ids, in order.
    pub ids: Vec<u32>,
    /// True when the model's file failed to load since the tokenizer used was loaded
    /// (answer with [`TOKENIZER_STALE`]).
    pub stale: bool,
}

/// What a model's tokenizer slot holds now (for logs, tests and `/metrics`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizerStatus {
    /// A tokenizer is loaded (possibly an older one, see `last_error`).
    pub loaded: bool,
    /// Why the file on disk did not load at its latest change; `None` when it did.
    pub last_error: Option<String>,
}

/// What identifies one version of a file: its device and inode (a ConfigMap update swaps in a
/// new file), size and mtime (an in-place rewrite).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fingerprint {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_ns: i128,
}

fn fingerprint(path: &Path) -> std::io::Result<Fingerprint> {
    let m = std::fs::metadata(path)?;
    let mtime_ns = m
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as i128);
    #[cfg(unix)]
    let (dev, ino) = {
        use std::os::unix::fs::MetadataExt;
        (m.dev(), m.ino())
    };
    #[cfg(not(unix))]
    let (dev, ino) = (0, 0);
    Ok(Fingerprint {
        dev,
        ino,
        len: m.len(),
        mtime_ns,
    })
}

#[derive(Default)]
struct SlotState {
    /// The last tokenizer that loaded.
    good: Option<Arc<Tokenizer>>,
    /// The file version last tried (loaded or failed); `None` before the first try or after a
    /// failed stat.
    seen: Option<Fingerprint>,
    /// Why the latest try failed.
    last_error: Option<String>,
}

struct Slot {
    path: PathBuf,
    state: RwLock<SlotState>,
}

/// The tokenizers of every configured model, each with its last good version.
#[derive(Default)]
pub struct Tokenizers {
    slots: BTreeMap<String, Slot>,
}

/// Reads and parses one `tokenizer.json`, with truncation and padding off.
///
/// # Errors
/// A sentence naming the path: unreadable, larger than [`MAX_TOKENIZER_BYTES`], not UTF-8, not
/// a tokenizer the `tokenizers` crate parses.
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer, String> {
    let file =
        std::fs::File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let text = read_bounded(file, MAX_TOKENIZER_BYTES)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut tok = Tokenizer::from_str(&text)
        .map_err(|e| format!("{} is not a tokenizer.json: {e}", path.display()))?;
    tok.with_truncation(None)
        .map_err(|e| format!("{}: cannot turn truncation off: {e}", path.display()))?;
    tok.with_padding(None);
    Ok(tok)
}

impl Tokenizers {
    /// Slots for `specs`, nothing loaded yet (call [`Tokenizers::reload`]).
    ///
    /// # Errors
    /// [`DuplicateModel`] when two specs name one model.
    pub fn new(specs: &[TokenizerSpec]) -> Result<Self, DuplicateModel> {
        let mut slots = BTreeMap::new();
        for s in specs {
            let slot = Slot {
                path: s.path.clone(),
                state: RwLock::new(SlotState::default()),
            };
            if slots.insert(s.model.clone(), slot).is_some() {
                return Err(DuplicateModel(s.model.clone()));
            }
        }
        Ok(Tokenizers { slots })
    }

    /// True when no model is configured.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The configured model ids.
    pub fn models(&self) -> impl Iterator<Item = &str> {
        self.slots.keys().map(String::as_str)
    }

    /// What `model`'s slot holds; `None` for a model without `--tokenizer`.
    pub fn status(&self, model: &str) -> Option<TokenizerStatus> {
        let st = self.slots.get(model)?.state.read();
        Some(TokenizerStatus {
            loaded: st.good.is_some(),
            last_error: st.last_error.clone(),
        })
    }

    /// Loads every file that changed since its last try (all of them the first time). Blocking
    /// file I/O and parsing: call from a blocking thread. Returns how many slots changed state.
    pub fn reload(&self, metrics: &ControllerMetrics) -> usize {
        let mut changed = 0;
        for (model, slot) in &self.slots {
            if self.reload_one(model, slot, metrics) {
                changed += 1;
            }
        }
        changed
    }

    fn reload_one(&self, model: &str, slot: &Slot, metrics: &ControllerMetrics) -> bool {
        let before = match fingerprint(&slot.path) {
            Ok(fp) => fp,
            Err(e) => {
                let msg = format!("cannot stat {}: {e}", slot.path.display());
                return self.fail(model, slot, None, msg, metrics);
            }
        };
        if slot.state.read().seen == Some(before) {
            return false;
        }
        let loaded = load_tokenizer(&slot.path);
        // A file swapped while it was read is read again on the next pass.
        if fingerprint(&slot.path).ok() != Some(before) {
            return false;
        }
        match loaded {
            Ok(tok) => {
                let mut st = slot.state.write();
                let replaced = st.good.is_some();
                st.good = Some(Arc::new(tok));
                st.seen = Some(before);
                st.last_error = None;
                drop(st);
                record_load(metrics, model, true);
                info!(model, path = %slot.path.display(), replaced, "tokenizer loaded");
                true
            }
            Err(msg) => self.fail(model, slot, Some(before), msg, metrics),
        }
    }

    fn fail(
        &self,
        model: &str,
        slot: &Slot,
        seen: Option<Fingerprint>,
        msg: String,
        metrics: &ControllerMetrics,
    ) -> bool {
        let mut st = slot.state.write();
        if st.last_error.as_deref() == Some(msg.as_str()) && st.seen == seen {
            return false;
        }
        st.seen = seen;
        st.last_error = Some(msg.clone());
        let kept = st.good.is_some();
        drop(st);
        record_load(metrics, model, false);
        if kept {
            warn!(model, error = %msg, "tokenizer file did not load; keeping the last good tokenizer (prompt_text answers carry the warning TokenizerStale)");
        } else {
            error!(model, error = %msg, "tokenizer file did not load; prompt_text lookups of this model answer NO_HINT/TokenizerUnavailable");
        }
        true
    }

    /// Token ids of `text` with `model`'s tokenizer.
    ///
    /// # Errors
    /// The [`PromptRefusal`] the answer reports as its NO_HINT reason.
    pub fn encode(
        &self,
        model: &str,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Encoded, PromptRefusal> {
        if text.len() > MAX_PROMPT_TEXT_BYTES {
            return Err(PromptRefusal::TooLarge);
        }
        if model.is_empty() {
            return Err(PromptRefusal::NoModel);
        }
        let slot = self.slots.get(model).ok_or(PromptRefusal::NoTokenizer)?;
        let (tok, stale) = {
            let st = slot.state.read();
            let tok = st.good.clone().ok_or(PromptRefusal::TokenizerUnavailable)?;
            (tok, st.last_error.is_some())
        };
        // The tokenizers crate reports bad input as errors; a panic in it must not take the
        // gateway's answer with it either.
        let encoded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            tok.encode_fast(text, add_special_tokens)
        }));
        let ids = match encoded {
            Ok(Ok(enc)) => enc.get_ids().to_vec(),
            Ok(Err(e)) => {
                warn!(model, error = %e, "prompt_text did not tokenize");
                return Err(PromptRefusal::TokenizationFailed);
            }
            Err(_) => {
                error!(model, "tokenizer panicked on a prompt_text");
                return Err(PromptRefusal::TokenizationFailed);
            }
        };
        if ids.len() > MAX_LOOKUP_TOKENS {
            return Err(PromptRefusal::TooLarge);
        }
        Ok(Encoded { ids, stale })
    }
}

/// Counts one load of `model`'s file and sets its `tokenizer_load_failing` gauge.
fn record_load(metrics: &ControllerMetrics, model: &str, loaded: bool) {
    let outcome = if loaded { "loaded" } else { "failed" };
    metrics
        .tokenizer_loads_total
        .with_label_values(&[model, outcome])
        .inc();
    metrics
        .tokenizer_load_failing
        .with_label_values(&[model])
        .set(i64::from(!loaded));
}

/// Loads every configured tokenizer once (awaited), then checks the files every `interval`
/// on a blocking thread until the task is aborted. Returns the checking task.
pub async fn load_and_watch(
    tokenizers: Arc<Tokenizers>,
    metrics: ControllerMetrics,
    interval: Duration,
) -> tokio::task::JoinHandle<()> {
    let pass = {
        let tokenizers = tokenizers.clone();
        let metrics = metrics.clone();
        move || {
            let t = tokenizers.clone();
            let m = metrics.clone();
            tokio::task::spawn_blocking(move || t.reload(&m))
        }
    };
    if !tokenizers.is_empty() {
        if let Err(e) = pass().await {
            error!(error = %e, "tokenizer load task failed");
        }
    }
    tokio::spawn(async move {
        if tokenizers.is_empty() {
            return;
        }
        let mut tick = tokio::time::interval(interval.max(Duration::from_millis(10)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            if let Err(e) = pass().await {
                error!(error = %e, "tokenizer reload task failed");
            }
        }
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_model_equals_path() {
        let s: TokenizerSpec = "deepseek-ai/DeepSeek-V4-Flash=/etc/tok/a=b/tokenizer.json"
            .parse()
            .unwrap();
        assert_eq!(s.model, "deepseek-ai/DeepSeek-V4-Flash");
        assert_eq!(s.path, PathBuf::from("/etc/tok/a=b/tokenizer.json"));
        for bad in ["", "m", "=p", "m=", " =p"] {
            assert_eq!(
                bad.parse::<TokenizerSpec>(),
                Err(BadTokenizerSpec(bad.into()))
            );
        }
        let twice = [s.clone(), s];
        assert!(
            matches!(Tokenizers::new(&twice), Err(DuplicateModel(m)) if m == "deepseek-ai/DeepSeek-V4-Flash")
        );
    }

    #[test]
    fn refusals_come_before_any_tokenizer_work() {
        let t = Tokenizers::new(&[TokenizerSpec {
            model: "m".into(),
            path: "/nonexistent/tokenizer.json".into(),
        }])
        .unwrap();
        let big = "a".repeat(MAX_PROMPT_TEXT_BYTES + 1);
        assert_eq!(t.encode("m", &big, true), Err(PromptRefusal::TooLarge));
        // At the cap the text goes on (to the next check, here the missing model).
        let at_cap = &big[..MAX_PROMPT_TEXT_BYTES];
        assert_eq!(t.encode("", at_cap, true), Err(PromptRefusal::NoModel));
        assert_eq!(t.encode("", "hi", true), Err(PromptRefusal::NoModel));
        assert_eq!(
            t.encode("other", "hi", true),
            Err(PromptRefusal::NoTokenizer)
        );
        // Configured but never loaded.
        assert_eq!(
            t.encode("m", "hi", true),
            Err(PromptRefusal::TokenizerUnavailable)
        );
        let metrics = ControllerMetrics::new().unwrap();
        assert_eq!(t.reload(&metrics), 1);
        // The same failure again is not news.
        assert_eq!(t.reload(&metrics), 0);
        let st = t.status("m").unwrap();
        assert!(!st.loaded);
        assert!(
            st.last_error
                .unwrap()
                .contains("/nonexistent/tokenizer.json"),
            "the error names the file"
        );
        let text = metrics.render();
        assert!(
            text.contains("inferencecache_controller_tokenizer_load_failing{model=\"m\"} 1"),
            "{text}"
        );
    }
}
