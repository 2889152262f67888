//! Finding the engine invocation in a container (spec 000 "Mutating Pod webhook"): the
//! command/args shapes of the module table ([`super`]), wrappers such as `env`/`tini`, the shell
//! `-c` form with `"$@"` forwarding, and the interpreter that runs the engine.

use k8s_openapi::api::core::v1::Container;

use ic_shared::crd::Runtime;

use super::shell::{lex, Segment};
use super::{AppendTarget, CommandError, CommandForm, EngineArg, EngineCommand, Loc, Slot};

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
}
