//! Input bounds both binaries agree on (docs/security.md "Input bounds"): what one request,
//! one agent or one file may make a process allocate or compute.

/// Largest block size, in tokens, a stream may register or a lookup or `/probe` may name.
/// vLLM's block sizes are 1–256 (hybrid attention/Mamba models round theirs up to a few
/// hundred), SGLang's page sizes 1–64, LMCache's chunk 256: 4096 leaves room for all of them.
pub const MAX_BLOCK_SIZE: u32 = 4096;

/// Most distinct block sizes the index holds at once. A lookup without a block size is
/// chunked once per registered size, so this bounds a lookup's work to
/// `MAX_BLOCK_SIZES × MAX_LOOKUP_TOKENS` key derivations. Real fleets register one or two sizes
/// per hash scheme.
pub const MAX_BLOCK_SIZES: usize = 64;

/// Most token ids (or content keys) one `LookupRoute` request may carry: 1 Mi, the longest
/// context windows of current long-context models (Qwen2.5-1M, Llama 4).
pub const MAX_LOOKUP_TOKENS: usize = 1 << 20;

/// Longest `LookupRouteRequest.prompt_text`, in UTF-8 bytes: 1 MiB. A byte-level BPE tokenizer
/// yields at most one token per byte, so the ids stay within [`MAX_LOOKUP_TOKENS`]; 1 MiB is
/// ~250 k tokens of English text, longer than the context windows prompt text is routed for.
/// Longer text answers NO_HINT / `PromptTextTooLarge` (never an error: the gateway routes by
/// load).
pub const MAX_PROMPT_TEXT_BYTES: usize = 1 << 20;

/// Largest HF `tokenizer.json` the controller loads (`--tokenizer`): 64 MiB. Real ones are
/// 2–35 MB (DeepSeek V4 6 MB, Llama 3 9 MB, Gemma 3 33 MB).
pub const MAX_TOKENIZER_BYTES: u64 = 64 * 1024 * 1024;

/// Longest tenant, model, hash-scheme or backend string a `/probe` request may name: a
/// Kubernetes `namespace/name` is at most 63 + 1 + 253 bytes; model ids are shorter.
pub const MAX_NAME_BYTES: usize = 512;

/// Largest node plan file the agent reads (`--plan-file`): real plans are a few KiB.
pub const MAX_PLAN_BYTES: u64 = 4 * 1024 * 1024;

/// Largest input `ic-controller admit` reads (a file or stdin): the admission webhook's body
/// limit.
pub const MAX_ADMIT_BYTES: u64 = 8 * 1024 * 1024;

/// Deepest `[`/`{` nesting a YAML or JSON document read by [`read_bounded`]'s callers may have;
/// Pods and plans nest below 20.
pub const MAX_DOCUMENT_DEPTH: usize = 64;

/// Reads at most `max_bytes` bytes of UTF-8 text from `reader`.
///
/// # Errors
/// `InvalidData` naming the cap when the input is longer (reading stops one byte past the cap:
/// `/dev/zero` is not read to exhaustion) or is not UTF-8; the reader's own errors as they are.
pub fn read_bounded(reader: impl std::io::Read, max_bytes: u64) -> std::io::Result<String> {
    use std::io::Read as _;
    let mut buf = Vec::new();
    reader
        .take(max_bytes.saturating_add(1))
        .read_to_end(&mut buf)?;
    if buf.len() as u64 > max_bytes {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("input is larger than the cap of {max_bytes} bytes"),
        ));
    }
    String::from_utf8(buf)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))
}

/// Refuses YAML/JSON text whose flow nesting (`[`, `{` outside quotes and comments) is deeper
/// than `max_depth`, in one linear pass before a parser sees it (a 100 000-deep document
/// otherwise costs the YAML parser minutes of CPU). Block nesting is bounded by indentation
/// and so by the input size.
///
/// # Errors
/// A sentence with the line of the first bracket past the limit.
pub fn check_depth(text: &str, max_depth: usize) -> Result<(), String> {
    let (mut depth, mut line) = (0usize, 1usize);
    let (mut single, mut double, mut comment, mut escaped) = (false, false, false, false);
    let mut prev = '\n';
    for c in text.chars() {
        if c == '\n' {
            line += 1;
            comment = false;
        }
        if comment {
            prev = c;
            continue;
        }
        if double {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => double = false,
                _ => {}
            }
        } else if single {
            if c == '\'' {
                single = false;
            }
        } else {
            match c {
                '"' => double = true,
                '\'' if !prev.is_alphanumeric() => single = true,
                '#' if prev.is_whitespace() => comment = true,
                '[' | '{' => {
                    depth += 1;
                    if depth > max_depth {
                        return Err(format!(
                            "line {line}: nesting deeper than the limit of {max_depth} levels"
                        ));
                    }
                }
                ']' | '}' => depth = depth.saturating_sub(1),
                _ => {}
            }
        }
        prev = c;
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn reading_dev_zero_stops_at_the_cap() {
        let f = std::fs::File::open("/dev/zero");
        let Ok(f) = f else {
            // Not Linux; an endless reader stands in.
            let e = read_bounded(std::io::repeat(0), 1024).err();
            assert!(e.is_some_and(|e| e.to_string().contains("cap of 1024 bytes")));
            return;
        };
        let e = read_bounded(f, 1024 * 1024).err();
        assert!(
            e.is_some_and(|e| e.to_string().contains("cap of 1048576 bytes")),
            "reading /dev/zero must stop at the cap"
        );
        assert_eq!(
            read_bounded(&b"gpuNode: true\n"[..], 14).ok().as_deref(),
            Some("gpuNode: true\n")
        );
    }

    #[test]
    fn deep_flow_nesting_is_refused_before_parsing() {
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        let e = check_depth(&deep, MAX_DOCUMENT_DEPTH).err();
        assert!(e.is_some_and(|e| e.contains("limit of 64")));
        let ok = format!(
            "a: {}1{}\nb: \"[[[[\" # {{{{{{\nc: '{{{{'\n",
            "[".repeat(64),
            "]".repeat(64)
        );
        assert_eq!(check_depth(&ok, MAX_DOCUMENT_DEPTH), Ok(()));
        // Every real pod manifest in the fixtures passes.
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/pods");
        let mut n = 0;
        let entries = [root.to_string(), format!("{root}/topologies")]
            .into_iter()
            .flat_map(|d| std::fs::read_dir(d).unwrap().flatten());
        for e in entries {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "yaml" || x == "json") {
                let text = std::fs::read_to_string(&p).unwrap();
                assert_eq!(
                    check_depth(&text, MAX_DOCUMENT_DEPTH),
                    Ok(()),
                    "{}",
                    p.display()
                );
                n += 1;
            }
        }
        assert!(n > 0, "no pod fixtures found in {root}");
    }
}
