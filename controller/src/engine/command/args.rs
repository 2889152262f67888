//! Reading the engine's logical arguments: their texts, `--flag` occurrences (names
//! normalised, `_` as `-`), a flag's value, and flags hidden inside shell expansions that the
//! container's own `env` sets.

use k8s_openapi::api::core::v1::Container;

use super::{EngineCommand, FlagOcc};

impl EngineCommand {
    /// The first shell variable among the engine's arguments whose value, as the container's
    /// own `env` sets it literally, mentions one of `flags` (`_` and `-` equivalent; a flag
    /// ending in `-` is a prefix). Such a flag would be hidden from the adapter, so it must not
    /// add a second one. Returns `(variable, flag)`.
    pub fn hidden_flag(&self, container: &Container, flags: &[&str]) -> Option<(String, String)> {
        let env: Vec<(&str, &str)> = container
            .env
            .iter()
            .flatten()
            .filter_map(|e| e.value.as_deref().map(|v| (e.name.as_str(), v)))
            .collect();
        for a in self.args.iter().filter(|a| a.opaque) {
            for var in referenced_variables(&a.text) {
                let Some((_, value)) = env.iter().rev().find(|(n, _)| *n == var) else {
                    continue;
                };
                let value = value.replace('_', "-");
                for f in flags {
                    let f = f.replace('_', "-");
                    if value
                        .split(|c: char| c.is_whitespace() || c == '=' || c == '\'' || c == '"')
                        .any(|tok| {
                            if f.ends_with('-') {
                                tok.starts_with(&f)
                            } else {
                                tok == f
                            }
                        })
                    {
                        return Some((var, f));
                    }
                }
            }
        }
        None
    }

    /// The argument texts, in order.
    pub fn texts(&self) -> Vec<&str> {
        self.args.iter().map(|a| a.text.as_str()).collect()
    }

    /// The argument texts that are not shell expansions, in order (what the webhook and the
    /// node plan can read literally at admission).
    pub fn literal_texts(&self) -> Vec<&str> {
        self.args
            .iter()
            .filter(|a| !a.opaque)
            .map(|a| a.text.as_str())
            .collect()
    }

    /// Every `--flag` occurrence (tokens starting with `--`, except `--` itself), names
    /// normalised with [`normalize_flag`].
    pub fn flags(&self) -> Vec<FlagOcc> {
        self.args
            .iter()
            .enumerate()
            .filter(|(_, a)| {
                let name = a.text.split_once('=').map_or(a.text.as_str(), |(n, _)| n);
                a.text.starts_with("--")
                    && a.text.len() > 2
                    && !(a.opaque && name.contains(['$', '`']))
            })
            .map(|(index, a)| {
                let (name, inline) = match a.text.split_once('=') {
                    Some((n, v)) => (n, Some(v.to_string())),
                    None => (a.text.as_str(), None),
                };
                FlagOcc {
                    index,
                    name: normalize_flag(name),
                    inline,
                }
            })
            .collect()
    }

    /// Occurrences of one flag (`flag` in long form, e.g. `--kv-transfer-config`).
    pub fn find(&self, flag: &str) -> Vec<FlagOcc> {
        let want = normalize_flag(flag);
        self.flags()
            .into_iter()
            .filter(|f| f.name == want)
            .collect()
    }

    /// The value of a one-value flag occurrence: the inline value, or the next argument when
    /// it is not itself a flag. `None` when the value is missing. The second element is the
    /// index of the value argument (`None` for the inline form).
    pub fn value_of(&self, occ: &FlagOcc) -> Option<(String, Option<usize>)> {
        if let Some(v) = &occ.inline {
            return Some((v.clone(), None));
        }
        let next = self.args.get(occ.index + 1)?;
        if next.text.starts_with("--") {
            return None;
        }
        Some((next.text.clone(), Some(occ.index + 1)))
    }

    /// Whether argument `index` is a shell expansion.
    pub fn is_opaque(&self, index: usize) -> bool {
        self.args.get(index).is_some_and(|a| a.opaque)
    }

    /// The values following a flag token up to the next `-`-prefixed token (negative numbers
    /// count as values). Used to snapshot flags whose arity is unknown.
    pub fn greedy_values(&self, occ: &FlagOcc) -> Vec<String> {
        if let Some(v) = &occ.inline {
            return vec![v.clone()];
        }
        self.args[occ.index + 1..]
            .iter()
            .take_while(|a| {
                !a.text.starts_with('-')
                    || a.text[1..].starts_with(|c: char| c.is_ascii_digit() || c == '.')
            })
            .map(|a| a.text.clone())
            .collect()
    }
}

/// Names of the variables `$NAME` / `${NAME}` referenced in a word.
pub(super) fn referenced_variables(word: &str) -> Vec<String> {
    let b = word.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] != b'$' {
            i += 1;
            continue;
        }
        let braced = b.get(i + 1) == Some(&b'{');
        let start = if braced { i + 2 } else { i + 1 };
        let mut j = start;
        while j < b.len() && (b[j].is_ascii_alphanumeric() || b[j] == b'_') {
            j += 1;
        }
        if j > start && !b[start].is_ascii_digit() {
            out.push(word[start..j].to_string());
        }
        i = j.max(i + 1);
    }
    out
}

/// Normalises a long flag name for matching: the part before `=`, underscores as dashes
/// (`--kv_transfer_config` and `--kv-transfer-config` are the same vLLM flag).
pub fn normalize_flag(flag: &str) -> String {
    let name = flag.split_once('=').map(|(n, _)| n).unwrap_or(flag);
    match name.strip_prefix("--") {
        Some(rest) => format!("--{}", rest.replace('_', "-")),
        None => name.to_string(),
    }
}
