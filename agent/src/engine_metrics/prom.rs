//! A small reader of the Prometheus text exposition format (0.0.4, and the sample lines of
//! OpenMetrics 1.0), enough to pick a few counters out of an engine's `/metrics`.
//!
//! It is tolerant the way other people's wire formats need: comment lines (`# HELP`, `# TYPE`,
//! `# EOF`) and blank lines are skipped, a line that does not parse is skipped (and counted by
//! the caller if it cares), CRLF line ends are accepted, and nothing it is given can make it
//! panic (a property test feeds it arbitrary text).

use std::borrow::Cow;

/// vLLM's cumulative tier-2 (KV-connector, e.g. LMCache) reload hits, in tokens.
pub const T2_HITS: &str = "vllm:external_prefix_cache_hits_total";
/// vLLM's cumulative tier-2 lookups, in tokens.
pub const T2_QUERIES: &str = "vllm:external_prefix_cache_queries_total";
/// vLLM's cumulative prefix-cache (tier 1, GPU) hits, in tokens.
pub const PREFIX_CACHE_HITS: &str = "vllm:prefix_cache_hits_total";
/// vLLM's cumulative prefix-cache lookups, in tokens.
pub const PREFIX_CACHE_QUERIES: &str = "vllm:prefix_cache_queries_total";
/// LMCache's local (CPU) cache occupancy in bytes, a gauge LMCache registers in the engine's
/// Prometheus registry (multiprocess mode `sum`, so it appears on vLLM's `/metrics`).
pub const LMCACHE_LOCAL_CACHE_USAGE: &str = "lmcache:local_cache_usage";
/// The label vLLM puts the engine (data-parallel rank) index in.
pub const ENGINE_LABEL: &str = "engine";
/// SGLang's host-tier (HiCache L2) capacity in tokens, a gauge its stats-logging scheduler ranks
/// publish every log interval (at least every 30 s, idle included) only when HiCache is on
/// (`sglang/srt/observability/metrics_collector.py`, 0.5.23): the sign that the engine exports
/// its host-tier counters at all.
pub const SGLANG_HICACHE_HOST_TOTAL_TOKENS: &str = "sglang:hicache_host_total_tokens";
/// SGLang's cumulative GPU → host backups in tokens, per host pool (`pool`) and rank: host-tier
/// writes.
pub const SGLANG_HICACHE_BACKUP_TOKENS: &str = "sglang:hicache_backup_tokens_total";
/// SGLang's cumulative cached prompt tokens by `cache_source` (`device`, `host`, `storage`,
/// `total`), counted by the tokenizer manager for the whole server: `host` = host-tier reads.
pub const SGLANG_CACHED_TOKENS: &str = "sglang:cached_tokens_total";
/// The label SGLang puts the (attention) data-parallel rank in.
pub const SGLANG_DP_RANK_LABEL: &str = "dp_rank";

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    /// Metric name, e.g. `vllm:external_prefix_cache_hits_total`.
    pub name: &'a str,
    /// Label pairs in line order; values unescaped.
    pub labels: Vec<(&'a str, Cow<'a, str>)>,
    /// The value (`NaN`, `+Inf`, `-Inf` included).
    pub value: f64,
}

impl Sample<'_> {
    /// The value of label `name`, if present.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_ref())
    }
}

fn is_name_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// Splits a leading identifier (`first` for its first char, `rest` after) off `s`.
fn take_ident(
    s: &str,
    first: impl Fn(char) -> bool,
    rest: impl Fn(char) -> bool,
) -> Option<(&str, &str)> {
    let mut chars = s.char_indices();
    match chars.next() {
        Some((_, c)) if first(c) => {}
        _ => return None,
    }
    let end = chars
        .find(|(_, c)| !rest(*c))
        .map(|(i, _)| i)
        .unwrap_or(s.len());
    Some((&s[..end], &s[end..]))
}

/// Parses a quoted label value at the start of `s` (after the opening quote has been
/// removed): returns the unescaped value and the text after the closing quote.
fn take_quoted(s: &str) -> Option<(Cow<'_, str>, &str)> {
    let mut escaped = false;
    let mut has_escape = false;
    for (i, c) in s.char_indices() {
        if escaped {
            escaped = false;
            continue;
        }
        match c {
            '\\' => {
                escaped = true;
                has_escape = true;
            }
            '"' => {
                let raw = &s[..i];
                let rest = &s[i + 1..];
                if !has_escape {
                    return Some((Cow::Borrowed(raw), rest));
                }
                let mut out = String::with_capacity(raw.len());
                let mut it = raw.chars();
                while let Some(c) = it.next() {
                    if c == '\\' {
                        match it.next() {
                            Some('n') => out.push('\n'),
                            Some(other) => out.push(other),
                            None => out.push('\\'),
                        }
                    } else {
                        out.push(c);
                    }
                }
                return Some((Cow::Owned(out), rest));
            }
            _ => {}
        }
    }
    None
}

/// Parses a label set `{a="x",b="y"}` at the start of `s` (which begins with `{`).
#[allow(clippy::type_complexity)]
fn take_labels(s: &str) -> Option<(Vec<(&str, Cow<'_, str>)>, &str)> {
    let mut rest = s.strip_prefix('{')?;
    let mut labels = Vec::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix('}') {
            return Some((labels, after));
        }
        let (name, after) = take_ident(
            rest,
            |c| c.is_ascii_alphabetic() || c == '_',
            |c| c.is_ascii_alphanumeric() || c == '_',
        )?;
        let after = after.trim_start().strip_prefix('=')?;
        let after = after.trim_start().strip_prefix('"')?;
        let (value, after) = take_quoted(after)?;
        labels.push((name, value));
        let after = after.trim_start();
        rest = match after.strip_prefix(',') {
            Some(a) => a,
            None if after.starts_with('}') => after,
            None => return None,
        };
    }
}

/// Parses a sample value as Prometheus writes it (`1234`, `1.5e+06`, `NaN`, `+Inf`, `-Inf`).
pub fn parse_value(s: &str) -> Option<f64> {
    match s {
        "NaN" => Some(f64::NAN),
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        _ => s.parse::<f64>().ok(),
    }
}

/// Parses one line; `None` for comments, blank lines and anything malformed.
pub fn parse_line(line: &str) -> Option<Sample<'_>> {
    let line = line.strip_suffix('\r').unwrap_or(line).trim_start();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (name, rest) = take_ident(line, is_name_start, is_name_char)?;
    let (labels, rest) = if rest.starts_with('{') {
        take_labels(rest)?
    } else {
        (Vec::new(), rest)
    };
    // The value must be separated from the name or label set by whitespace.
    if !rest.starts_with([' ', '\t']) {
        return None;
    }
    let mut fields = rest.split_ascii_whitespace();
    let value = parse_value(fields.next()?)?;
    // An optional timestamp (and, in OpenMetrics, an exemplar after `#`) may follow.
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// Every sample of `text` whose metric name is one of `names` (other lines are not fully
/// parsed). Malformed lines are skipped.
pub fn samples<'a>(text: &'a str, names: &'a [&'a str]) -> impl Iterator<Item = Sample<'a>> + 'a {
    text.split('\n')
        .filter(move |line| {
            let l = line.trim_start();
            names.iter().any(|n| {
                l.strip_prefix(n)
                    .is_some_and(|after| after.starts_with(['{', ' ', '\t']))
            })
        })
        .filter_map(parse_line)
}

/// A (hits, queries) counter pair of one engine stream (tier-2 or prefix-cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct T2Counters {
    /// Cumulative reload hits (tokens).
    pub hits: u64,
    /// Cumulative lookups (tokens).
    pub queries: u64,
}

/// A counter value as an integer: finite non-negative values, floored; anything else is not
/// a counter value and is skipped.
fn counter_value(v: f64) -> Option<f64> {
    (v.is_finite() && v >= 0.0).then_some(v)
}

/// The tier-2 counters of data-parallel rank `dp_rank` in an engine's `/metrics` text.
///
/// Sums the series of [`T2_HITS`] and [`T2_QUERIES`]; when some series carries
/// `engine="<dp_rank>"`, only those series count (one API server serves every rank of its
/// pod, one series per engine). `None` when either counter is absent: the engine has no KV
/// connector or does not export it, and "not exercised" must stay distinct from 0.
pub fn t2_counters(text: &str, dp_rank: u32) -> Option<T2Counters> {
    counter_pair(text, T2_HITS, T2_QUERIES, dp_rank)
}

/// The prefix-cache (tier 1) counters of data-parallel rank `dp_rank`: [`PREFIX_CACHE_HITS`]
/// and [`PREFIX_CACHE_QUERIES`], by the rules of [`t2_counters`].
pub fn prefix_cache_counters(text: &str, dp_rank: u32) -> Option<T2Counters> {
    counter_pair(text, PREFIX_CACHE_HITS, PREFIX_CACHE_QUERIES, dp_rank)
}

/// A (hits, queries) counter pair of rank `dp_rank`, per [`t2_counters`]'s rules.
fn counter_pair(
    text: &str,
    hits_name: &str,
    queries_name: &str,
    dp_rank: u32,
) -> Option<T2Counters> {
    let rank = dp_rank.to_string();
    let mut hits: Vec<(Option<String>, f64)> = Vec::new();
    let mut queries: Vec<(Option<String>, f64)> = Vec::new();
    for s in samples(text, &[hits_name, queries_name]) {
        let Some(v) = counter_value(s.value) else {
            continue;
        };
        let engine = s.label(ENGINE_LABEL).map(str::to_string);
        if s.name == hits_name {
            hits.push((engine, v));
        } else {
            queries.push((engine, v));
        }
    }
    if hits.is_empty() || queries.is_empty() {
        return None;
    }
    let by_rank = hits
        .iter()
        .chain(queries.iter())
        .any(|(e, _)| e.as_deref() == Some(rank.as_str()));
    let sum = |series: &[(Option<String>, f64)]| -> u64 {
        let total: f64 = series
            .iter()
            .filter(|(e, _)| !by_rank || e.as_deref() == Some(rank.as_str()))
            .map(|(_, v)| *v)
            .sum();
        // Float-to-integer casts saturate (and map NaN to 0).
        total.floor() as u64
    };
    Some(T2Counters {
        hits: sum(&hits),
        queries: sum(&queries),
    })
}

/// What an SGLang engine's `/metrics` says of its HiCache host tier for one data-parallel rank
/// (issue 19 item 4), in tokens, cumulative since the engine started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostTierCounters {
    /// Tokens backed up GPU → host for the rank ([`SGLANG_HICACHE_BACKUP_TOKENS`]).
    pub written_tokens: u64,
    /// Prompt tokens served from the host tier, the whole server's ([`SGLANG_CACHED_TOKENS`]
    /// with `cache_source="host"`).
    pub served_tokens: u64,
}

/// The host-tier counters of data-parallel rank `dp_rank` in an SGLang engine's `/metrics`
/// text.
///
/// `None` unless [`SGLANG_HICACHE_HOST_TOTAL_TOKENS`] has a series for the rank (`dp_rank`
/// label equal to it, or no series carries that label): without it the engine does not export
/// the host tier (HiCache off, or not logged yet), and "no signal" must stay distinct from 0.
/// When it is there, SGLang's counters count from their first increment (a multiprocess
/// registry shows a series only once written), so a missing counter series reads 0:
///
/// - `written_tokens`: the largest [`SGLANG_HICACHE_BACKUP_TOKENS`] series with `pool="kv"` (or
///   no `pool` label) of the rank (`dp_rank` label, when present): every TP rank reports the
///   same logical count under its own `tp_rank`, so one is read, never their sum;
/// - `served_tokens`: the sum of the [`SGLANG_CACHED_TOKENS`] series with `cache_source="host"`
///   (one per label set of the tokenizer: priority or custom labels split it); the tokenizer
///   serves every rank, so it is the pod's value on each rank.
pub fn host_tier_counters(text: &str, dp_rank: u32) -> Option<HostTierCounters> {
    let rank = dp_rank.to_string();
    let of_rank = |s: &Sample<'_>| s.label(SGLANG_DP_RANK_LABEL).is_none_or(|r| r == rank);
    let mut present = false;
    let mut written: f64 = 0.0;
    let mut served: f64 = 0.0;
    let names = [
        SGLANG_HICACHE_HOST_TOTAL_TOKENS,
        SGLANG_HICACHE_BACKUP_TOKENS,
        SGLANG_CACHED_TOKENS,
    ];
    for s in samples(text, &names) {
        let Some(v) = counter_value(s.value) else {
            continue;
        };
        match s.name {
            SGLANG_HICACHE_HOST_TOTAL_TOKENS => present |= of_rank(&s),
            SGLANG_HICACHE_BACKUP_TOKENS
                if of_rank(&s) && s.label("pool").is_none_or(|p| p == "kv") =>
            {
                written = written.max(v);
            }
            SGLANG_CACHED_TOKENS if s.label("cache_source") == Some("host") => served += v,
            _ => {}
        }
    }
    // Float-to-integer casts saturate.
    present.then_some(HostTierCounters {
        written_tokens: written.floor() as u64,
        served_tokens: served.floor() as u64,
    })
}

/// Bytes LMCache holds in its local (CPU) cache for data-parallel rank `dp_rank` of an engine
/// with `dp_size` ranks: the sum of every finite, non-negative [`LMCACHE_LOCAL_CACHE_USAGE`]
/// series (one per worker: tensor-parallel workers hold their own shards), or only those with
/// `engine="<dp_rank>"` when some series carries the `engine` label.
///
/// `None` when the gauge is absent, and when `dp_size > 1` and no series says which rank it
/// belongs to: a pod total attributed to one rank would be a wrong number.
pub fn cache_memory_bytes(text: &str, dp_rank: u32, dp_size: usize) -> Option<u64> {
    let rank = dp_rank.to_string();
    let series: Vec<(Option<String>, f64)> = samples(text, &[LMCACHE_LOCAL_CACHE_USAGE])
        .filter_map(|s| {
            counter_value(s.value).map(|v| (s.label(ENGINE_LABEL).map(str::to_string), v))
        })
        .collect();
    if series.is_empty() {
        return None;
    }
    let by_rank = series.iter().any(|(e, _)| e.is_some());
    if !by_rank && dp_size > 1 {
        return None;
    }
    let total: f64 = series
        .iter()
        .filter(|(e, _)| !by_rank || e.as_deref() == Some(rank.as_str()))
        .map(|(_, v)| *v)
        .sum();
    (!by_rank
        || series
            .iter()
            .any(|(e, _)| e.as_deref() == Some(rank.as_str())))
    .then_some(total.floor() as u64)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    /// What LMCache's `PrometheusLogger` exposes through vLLM's multiprocess registry (a TP=2
    /// engine: one series per worker), next to vLLM's own series.
    const LMCACHE_TP2: &str =
        "# HELP lmcache:local_cache_usage Local cache usage (bytes) of lmcache\n\
        # TYPE lmcache:local_cache_usage gauge\n\
        lmcache:local_cache_usage{model_name=\"Qwen/Qwen3-8B\",worker_id=\"0\"} 1.073741824e+09\n\
        lmcache:local_cache_usage{model_name=\"Qwen/Qwen3-8B\",worker_id=\"1\"} 1073741824.0\n\
        lmcache:local_cache_usage_x 5\n\
        vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 0.4\n";

    #[test]
    fn prefix_cache_counters_follow_the_rank_rules() {
        let page = "vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 4096.0\n\
                    vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 1024.0\n\
                    vllm:prefix_cache_queries_total{engine=\"1\",model_name=\"m\"} 10.0\n\
                    vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"m\"} 0.0\n";
        assert_eq!(
            prefix_cache_counters(page, 0),
            Some(T2Counters {
                hits: 1024,
                queries: 4096
            })
        );
        assert_eq!(
            prefix_cache_counters(page, 1),
            Some(T2Counters {
                hits: 0,
                queries: 10
            })
        );
        assert_eq!(t2_counters(page, 0), None);
    }

    #[test]
    fn lmcache_local_cache_usage_is_summed_over_workers_and_never_invented() {
        assert_eq!(
            cache_memory_bytes(LMCACHE_TP2, 0, 1),
            Some(2 * 1_073_741_824)
        );
        // No LMCache: absent, not 0.
        assert_eq!(
            cache_memory_bytes("vllm:kv_cache_usage_perc 0.4\n", 0, 1),
            None
        );
        // Data-parallel engine without a rank label: which rank holds what is unknown.
        assert_eq!(cache_memory_bytes(LMCACHE_TP2, 0, 2), None);
        // With a rank label, each rank reads its own series; a rank with none reads absent.
        let ranked = "lmcache:local_cache_usage{engine=\"0\"} 10\n\
                      lmcache:local_cache_usage{engine=\"1\"} 32\n";
        assert_eq!(cache_memory_bytes(ranked, 1, 2), Some(32));
        assert_eq!(cache_memory_bytes(ranked, 2, 3), None);
        // Garbage values are skipped, not summed.
        assert_eq!(
            cache_memory_bytes(
                "lmcache:local_cache_usage NaN\nlmcache:local_cache_usage -4\n",
                0,
                1
            ),
            None
        );
    }

    /// What vLLM 0.11+ serves at `/metrics` with two data-parallel engines and LMCache wired
    /// (prometheus_client text format 0.0.4, trimmed to a few families around the counters).
    pub(crate) const VLLM_DP2: &str = include_str!("../../tests/data/vllm-dp2.metrics");

    #[test]
    fn lines_parse_with_labels_escapes_and_timestamps() {
        let s = parse_line(r#"m{a="x",b="q\"uo\\te\nd",} 1.5e3 1700000000000"#).unwrap();
        assert_eq!(s.name, "m");
        assert_eq!(s.label("a"), Some("x"));
        assert_eq!(s.label("b"), Some("q\"uo\\te\nd"));
        assert_eq!(s.value, 1500.0);
        assert_eq!(parse_line("up 1\r").unwrap().value, 1.0);
        assert_eq!(parse_line("a:b_c{} +Inf").unwrap().value, f64::INFINITY);
        assert!(parse_line("x NaN").unwrap().value.is_nan());
        for bad in [
            "",
            "# HELP x y",
            "1abc 2",
            "x",
            "x{",
            "x{a=\"1\"",
            "x{a=1} 2",
            "x{a=\"1\"}2",
            "x two",
            "x{a=\"1\" b=\"2\"} 3",
        ] {
            assert!(parse_line(bad).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn the_rank_s_engine_series_is_taken() {
        assert_eq!(
            t2_counters(VLLM_DP2, 0),
            Some(T2Counters {
                hits: 10240,
                queries: 40960
            })
        );
        assert_eq!(
            t2_counters(VLLM_DP2, 1),
            Some(T2Counters {
                hits: 0,
                queries: 12288
            })
        );
    }

    #[test]
    fn without_a_matching_engine_label_every_series_is_summed() {
        assert_eq!(
            t2_counters(VLLM_DP2, 5),
            Some(T2Counters {
                hits: 10240,
                queries: 53248
            })
        );
        let unlabelled = "vllm:external_prefix_cache_hits_total 3\n\
                          vllm:external_prefix_cache_queries_total{model_name=\"m\"} 4\n\
                          vllm:external_prefix_cache_queries_total{model_name=\"n\"} 8\n";
        assert_eq!(
            t2_counters(unlabelled, 0),
            Some(T2Counters {
                hits: 3,
                queries: 12
            })
        );
    }

    #[test]
    fn absent_counters_are_none_never_zero() {
        assert_eq!(t2_counters("", 0), None);
        let only_gpu = "vllm:prefix_cache_queries_total{engine=\"0\"} 10\n";
        assert_eq!(t2_counters(only_gpu, 0), None);
        // A name that merely starts like the counter is another metric.
        let lookalike = "vllm:external_prefix_cache_hits_total_x 1\n\
                         vllm:external_prefix_cache_queries_totals 2\n";
        assert_eq!(t2_counters(lookalike, 0), None);
        let one_half = "vllm:external_prefix_cache_queries_total 2\n";
        assert_eq!(t2_counters(one_half, 0), None);
        // Garbage values are not counter values.
        let bad = "vllm:external_prefix_cache_hits_total -1\n\
                   vllm:external_prefix_cache_queries_total NaN\n";
        assert_eq!(t2_counters(bad, 0), None);
    }

    /// SGLang 0.5.23's own `/metrics` pages, rendered from its collectors
    /// (`scripts/sglang-metrics-page.py`; provenance in each file's header).
    pub(crate) const SGLANG_ROUNDTRIP: &str =
        include_str!("../../../testdata/metrics/sglang-0.5.23-roundtrip.metrics");
    pub(crate) const SGLANG_WRITTEN: &str =
        include_str!("../../../testdata/metrics/sglang-0.5.23-written.metrics");
    pub(crate) const SGLANG_IDLE: &str =
        include_str!("../../../testdata/metrics/sglang-0.5.23-idle.metrics");
    pub(crate) const SGLANG_NO_HICACHE: &str =
        include_str!("../../../testdata/metrics/sglang-0.5.23-no-hicache.metrics");
    pub(crate) const SGLANG_DP2: &str =
        include_str!("../../../testdata/metrics/sglang-0.5.23-dp2.metrics");

    fn host(written_tokens: u64, served_tokens: u64) -> Option<HostTierCounters> {
        Some(HostTierCounters {
            written_tokens,
            served_tokens,
        })
    }

    #[test]
    fn sglang_host_tier_counters_from_its_own_pages() {
        // TP=2: both ranks report 3072 backed-up tokens; one is read, not their sum.
        assert_eq!(host_tier_counters(SGLANG_ROUNDTRIP, 0), host(3072, 2048));
        assert_eq!(host_tier_counters(SGLANG_WRITTEN, 0), host(3072, 0));
        // HiCache on, nothing written or served yet: the counters do not exist, the host
        // tier does — 0, not absent.
        assert_eq!(host_tier_counters(SGLANG_IDLE, 0), host(0, 0));
        // HiCache off (or metrics without the host tier): no signal, not 0.
        assert_eq!(host_tier_counters(SGLANG_NO_HICACHE, 0), None);
        // Attention DP: each rank its own writes; the tokenizer's reads are the pod's.
        assert_eq!(host_tier_counters(SGLANG_DP2, 0), host(2048, 1024));
        assert_eq!(host_tier_counters(SGLANG_DP2, 1), host(0, 1024));
        assert_eq!(host_tier_counters(SGLANG_DP2, 2), None, "no such rank");
        // SGLang pages carry no vLLM counters.
        for page in [SGLANG_ROUNDTRIP, SGLANG_DP2, SGLANG_NO_HICACHE] {
            assert_eq!(t2_counters(page, 0), None);
            assert_eq!(prefix_cache_counters(page, 0), None);
        }
        // A vLLM page has no host tier.
        assert_eq!(host_tier_counters(VLLM_DP2, 0), None);
    }

    #[test]
    fn sglang_host_tier_reads_only_the_kv_pool_and_the_host_source() {
        let page = "sglang:hicache_host_total_tokens{tp_rank=\"0\"} 100\n\
                    sglang:hicache_backup_tokens_total{dp_rank=\"0\",pool=\"mamba\",tp_rank=\"0\"} 99\n\
                    sglang:hicache_backup_tokens_total{dp_rank=\"0\",pool=\"kv\",tp_rank=\"0\"} 7\n\
                    sglang:hicache_backup_tokens_total{dp_rank=\"0\",pool=\"kv\",tp_rank=\"1\"} 8\n\
                    sglang:cached_tokens_total{cache_source=\"device\",priority=\"1\"} 50\n\
                    sglang:cached_tokens_total{cache_source=\"host\",priority=\"1\"} 3\n\
                    sglang:cached_tokens_total{cache_source=\"host\",priority=\"2\"} 4\n\
                    sglang:cached_tokens_total{cache_source=\"total\"} 60\n";
        // The freshest TP rank's count (they report the same; one may lag a log interval).
        assert_eq!(host_tier_counters(page, 0), host(8, 7));
        let garbage = "sglang:hicache_host_total_tokens NaN\n";
        assert_eq!(host_tier_counters(garbage, 0), None);
    }

    proptest! {
        #[test]
        fn arbitrary_text_never_panics(text in "\\PC*") {
            let _ = t2_counters(&text, 0);
            let _ = host_tier_counters(&text, 0);
            for line in text.split('\n') {
                let _ = parse_line(line);
            }
        }

        #[test]
        fn counter_like_garbage_never_panics(
            lines in proptest::collection::vec(
                (
                    prop::sample::select(vec![T2_HITS, T2_QUERIES, "vllm:x", "#", ""]),
                    "[{}\"=,\\\\a-z0-9 .eE+\\-]{0,24}",
                ),
                0..16,
            ),
            rank in 0u32..4,
        ) {
            let text: String = lines.iter().map(|(n, rest)| format!("{n}{rest}\n")).collect();
            let _ = t2_counters(&text, rank);
            let _: Vec<Sample<'_>> = samples(&text, &[T2_HITS, T2_QUERIES]).collect();
        }

        #[test]
        fn well_formed_counters_round_trip(
            hits in proptest::collection::vec(0u32..1_000_000, 1..4),
            queries in proptest::collection::vec(0u32..1_000_000, 1..4),
        ) {
            let mut text = String::from("# TYPE vllm:external_prefix_cache_hits_total counter\n");
            for (i, h) in hits.iter().enumerate() {
                text.push_str(&format!("{T2_HITS}{{engine=\"{i}\",model_name=\"m\"}} {h}.0\n"));
            }
            for (i, q) in queries.iter().enumerate() {
                text.push_str(&format!("{T2_QUERIES}{{engine=\"{i}\",model_name=\"m\"}} {q}.0\r\n"));
            }
            let c = t2_counters(&text, 0).unwrap();
            prop_assert_eq!(c.hits, u64::from(hits[0]));
            prop_assert_eq!(c.queries, u64::from(queries[0]));
            let all = t2_counters(&text, 99).unwrap();
            prop_assert_eq!(all.hits, hits.iter().map(|h| u64::from(*h)).sum::<u64>());
            prop_assert_eq!(all.queries, queries.iter().map(|q| u64::from(*q)).sum::<u64>());
        }
    }
}
