//! Writing [`Edit`]s back to where each engine argument came from (a `command`/`args` element
//! or a word span of the script, shell-quoted) and verifying by re-parsing that the engine sees
//! exactly the intended argument list.

use k8s_openapi::api::core::v1::Container;

use super::{AppendTarget, CommandError, Edit, EngineCommand, Loc, Slot};

impl EngineCommand {
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
