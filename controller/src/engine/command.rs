//! Engine command-line discovery and editing (spec 000 "Mutating Pod webhook": adapters preserve
//! the user's args and converge on the injected contract; issue 4 "Real pods").
//!
//! Engine pods launch vLLM and SGLang in many shapes. [`EngineCommand::parse`] finds the engine
//! invocation in a container and exposes the engine's own arguments as one logical list, whatever
//! the shape:
//!
//! | shape | example | where new flags go |
//! |---|---|---|
//! | direct exec | `command: [vllm, serve, m]`, `args: [--port, "8000"]` | appended to `args` |
//! | command only | `command: [/opt/venv/bin/vllm, serve, m, --port, "8000"]` | a new `args` list |
//! | image entrypoint | no `command`, `args: [--model, m]` | appended to `args` |
//! | shell script | `command: [/bin/sh, -c]`, `args: ["vllm serve m \\\n --port 8000"]` | inserted into the script, shell-quoted, at the end of the engine's simple command |
//! | script forwarding `"$@"` | `command: [sh, -c, 'exec python3 -m sglang.launch_server "$@"', --]`, `args: [...]` | appended to `args` (forwarded by `"$@"`) |
//!
//! Edits ([`Edit`]) address logical arguments; [`EngineCommand::apply`] writes them back to the
//! place each argument came from (a `command` or `args` element, or a word span of the script)
//! and then re-parses the result and checks that the engine now sees exactly the intended
//! argument list. Anything that cannot be edited safely is an error ([`CommandError`]); the pod
//! webhook turns it into a fail-open admit, so a pod may start unwired but never with a corrupted
//! command.

use k8s_openapi::api::core::v1::Container;

use ic_shared::crd::Runtime;

/// Why an engine command could not be found or changed safely. Each message names the problem
/// precisely enough for an operator to fix the pod.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommandError {
    /// Neither `command` nor `args` is set: the image's ENTRYPOINT and CMD run, and adding `args`
    /// would replace the CMD.
    #[error("container {container:?} sets neither command nor args (the image's own entrypoint and CMD run); adding args would replace the CMD")]
    NoCommand {
        /// Container name.
        container: String,
    },
    /// The container runs a script file (`sh start.sh`), whose content the webhook cannot see.
    #[error("container {container:?} runs a shell script file ({script:?}), whose content cannot be edited")]
    ScriptFile {
        /// Container name.
        container: String,
        /// The script path.
        script: String,
    },
    /// A shell `-c` option without a script string.
    #[error("container {container:?} runs a shell with -c but no script string")]
    MissingScript {
        /// Container name.
        container: String,
    },
    /// The script could not be tokenised (for example an unterminated quote).
    #[error("cannot parse the shell script of container {container:?}: {detail}")]
    Unparseable {
        /// Container name.
        container: String,
        /// What went wrong.
        detail: String,
    },
    /// No engine invocation was found.
    #[error("container {container:?} does not launch {runtime} (looked for {looked_for})")]
    EngineNotFound {
        /// Container name.
        container: String,
        /// Runtime wire spelling.
        runtime: &'static str,
        /// The invocations that were looked for.
        looked_for: &'static str,
    },
    /// The script launches the engine more than once.
    #[error("the shell script of container {container:?} launches {runtime} {count} times; cannot tell which invocation to wire")]
    MultipleEngines {
        /// Container name.
        container: String,
        /// Runtime wire spelling.
        runtime: &'static str,
        /// Number of invocations found.
        count: usize,
    },
    /// An edit would have to change a word that is a shell expansion.
    #[error("container {container:?}: argument {text:?} of the engine command is a shell expansion and cannot be edited")]
    OpaqueArgument {
        /// Container name.
        container: String,
        /// The raw argument.
        text: String,
    },
    /// An edit addressed an argument that does not exist (an internal error).
    #[error("internal error: edit addresses engine argument {index}, but the engine has {len}")]
    BadIndex {
        /// Index addressed.
        index: usize,
        /// Number of arguments.
        len: usize,
    },
    /// The edited command did not re-parse to the intended argument list.
    #[error("container {container:?}: the edited engine command could not be verified ({detail}); leaving the command unchanged")]
    VerificationFailed {
        /// Container name.
        container: String,
        /// The mismatch.
        detail: String,
    },
}

/// How the container launches the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommandForm {
    /// `command`/`args` exec the engine directly (possibly through a wrapper such as `tini`).
    Direct,
    /// No `command`: the image's entrypoint receives `args`.
    ImageEntrypoint,
    /// A shell `-c` script launches the engine.
    Shell,
}

/// Where one argument of the full argv lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Command(usize),
    Args(usize),
}

/// Where one logical engine argument lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Loc {
    /// An element of `command` or `args`.
    Argv(Slot),
    /// A word of the script, by byte span.
    Script { start: usize, end: usize },
}

/// One argument the engine receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineArg {
    /// The argument as the engine receives it (quotes removed; expansions such as `$X` kept
    /// literally).
    pub text: String,
    /// True when the argument is (or contains) a shell expansion whose value is unknown.
    pub opaque: bool,
    loc: Loc,
}

/// Where appended arguments go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AppendTarget {
    /// The tail of the container's argv (`args`, created when absent).
    Argv,
    /// Inserted into the script at this byte offset.
    Script(usize),
}

/// One change to the engine's logical argument list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Edit {
    /// Replace argument `index` with `tokens` (one or more arguments, or none to delete it).
    Replace {
        /// Logical argument index.
        index: usize,
        /// Replacement arguments.
        tokens: Vec<String>,
    },
    /// Append arguments at the end of the engine's arguments.
    Append(Vec<String>),
}

/// One occurrence of a `--flag` among the engine arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlagOcc {
    /// Index of the flag token.
    pub index: usize,
    /// Normalised name (`--kv_transfer_config` → `--kv-transfer-config`).
    pub name: String,
    /// The value given inline (`--flag=value`).
    pub inline: Option<String>,
}

/// The engine invocation of one container: the engine's arguments and how to edit them.
#[derive(Debug, Clone)]
pub struct EngineCommand {
    /// Container name (for messages).
    pub container: String,
    /// Runtime whose engine was found.
    pub runtime: Runtime,
    /// How the engine is launched.
    pub form: CommandForm,
    /// Whether the engine invocation itself was seen (false for an image entrypoint that
    /// receives `args` without naming the engine).
    pub found_engine: bool,
    /// The engine's arguments after the engine invocation (`vllm serve` / `-m module`).
    pub args: Vec<EngineArg>,
    /// The Python interpreter that runs the engine, when it can be derived from the command
    /// (`/opt/venv/bin/vllm` → `/opt/venv/bin/python3`).
    pub python: Option<String>,
    /// Notes about things the webhook cannot see (shell expansions among the engine's
    /// arguments).
    pub warnings: Vec<String>,
    append: AppendTarget,
    /// The argv slot that holds the script (shell form).
    script_slot: Option<Slot>,
    script: String,
}

/// What `looked_for` says per runtime.
fn looked_for(runtime: Runtime) -> &'static str {
    match runtime {
        Runtime::Vllm => "`vllm serve`, `python -m vllm.entrypoints.openai.api_server`",
        Runtime::SgLang => "`python -m sglang.launch_server`, `sglang serve`",
    }
}

fn basename(s: &str) -> &str {
    s.rsplit('/').next().unwrap_or(s)
}

fn is_shell(s: &str) -> bool {
    matches!(
        basename(s),
        "sh" | "bash" | "dash" | "ash" | "zsh" | "ksh" | "busybox"
    )
}

fn is_python(s: &str) -> bool {
    let b = basename(s);
    b == "python" || b.starts_with("python3") || b.starts_with("python2")
}

/// Finds the engine invocation in a word list: returns (index of the last marker token,
/// interpreter) for the first invocation, and the number of invocations.
fn find_marker(words: &[&str], runtime: Runtime) -> (Option<(usize, Option<String>)>, usize) {
    let mut first = None;
    let mut count = 0;
    let mut i = 0;
    while i < words.len() {
        let w = words[i];
        let next = words.get(i + 1).copied();
        let hit: Option<(usize, Option<String>)> = match runtime {
            Runtime::Vllm => {
                if basename(w) == "vllm" && next == Some("serve") {
                    Some((i + 1, sibling_python(w)))
                } else if w == "-m"
                    && matches!(
                        next,
                        Some("vllm.entrypoints.openai.api_server")
                            | Some("vllm.entrypoints.api_server")
                    )
                {
                    Some((i + 1, preceding_python(words, i)))
                } else if w == "-m"
                    && next == Some("vllm.entrypoints.cli.main")
                    && words.get(i + 2).copied() == Some("serve")
                {
                    Some((i + 2, preceding_python(words, i)))
                } else {
                    None
                }
            }
            Runtime::SgLang => {
                if w == "-m" && next == Some("sglang.launch_server") {
                    Some((i + 1, preceding_python(words, i)))
                } else if basename(w) == "sglang" && next == Some("serve") {
                    Some((i + 1, sibling_python(w)))
                } else {
                    None
                }
            }
        };
        if let Some((end, py)) = hit {
            count += 1;
            if first.is_none() {
                first = Some((end, py));
            }
            i = end + 1;
        } else {
            i += 1;
        }
    }
    (first, count)
}

/// `/opt/venv/bin/vllm` → `/opt/venv/bin/python3`; a bare `vllm` gives nothing.
fn sibling_python(exe: &str) -> Option<String> {
    let (dir, _) = exe.rsplit_once('/')?;
    if dir.is_empty() {
        return None;
    }
    Some(format!("{dir}/python3"))
}

/// The interpreter word before `-m` (skipping interpreter options such as `-u`).
fn preceding_python(words: &[&str], m_index: usize) -> Option<String> {
    words[..m_index]
        .iter()
        .rev()
        .take_while(|w| w.starts_with('-') || is_python(w))
        .find(|w| is_python(w))
        .map(|w| (*w).to_string())
}

impl EngineCommand {
    /// Finds the `runtime` engine invocation in `container`.
    ///
    /// Errors: [`CommandError::NoCommand`] when neither `command` nor `args` is set,
    /// [`CommandError::ScriptFile`] for `sh file.sh`, [`CommandError::EngineNotFound`] when no
    /// invocation is visible (a container without `command` is accepted as
    /// [`CommandForm::ImageEntrypoint`] instead), [`CommandError::MultipleEngines`] and
    /// [`CommandError::Unparseable`] for scripts.
    pub fn parse(container: &Container, runtime: Runtime) -> Result<Self, CommandError> {
        let name = container.name.clone();
        let command = container.command.as_deref().unwrap_or(&[]);
        let args = container.args.as_deref().unwrap_or(&[]);
        let mut argv: Vec<(&str, Slot)> = Vec::with_capacity(command.len() + args.len());
        argv.extend(
            command
                .iter()
                .enumerate()
                .map(|(i, s)| (s.as_str(), Slot::Command(i))),
        );
        argv.extend(
            args.iter()
                .enumerate()
                .map(|(i, s)| (s.as_str(), Slot::Args(i))),
        );
        if argv.is_empty() {
            return Err(CommandError::NoCommand { container: name });
        }
        let words: Vec<&str> = argv.iter().map(|(s, _)| *s).collect();

        // Shell form: [wrappers…] sh [options] -c SCRIPT [$0 [$1 …]].
        if let Some(shell_at) = shell_position(&words) {
            return Self::parse_shell(&name, runtime, &argv, shell_at);
        }

        let (marker, _) = find_marker(&words, runtime);
        match marker {
            Some((end, python)) => Ok(EngineCommand {
                container: name,
                runtime,
                form: if command.is_empty() {
                    CommandForm::ImageEntrypoint
                } else {
                    CommandForm::Direct
                },
                found_engine: true,
                args: argv[end + 1..]
                    .iter()
                    .map(|(s, slot)| EngineArg {
                        text: (*s).to_string(),
                        opaque: false,
                        loc: Loc::Argv(*slot),
                    })
                    .collect(),
                python,
                warnings: Vec::new(),
                append: AppendTarget::Argv,
                script_slot: None,
                script: String::new(),
            }),
            None if command.is_empty() => Ok(EngineCommand {
                container: name,
                runtime,
                form: CommandForm::ImageEntrypoint,
                found_engine: false,
                args: argv
                    .iter()
                    .map(|(s, slot)| EngineArg {
                        text: (*s).to_string(),
                        opaque: false,
                        loc: Loc::Argv(*slot),
                    })
                    .collect(),
                python: None,
                warnings: Vec::new(),
                append: AppendTarget::Argv,
                script_slot: None,
                script: String::new(),
            }),
            None => Err(CommandError::EngineNotFound {
                container: name,
                runtime: runtime.as_str(),
                looked_for: looked_for(runtime),
            }),
        }
    }

    fn parse_shell(
        name: &str,
        runtime: Runtime,
        argv: &[(&str, Slot)],
        shell_at: usize,
    ) -> Result<Self, CommandError> {
        // Shell options up to the script.
        let mut i = shell_at + 1;
        let mut has_c = false;
        while i < argv.len() {
            let w = argv[i].0;
            if w == "--" {
                i += 1;
                break;
            }
            if w == "-o" || w == "+o" {
                i += 2;
                continue;
            }
            if w.starts_with("--") {
                i += 1;
                continue;
            }
            if (w.starts_with('-') || w.starts_with('+')) && w.len() > 1 {
                if w.starts_with('-') && w[1..].contains('c') {
                    has_c = true;
                }
                i += 1;
                continue;
            }
            break;
        }
        if !has_c {
            return match argv.get(i) {
                Some((script, _)) => Err(CommandError::ScriptFile {
                    container: name.to_string(),
                    script: (*script).to_string(),
                }),
                None => Err(CommandError::EngineNotFound {
                    container: name.to_string(),
                    runtime: runtime.as_str(),
                    looked_for: looked_for(runtime),
                }),
            };
        }
        let Some((script, script_slot)) = argv.get(i).copied() else {
            return Err(CommandError::MissingScript {
                container: name.to_string(),
            });
        };
        // argv after the script: $0, then the positional parameters "$@" expands to.
        let positional: &[(&str, Slot)] = argv.get(i + 2..).unwrap_or(&[]);
        let has_dollar0 = argv.len() > i + 1;

        let segments = lex(script).map_err(|detail| CommandError::Unparseable {
            container: name.to_string(),
            detail,
        })?;
        // Each simple command with "$@" expanded into the positional parameters, so an engine
        // launched from the forwarded arguments (`exec "$@"`) is found too.
        struct Item {
            text: String,
            loc: Loc,
            opaque: bool,
            raw: String,
        }
        let expand = |seg: &Segment| -> Result<(Vec<Item>, bool), CommandError> {
            let mut items = Vec::new();
            let mut forwards = false;
            for w in &seg.words {
                if w.dollar_at {
                    if forwards {
                        return Err(CommandError::Unparseable {
                            container: name.to_string(),
                            detail: "\"$@\" appears more than once in one command".to_string(),
                        });
                    }
                    forwards = true;
                    items.extend(positional.iter().map(|(s, slot)| Item {
                        text: (*s).to_string(),
                        loc: Loc::Argv(*slot),
                        opaque: false,
                        raw: (*s).to_string(),
                    }));
                } else {
                    items.push(Item {
                        text: w.text.clone(),
                        loc: Loc::Script {
                            start: w.start,
                            end: w.end,
                        },
                        opaque: w.expansion,
                        raw: script[w.start..w.end].to_string(),
                    });
                }
            }
            Ok((items, forwards))
        };
        let mut found: Vec<(usize, usize, Option<String>)> = Vec::new();
        for (si, seg) in segments.iter().enumerate() {
            let Ok((items, _)) = expand(seg) else {
                continue;
            };
            let texts: Vec<&str> = items.iter().map(|w| w.text.as_str()).collect();
            let (marker, count) = find_marker(&texts, runtime);
            if let Some((end, py)) = marker {
                for _ in 0..count {
                    found.push((si, end, py.clone()));
                }
            }
        }
        let (seg_index, marker_end, python) = match found.len() {
            0 => {
                return Err(CommandError::EngineNotFound {
                    container: name.to_string(),
                    runtime: runtime.as_str(),
                    looked_for: looked_for(runtime),
                })
            }
            1 => found.remove(0),
            n => {
                return Err(CommandError::MultipleEngines {
                    container: name.to_string(),
                    runtime: runtime.as_str(),
                    count: n,
                })
            }
        };
        let seg = &segments[seg_index];
        // Cross-check the tokeniser against shell-words on the engine's simple command when it
        // has no expansions (both must agree on every word).
        if seg.words.iter().all(|w| !w.expansion) {
            if let (Some(first), Some(last)) = (seg.words.first(), seg.words.last()) {
                let raw = &script[first.start..last.end];
                match shell_words::split(raw) {
                    Ok(split) => {
                        let ours: Vec<&str> = seg.words.iter().map(|w| w.text.as_str()).collect();
                        if split != ours {
                            return Err(CommandError::Unparseable {
                                container: name.to_string(),
                                detail: format!(
                                    "the engine command splits differently with shell-words ({split:?} vs {ours:?})"
                                ),
                            });
                        }
                    }
                    Err(e) => {
                        return Err(CommandError::Unparseable {
                            container: name.to_string(),
                            detail: e.to_string(),
                        })
                    }
                }
            }
        }

        let (items, _) = expand(seg)?;
        // New arguments go to the end of argv when the command ends with "$@" (and argv has a
        // $0, so they are forwarded); otherwise into the script after the command's last word.
        let forwards = seg.words.last().is_some_and(|w| w.dollar_at);
        let mut args = Vec::new();
        let mut warnings = Vec::new();
        for it in items.into_iter().skip(marker_end + 1) {
            if it.opaque {
                warnings.push(format!(
                    "container {name:?}: engine argument {:?} is a shell expansion; flags it may carry cannot be seen",
                    it.raw
                ));
            }
            args.push(EngineArg {
                text: it.text,
                opaque: it.opaque,
                loc: it.loc,
            });
        }
        let append = if forwards && has_dollar0 {
            AppendTarget::Argv
        } else {
            // Insert after the last word of the engine's simple command.
            let at = seg.words.last().map(|w| w.end).unwrap_or(script.len());
            AppendTarget::Script(at)
        };
        Ok(EngineCommand {
            container: name.to_string(),
            runtime,
            form: CommandForm::Shell,
            found_engine: true,
            args,
            python,
            warnings,
            append,
            script_slot: Some(script_slot),
            script: script.to_string(),
        })
    }

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

    /// The logical argument list after `edits`.
    fn edited_texts(&self, edits: &[Edit]) -> Result<Vec<String>, CommandError> {
        let mut out: Vec<Option<Vec<String>>> = self
            .args
            .iter()
            .map(|a| Some(vec![a.text.clone()]))
            .collect();
        let mut tail = Vec::new();
        for e in edits {
            match e {
                Edit::Replace { index, tokens } => {
                    let slot = out.get_mut(*index).ok_or(CommandError::BadIndex {
                        index: *index,
                        len: self.args.len(),
                    })?;
                    *slot = Some(tokens.clone());
                }
                Edit::Append(tokens) => tail.extend(tokens.iter().cloned()),
            }
        }
        let mut texts: Vec<String> = out.into_iter().flatten().flatten().collect();
        texts.extend(tail);
        Ok(texts)
    }

    /// Applies `edits` to `container` (which must be the container this command was parsed
    /// from) and returns the edited container. The result is re-parsed and must yield exactly
    /// the intended engine arguments, else [`CommandError::VerificationFailed`]. Editing a shell
    /// expansion is [`CommandError::OpaqueArgument`].
    pub fn apply(&self, container: &Container, edits: &[Edit]) -> Result<Container, CommandError> {
        if edits.is_empty() {
            return Ok(container.clone());
        }
        let expected = self.edited_texts(edits)?;
        let mut command: Vec<Option<Vec<String>>> = container
            .command
            .iter()
            .flatten()
            .map(|s| Some(vec![s.clone()]))
            .collect();
        let mut args: Vec<Option<Vec<String>>> = container
            .args
            .iter()
            .flatten()
            .map(|s| Some(vec![s.clone()]))
            .collect();
        // Script edits: (start, end, replacement text).
        let mut script_edits: Vec<(usize, usize, String)> = Vec::new();
        let mut appended: Vec<String> = Vec::new();

        for e in edits {
            match e {
                Edit::Replace { index, tokens } => {
                    let arg = self.args.get(*index).ok_or(CommandError::BadIndex {
                        index: *index,
                        len: self.args.len(),
                    })?;
                    if arg.opaque {
                        return Err(CommandError::OpaqueArgument {
                            container: self.container.clone(),
                            text: arg.text.clone(),
                        });
                    }
                    match arg.loc {
                        Loc::Argv(Slot::Command(i)) => {
                            if let Some(s) = command.get_mut(i) {
                                *s = Some(tokens.clone());
                            }
                        }
                        Loc::Argv(Slot::Args(i)) => {
                            if let Some(s) = args.get_mut(i) {
                                *s = Some(tokens.clone());
                            }
                        }
                        Loc::Script { start, end } => {
                            if tokens.is_empty() {
                                // Remove the word and the blank (or line continuation) before it.
                                let from = blank_start(&self.script, start);
                                script_edits.push((from, end, String::new()));
                            } else {
                                script_edits.push((start, end, quote_all(tokens)));
                            }
                        }
                    }
                }
                Edit::Append(tokens) => appended.extend(tokens.iter().cloned()),
            }
        }
        if !appended.is_empty() {
            match self.append {
                AppendTarget::Argv => args.push(Some(appended)),
                AppendTarget::Script(at) => {
                    script_edits.push((at, at, format!(" {}", quote_all(&appended))));
                }
            }
        }
        if !script_edits.is_empty() {
            let Some(slot) = self.script_slot else {
                return Err(CommandError::VerificationFailed {
                    container: self.container.clone(),
                    detail: "script edit without a script".to_string(),
                });
            };
            script_edits.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)));
            let mut script = self.script.clone();
            let mut last_start = usize::MAX;
            for (start, end, text) in script_edits {
                if end > last_start || end > script.len() || start > end {
                    return Err(CommandError::VerificationFailed {
                        container: self.container.clone(),
                        detail: "overlapping script edits".to_string(),
                    });
                }
                script.replace_range(start..end, &text);
                last_start = start;
            }
            let target = match slot {
                Slot::Command(i) => command.get_mut(i),
                Slot::Args(i) => args.get_mut(i),
            };
            if let Some(t) = target {
                *t = Some(vec![script]);
            }
        }
        let mut out = container.clone();
        let flatten = |v: Vec<Option<Vec<String>>>| -> Vec<String> {
            v.into_iter().flatten().flatten().collect()
        };
        let had_command = container.command.is_some();
        let new_command = flatten(command);
        let new_args = flatten(args);
        out.command = if new_command.is_empty() && !had_command {
            None
        } else {
            Some(new_command)
        };
        out.args = if new_args.is_empty() && container.args.is_none() {
            None
        } else {
            Some(new_args)
        };

        // Verify: the engine must now see exactly `expected`.
        let reparsed = EngineCommand::parse(&out, self.runtime).map_err(|e| {
            CommandError::VerificationFailed {
                container: self.container.clone(),
                detail: e.to_string(),
            }
        })?;
        let got: Vec<&str> = reparsed.texts();
        if got != expected.iter().map(String::as_str).collect::<Vec<_>>() {
            return Err(CommandError::VerificationFailed {
                container: self.container.clone(),
                detail: format!("expected engine arguments {expected:?}, got {got:?}"),
            });
        }
        Ok(out)
    }
}

/// Names of the variables `$NAME` / `${NAME}` referenced in a word.
fn referenced_variables(word: &str) -> Vec<String> {
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

fn quote_all(tokens: &[String]) -> String {
    tokens
        .iter()
        .map(|t| shell_words::quote(t).into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Start of the blank run (spaces, tabs, line continuations) ending at `at`.
fn blank_start(script: &str, at: usize) -> usize {
    let bytes = script.as_bytes();
    let mut i = at;
    loop {
        if i >= 1 && (bytes[i - 1] == b' ' || bytes[i - 1] == b'\t') {
            i -= 1;
        } else if i >= 2 && bytes[i - 1] == b'\n' && bytes[i - 2] == b'\\' {
            i -= 2;
        } else {
            return i;
        }
    }
}

/// Index of the shell in `words` when the argv runs `[wrapper…] sh …`: the shell is argv[0], or
/// follows `env` (with `VAR=value` and options), `tini`/`dumb-init` (with `--`).
fn shell_position(words: &[&str]) -> Option<usize> {
    let mut i = 0;
    while i < words.len() {
        let w = words[i];
        if is_shell(w) {
            return Some(i);
        }
        let b = basename(w);
        if b == "env" || b == "tini" || b == "dumb-init" {
            i += 1;
            while i < words.len()
                && (words[i].starts_with('-') || (words[i].contains('=') && b == "env"))
            {
                i += 1;
            }
            continue;
        }
        return None;
    }
    None
}

// ---------------------------------------------------------------------------------------------
// A small POSIX shell tokeniser: enough to find simple commands and their words with byte spans.
// ---------------------------------------------------------------------------------------------

/// One word of a shell script.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Word {
    /// The word with quotes and escapes removed (expansions kept literally).
    text: String,
    start: usize,
    end: usize,
    /// Contains an unquoted or double-quoted expansion (`$x`, `${x}`, `$(…)`, backticks).
    expansion: bool,
    /// The word is exactly `"$@"`, `$@`, `"${@}"` or `${@}`.
    dollar_at: bool,
}

/// The words of one simple command (separated by newlines, `;`, `&`, `|`, parentheses or a
/// redirection).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Segment {
    words: Vec<Word>,
}

struct Lexer<'a> {
    s: &'a str,
    b: &'a [u8],
    i: usize,
    segments: Vec<Segment>,
    cur: Segment,
    heredocs: Vec<(String, bool)>,
}

/// Tokenises `script` into simple commands. Errors name an unterminated quote or substitution.
fn lex(script: &str) -> Result<Vec<Segment>, String> {
    let mut lx = Lexer {
        s: script,
        b: script.as_bytes(),
        i: 0,
        segments: Vec::new(),
        cur: Segment::default(),
        heredocs: Vec::new(),
    };
    lx.run()?;
    Ok(lx.segments)
}

impl Lexer<'_> {
    fn end_segment(&mut self) {
        if !self.cur.words.is_empty() {
            self.segments.push(std::mem::take(&mut self.cur));
        }
    }

    fn peek(&self, off: usize) -> Option<u8> {
        self.b.get(self.i + off).copied()
    }

    fn run(&mut self) -> Result<(), String> {
        while self.i < self.b.len() {
            let c = self.b[self.i];
            match c {
                b' ' | b'\t' => self.i += 1,
                b'\\' if self.peek(1) == Some(b'\n') => self.i += 2,
                b'\n' => {
                    self.end_segment();
                    self.i += 1;
                    self.skip_heredocs();
                }
                b'#' => {
                    while self.i < self.b.len() && self.b[self.i] != b'\n' {
                        self.i += 1;
                    }
                }
                b';' | b'&' | b'|' | b'(' | b')' => {
                    self.end_segment();
                    self.i += 1;
                }
                b'<' | b'>' => {
                    self.end_segment();
                    self.redirection()?;
                }
                _ => {
                    let w = self.word()?;
                    // `2>&1`: a number directly before a redirection is a file descriptor.
                    if matches!(self.peek(0), Some(b'<') | Some(b'>'))
                        && !w.text.is_empty()
                        && w.text.bytes().all(|d| d.is_ascii_digit())
                        && w.end - w.start == w.text.len()
                    {
                        self.end_segment();
                        self.redirection()?;
                    } else {
                        self.cur.words.push(w);
                    }
                }
            }
        }
        self.end_segment();
        Ok(())
    }

    /// At `<` or `>`: consumes the operator and its target word; records heredocs.
    fn redirection(&mut self) -> Result<(), String> {
        let heredoc = self.peek(0) == Some(b'<') && self.peek(1) == Some(b'<');
        let mut strip_tabs = false;
        if heredoc {
            self.i += 2;
            if self.peek(0) == Some(b'-') {
                strip_tabs = true;
                self.i += 1;
            } else if self.peek(0) == Some(b'<') {
                // here-string `<<<`: the next word is the string.
                self.i += 1;
                self.skip_blanks();
                if self.i < self.b.len() && !matches!(self.b[self.i], b'\n' | b';' | b'&' | b'|') {
                    self.word()?;
                }
                return Ok(());
            }
        } else {
            while matches!(
                self.peek(0),
                Some(b'<') | Some(b'>') | Some(b'&') | Some(b'|')
            ) {
                self.i += 1;
            }
        }
        self.skip_blanks();
        if self.i < self.b.len() && !matches!(self.b[self.i], b'\n' | b';' | b'&' | b'|') {
            let target = self.word()?;
            if heredoc {
                self.heredocs.push((target.text, strip_tabs));
            }
        }
        Ok(())
    }

    fn skip_blanks(&mut self) {
        while matches!(self.peek(0), Some(b' ') | Some(b'\t')) {
            self.i += 1;
        }
    }

    /// After a newline: skips pending heredoc bodies.
    fn skip_heredocs(&mut self) {
        let pending = std::mem::take(&mut self.heredocs);
        for (delim, strip_tabs) in pending {
            loop {
                if self.i >= self.b.len() {
                    return;
                }
                let line_end = self.s[self.i..]
                    .find('\n')
                    .map(|p| self.i + p)
                    .unwrap_or(self.b.len());
                let line = &self.s[self.i..line_end];
                let line = if strip_tabs {
                    line.trim_start_matches('\t')
                } else {
                    line
                };
                self.i = (line_end + 1).min(self.b.len());
                if line == delim {
                    break;
                }
            }
        }
    }

    /// Reads one word starting at the current position.
    fn word(&mut self) -> Result<Word, String> {
        let start = self.i;
        let mut text = String::new();
        let mut expansion = false;
        while self.i < self.b.len() {
            let c = self.b[self.i];
            match c {
                b' ' | b'\t' | b'\n' | b';' | b'&' | b'|' | b'(' | b')' | b'<' | b'>' => break,
                b'\'' => {
                    let close = self.s[self.i + 1..]
                        .find('\'')
                        .ok_or_else(|| format!("unterminated single quote at byte {}", self.i))?;
                    text.push_str(&self.s[self.i + 1..self.i + 1 + close]);
                    self.i += close + 2;
                }
                b'"' => {
                    self.i += 1;
                    loop {
                        let Some(d) = self.peek(0) else {
                            return Err(format!("unterminated double quote at byte {start}"));
                        };
                        match d {
                            b'"' => {
                                self.i += 1;
                                break;
                            }
                            b'\\' => match self.peek(1) {
                                Some(b'\n') => self.i += 2,
                                Some(e @ (b'$' | b'`' | b'"' | b'\\')) => {
                                    text.push(e as char);
                                    self.i += 2;
                                }
                                _ => {
                                    text.push('\\');
                                    self.i += 1;
                                }
                            },
                            b'$' | b'`' => {
                                expansion = true;
                                let from = self.i;
                                self.expansion()?;
                                text.push_str(&self.s[from..self.i]);
                            }
                            _ => {
                                let ch = self.s[self.i..].chars().next().unwrap_or('\u{fffd}');
                                text.push(ch);
                                self.i += ch.len_utf8().max(1);
                            }
                        }
                    }
                }
                b'\\' => match self.peek(1) {
                    Some(b'\n') => self.i += 2,
                    Some(_) => {
                        let ch = self.s[self.i + 1..].chars().next().unwrap_or('\u{fffd}');
                        text.push(ch);
                        self.i += 1 + ch.len_utf8().max(1);
                    }
                    None => {
                        self.i += 1;
                    }
                },
                b'$' | b'`' => {
                    expansion = true;
                    let from = self.i;
                    self.expansion()?;
                    text.push_str(&self.s[from..self.i]);
                }
                _ => {
                    let ch = self.s[self.i..].chars().next().unwrap_or('\u{fffd}');
                    text.push(ch);
                    self.i += ch.len_utf8().max(1);
                }
            }
        }
        let raw = &self.s[start..self.i];
        let dollar_at = matches!(raw, "\"$@\"" | "$@" | "\"${@}\"" | "${@}");
        Ok(Word {
            text,
            start,
            end: self.i,
            expansion,
            dollar_at,
        })
    }

    /// At `$` or a backtick: skips the expansion.
    fn expansion(&mut self) -> Result<(), String> {
        let c = self.b[self.i];
        if c == b'`' {
            let close = self.s[self.i + 1..]
                .find('`')
                .ok_or_else(|| format!("unterminated backquote at byte {}", self.i))?;
            self.i += close + 2;
            return Ok(());
        }
        // `$`
        match self.peek(1) {
            Some(b'(') => {
                self.i += 1;
                self.balanced(b'(', b')')
            }
            Some(b'{') => {
                self.i += 1;
                self.balanced(b'{', b'}')
            }
            Some(d) if d.is_ascii_alphabetic() || d == b'_' => {
                self.i += 1;
                while matches!(self.peek(0), Some(x) if x.is_ascii_alphanumeric() || x == b'_') {
                    self.i += 1;
                }
                Ok(())
            }
            Some(b'@' | b'*' | b'#' | b'?' | b'-' | b'$' | b'!' | b'0'..=b'9') => {
                self.i += 2;
                Ok(())
            }
            _ => {
                // A lone `$` is literal.
                self.i += 1;
                Ok(())
            }
        }
    }

    /// At `open`: skips to the matching `close`, respecting quotes.
    fn balanced(&mut self, open: u8, close: u8) -> Result<(), String> {
        let start = self.i;
        let mut depth = 0usize;
        while self.i < self.b.len() {
            let c = self.b[self.i];
            match c {
                b'\\' => self.i += 2,
                b'\'' => {
                    let close_at = self.s[self.i + 1..]
                        .find('\'')
                        .ok_or_else(|| format!("unterminated single quote at byte {}", self.i))?;
                    self.i += close_at + 2;
                }
                b'"' => {
                    self.i += 1;
                    while self.i < self.b.len() && self.b[self.i] != b'"' {
                        if self.b[self.i] == b'\\' {
                            self.i += 1;
                        }
                        self.i += 1;
                    }
                    self.i += 1;
                }
                _ if c == open => {
                    depth += 1;
                    self.i += 1;
                }
                _ if c == close => {
                    depth = depth.saturating_sub(1);
                    self.i += 1;
                    if depth == 0 {
                        return Ok(());
                    }
                }
                _ => self.i += 1,
            }
        }
        Err(format!(
            "unterminated substitution starting at byte {start}"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn container(command: &[&str], args: &[&str]) -> Container {
        Container {
            name: "engine".into(),
            command: if command.is_empty() {
                None
            } else {
                Some(command.iter().map(|s| s.to_string()).collect())
            },
            args: if args.is_empty() {
                None
            } else {
                Some(args.iter().map(|s| s.to_string()).collect())
            },
            ..Default::default()
        }
    }

    #[test]
    fn lexes_words_quotes_and_operators() {
        let segs =
            lex("pip install x && exec vllm serve 'm o' --a \"b c\" # hi\necho $X; true").unwrap();
        let texts: Vec<Vec<&str>> = segs
            .iter()
            .map(|s| s.words.iter().map(|w| w.text.as_str()).collect())
            .collect();
        assert_eq!(
            texts,
            vec![
                vec!["pip", "install", "x"],
                vec!["exec", "vllm", "serve", "m o", "--a", "b c"],
                vec!["echo", "$X"],
                vec!["true"],
            ]
        );
        assert!(segs[2].words[1].expansion);
    }

    #[test]
    fn lexes_continuations_and_heredocs() {
        let segs =
            lex("cat > f <<'EOF'\nvllm serve nope\nEOF\nvllm serve m \\\n  --port 1 \\\n").unwrap();
        let texts: Vec<Vec<&str>> = segs
            .iter()
            .map(|s| s.words.iter().map(|w| w.text.as_str()).collect())
            .collect();
        assert_eq!(
            texts,
            vec![vec!["cat"], vec!["vllm", "serve", "m", "--port", "1"]]
        );
    }

    #[test]
    fn lex_errors_on_unterminated_quote() {
        assert!(lex("vllm serve 'oops").is_err());
        assert!(lex("vllm serve $(echo").is_err());
    }

    #[test]
    fn direct_command_and_args() {
        let c = container(
            &["python3", "-m", "vllm.entrypoints.openai.api_server"],
            &["--model", "m", "--port", "8000"],
        );
        let cmd = EngineCommand::parse(&c, Runtime::Vllm).unwrap();
        assert_eq!(cmd.form, CommandForm::Direct);
        assert_eq!(cmd.texts(), vec!["--model", "m", "--port", "8000"]);
        assert_eq!(cmd.python.as_deref(), Some("python3"));
        let out = cmd
            .apply(&c, &[Edit::Append(vec!["--x".into(), "{\"a\":1}".into()])])
            .unwrap();
        assert_eq!(
            out.args.unwrap(),
            vec!["--model", "m", "--port", "8000", "--x", "{\"a\":1}"]
        );
    }

    #[test]
    fn command_only_gets_an_args_list() {
        let c = container(&["/opt/venv/bin/vllm", "serve", "m", "--port", "8000"], &[]);
        let cmd = EngineCommand::parse(&c, Runtime::Vllm).unwrap();
        assert_eq!(cmd.python.as_deref(), Some("/opt/venv/bin/python3"));
        let out = cmd.apply(&c, &[Edit::Append(vec!["--y".into()])]).unwrap();
        assert_eq!(out.command, c.command);
        assert_eq!(out.args.unwrap(), vec!["--y"]);
    }

    #[test]
    fn image_entrypoint_args_only() {
        let c = container(&[], &["--model", "m"]);
        let cmd = EngineCommand::parse(&c, Runtime::Vllm).unwrap();
        assert_eq!(cmd.form, CommandForm::ImageEntrypoint);
        assert_eq!(cmd.texts(), vec!["--model", "m"]);
    }

    #[test]
    fn no_command_is_an_error() {
        let c = container(&[], &[]);
        assert!(matches!(
            EngineCommand::parse(&c, Runtime::Vllm),
            Err(CommandError::NoCommand { .. })
        ));
    }

    #[test]
    fn sh_c_script_insertion_is_quoted() {
        let c = container(
            &["/bin/sh", "-c"],
            &["vllm serve m --max_num_batched_tokens 1024"],
        );
        let cmd = EngineCommand::parse(&c, Runtime::Vllm).unwrap();
        assert_eq!(cmd.form, CommandForm::Shell);
        assert_eq!(cmd.find("--max-num-batched-tokens").len(), 1);
        let json = r#"{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}"#;
        let out = cmd
            .apply(
                &c,
                &[Edit::Append(vec![
                    "--kv-transfer-config".into(),
                    json.into(),
                ])],
            )
            .unwrap();
        assert_eq!(
            out.args.unwrap()[0],
            format!("vllm serve m --max_num_batched_tokens 1024 --kv-transfer-config '{json}'")
        );
    }

    #[test]
    fn trailing_backslashes_keep_the_continuation() {
        let script = "set -e\nexec vllm serve m \\\n  --port 8000 \\\n  --foo bar\n";
        let c = container(&["bash", "-lc", script], &[]);
        let cmd = EngineCommand::parse(&c, Runtime::Vllm).unwrap();
        assert_eq!(cmd.texts(), vec!["m", "--port", "8000", "--foo", "bar"]);
        let out = cmd.apply(&c, &[Edit::Append(vec!["--z".into()])]).unwrap();
        assert_eq!(
            out.command.unwrap()[2],
            "set -e\nexec vllm serve m \\\n  --port 8000 \\\n  --foo bar --z\n"
        );
    }

    #[test]
    fn trailing_backslash_at_end_of_script() {
        let script = "vllm serve m \\\n  --port 8000 \\\n";
        let c = container(&["sh", "-c", script], &[]);
        let cmd = EngineCommand::parse(&c, Runtime::Vllm).unwrap();
        let out = cmd.apply(&c, &[Edit::Append(vec!["--z".into()])]).unwrap();
        assert_eq!(
            out.command.unwrap()[2],
            "vllm serve m \\\n  --port 8000 --z \\\n"
        );
    }

    #[test]
    fn dollar_at_forwarding_appends_to_args() {
        let c = container(
            &[
                "/bin/sh",
                "-c",
                "python3 /x.py || exit 1\nexec python3 -m sglang.launch_server \"$@\"\n",
                "--",
            ],
            &["--model-path=Q", "--page-size=64"],
        );
        let cmd = EngineCommand::parse(&c, Runtime::SgLang).unwrap();
        assert_eq!(cmd.texts(), vec!["--model-path=Q", "--page-size=64"]);
        let occ = &cmd.find("--page-size")[0];
        assert_eq!(cmd.value_of(occ).unwrap().0, "64");
        let out = cmd
            .apply(&c, &[Edit::Append(vec!["--enable-lmcache".into()])])
            .unwrap();
        assert_eq!(out.command, c.command);
        assert_eq!(
            out.args.unwrap(),
            vec!["--model-path=Q", "--page-size=64", "--enable-lmcache"]
        );
    }

    #[test]
    fn dollar_at_without_dollar0_edits_the_script() {
        // `sh -c SCRIPT` with no further argv: appending to argv would become $0.
        let c = container(&["sh", "-c", "exec vllm serve m \"$@\""], &[]);
        let cmd = EngineCommand::parse(&c, Runtime::Vllm).unwrap();
        let out = cmd.apply(&c, &[Edit::Append(vec!["--z".into()])]).unwrap();
        assert_eq!(out.command.unwrap()[2], "exec vllm serve m \"$@\" --z");
    }

    #[test]
    fn dollar0_is_not_forwarded() {
        let c = container(
            &["sh", "-c", "exec vllm serve \"$@\""],
            &["zero", "m", "--port", "1"],
        );
        let cmd = EngineCommand::parse(&c, Runtime::Vllm).unwrap();
        assert_eq!(cmd.texts(), vec!["m", "--port", "1"]);
    }

    #[test]
    fn replace_a_script_word_and_an_inline_value() {
        let c = container(
            &[
                "sh",
                "-c",
                "vllm serve m --kv-transfer-config '{\"kv_connector\":\"A\"}' --x=1 >/tmp/log 2>&1",
            ],
            &[],
        );
        let cmd = EngineCommand::parse(&c, Runtime::Vllm).unwrap();
        assert_eq!(
            cmd.texts(),
            vec![
                "m",
                "--kv-transfer-config",
                "{\"kv_connector\":\"A\"}",
                "--x=1"
            ]
        );
        let out = cmd
            .apply(
                &c,
                &[
                    Edit::Replace {
                        index: 2,
                        tokens: vec!["{\"kv_connector\":\"B\"}".into()],
                    },
                    Edit::Replace {
                        index: 3,
                        tokens: vec![],
                    },
                    Edit::Append(vec!["--y".into()]),
                ],
            )
            .unwrap();
        assert_eq!(
            out.command.unwrap()[2],
            "vllm serve m --kv-transfer-config '{\"kv_connector\":\"B\"}' --y >/tmp/log 2>&1"
        );
    }

    #[test]
    fn multiple_engines_and_script_files_are_refused() {
        let c = container(&["sh", "-c", "vllm serve a\nvllm serve b"], &[]);
        assert!(matches!(
            EngineCommand::parse(&c, Runtime::Vllm),
            Err(CommandError::MultipleEngines { count: 2, .. })
        ));
        let c = container(&["bash", "/start.sh"], &[]);
        assert!(matches!(
            EngineCommand::parse(&c, Runtime::Vllm),
            Err(CommandError::ScriptFile { .. })
        ));
    }

    #[test]
    fn expansions_are_opaque_and_not_editable() {
        let c = container(
            &["sh", "-c", "vllm serve $MODEL $EXTRA_ARGS --port 8000"],
            &[],
        );
        let cmd = EngineCommand::parse(&c, Runtime::Vllm).unwrap();
        assert!(cmd.is_opaque(0));
        assert_eq!(cmd.warnings.len(), 2);
        assert!(matches!(
            cmd.apply(
                &c,
                &[Edit::Replace {
                    index: 1,
                    tokens: vec!["x".into()]
                }]
            ),
            Err(CommandError::OpaqueArgument { .. })
        ));
        // Appending is still safe.
        let out = cmd.apply(&c, &[Edit::Append(vec!["--z".into()])]).unwrap();
        assert_eq!(
            out.command.unwrap()[2],
            "vllm serve $MODEL $EXTRA_ARGS --port 8000 --z"
        );
    }

    #[test]
    fn env_and_tini_wrappers() {
        let c = container(
            &["/usr/bin/env", "FOO=1", "bash", "-c", "vllm serve m"],
            &[],
        );
        assert_eq!(
            EngineCommand::parse(&c, Runtime::Vllm).unwrap().form,
            CommandForm::Shell
        );
        let c = container(&["tini", "--", "vllm", "serve", "m"], &[]);
        assert_eq!(
            EngineCommand::parse(&c, Runtime::Vllm).unwrap().form,
            CommandForm::Direct
        );
    }

    #[test]
    fn engine_launched_through_exec_dollar_at() {
        let c = container(
            &["/bin/sh", "-c", "set -e\nexec \"$@\"", "--"],
            &["vllm", "serve", "m", "--port", "1"],
        );
        let cmd = EngineCommand::parse(&c, Runtime::Vllm).unwrap();
        assert_eq!(cmd.texts(), vec!["m", "--port", "1"]);
        let out = cmd.apply(&c, &[Edit::Append(vec!["--z".into()])]).unwrap();
        assert_eq!(
            out.args.unwrap(),
            vec!["vllm", "serve", "m", "--port", "1", "--z"]
        );
        // Words after "$@": new arguments go into the script, after them.
        let c = container(
            &["sh", "-c", "exec \"$@\" --port 1", "x"],
            &["vllm", "serve", "m"],
        );
        let cmd = EngineCommand::parse(&c, Runtime::Vllm).unwrap();
        let out = cmd.apply(&c, &[Edit::Append(vec!["--z".into()])]).unwrap();
        assert_eq!(out.command.unwrap()[2], "exec \"$@\" --port 1 --z");
    }

    #[test]
    fn hidden_flags_in_env_expansions() {
        let mut c = container(&["sh", "-c", "vllm serve m $EXTRA ${MORE}"], &[]);
        c.env = Some(vec![
            k8s_openapi::api::core::v1::EnvVar {
                name: "EXTRA".into(),
                value: Some("--max-model-len 1".into()),
                value_from: None,
            },
            k8s_openapi::api::core::v1::EnvVar {
                name: "MORE".into(),
                value: Some("--kv_transfer_config={}".into()),
                value_from: None,
            },
        ]);
        let cmd = EngineCommand::parse(&c, Runtime::Vllm).unwrap();
        assert_eq!(
            cmd.hidden_flag(&c, &["--kv-transfer-config"]),
            Some(("MORE".to_string(), "--kv-transfer-config".to_string()))
        );
        assert_eq!(cmd.hidden_flag(&c, &["--hicache-"]), None);
        assert_eq!(
            cmd.hidden_flag(&c, &["--max-"]).map(|v| v.0),
            Some("EXTRA".to_string())
        );
        assert_eq!(referenced_variables("a$B${C}$1$"), vec!["B", "C"]);
    }

    #[test]
    fn normalizes_underscores() {
        assert_eq!(
            normalize_flag("--kv_transfer_config"),
            "--kv-transfer-config"
        );
        assert_eq!(
            normalize_flag("--kv_transfer_config={}"),
            "--kv-transfer-config"
        );
    }
}
