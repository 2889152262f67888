//! `spec.integration.engineOverrides` (spec 000 "Engine-injection overrides (spec.integration.
//! engineOverrides)").
//!
//! The adapter-owned set is derived by diffing the engine container immediately before and after
//! InjectEngineConfig ([`snapshot`], [`adapter_owned`]): a flag or env var is adapter-owned when
//! the adapter added it or changed its value. [`apply_overrides`] then amends the injected
//! container, exactly as the spec's table says:
//!
//! | field | adapter-owned entry | new entry (not on the pod) | user-template entry the adapter did not touch |
//! |---|---|---|---|
//! | `args` (by leading flag token) | replaced in place | appended (order preserved) | silent no-op |
//! | `suppressArgs` (flag names) | not injected (an added flag is removed; a changed one is restored to the template's value) | silent no-op | silent no-op |
//! | `env` (by name) | override wins | appended | silent no-op |
//! | `suppressEnv` (names) | not injected (removed, or restored to the template's entry) | silent no-op | silent no-op |
//!
//! Entries that name a reserved flag or env var (admission rejects them; the object may predate
//! the rule) are ignored with a warning. An `args` entry is one argument (`--flag=value`,
//! `--flag`), a flag and its value in one string (`--flag value`), or a value continuing the
//! previous entry's flag (`["--flag", "value"]`). Without an `engineOverrides` block nothing
//! changes: the injected pod is byte-identical to the canonical render.

use std::collections::{BTreeMap, BTreeSet};

use ic_shared::crd::{EngineOverrides, Runtime};
use k8s_openapi::api::core::v1::{Container, EnvVar};

use super::InjectError;
use crate::engine::command::{normalize_flag, Edit, EngineCommand, FlagOcc};

/// Flags and env of an engine container at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineSnapshot {
    /// Normalised flag name → each occurrence's tokens as written (flag token, then its values).
    pub flags: BTreeMap<String, Vec<Vec<String>>>,
    /// Env name → every entry with that name, in order.
    pub env: BTreeMap<String, Vec<EnvVar>>,
}

/// The adapter-owned set.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Owned {
    /// Normalised flag names the adapter added or changed.
    pub args: BTreeSet<String>,
    /// Env names the adapter added or changed.
    pub env: BTreeSet<String>,
}

/// Indices of an occurrence: the flag token and, for the separate form, its greedy values.
fn span(cmd: &EngineCommand, occ: &FlagOcc) -> Vec<usize> {
    let mut v = vec![occ.index];
    if occ.inline.is_none() {
        let n = cmd.greedy_values(occ).len();
        v.extend(occ.index + 1..occ.index + 1 + n);
    }
    v
}

/// Snapshots `c`'s engine flags and env. A container whose command cannot be parsed has no
/// flags.
pub fn snapshot(c: &Container, runtime: Runtime) -> EngineSnapshot {
    let mut s = EngineSnapshot::default();
    if let Ok(cmd) = EngineCommand::parse(c, runtime) {
        for occ in cmd.flags() {
            let tokens: Vec<String> = span(&cmd, &occ)
                .into_iter()
                .filter_map(|i| cmd.args.get(i).map(|a| a.text.clone()))
                .collect();
            s.flags.entry(occ.name.clone()).or_default().push(tokens);
        }
    }
    for e in c.env.iter().flatten() {
        s.env.entry(e.name.clone()).or_default().push(e.clone());
    }
    s
}

/// Flags and env that differ between `before` and `after` (added or changed).
pub fn adapter_owned(before: &EngineSnapshot, after: &EngineSnapshot) -> Owned {
    Owned {
        args: after
            .flags
            .iter()
            .filter(|(k, v)| before.flags.get(*k) != Some(*v))
            .map(|(k, _)| k.clone())
            .collect(),
        env: after
            .env
            .iter()
            .filter(|(k, v)| before.env.get(*k) != Some(*v))
            .map(|(k, _)| k.clone())
            .collect(),
    }
}

/// Groups `engineOverrides.args` entries by leading flag token: each group starts with a
/// `-`-prefixed entry (split into tokens when it is `--flag value`), followed by the value
/// entries after it. Entries before the first flag are reported in `warnings` and dropped.
pub fn groups(entries: &[String], warnings: &mut Vec<String>) -> Vec<Vec<String>> {
    let mut out: Vec<Vec<String>> = Vec::new();
    for e in entries {
        if e.starts_with('-') && e != "-" && e != "--" {
            let head = e.split(char::is_whitespace).next().unwrap_or(e);
            let tokens = if e.contains(char::is_whitespace) && !head.contains('=') {
                shell_words::split(e)
                    .unwrap_or_else(|_| e.split_whitespace().map(str::to_string).collect())
            } else {
                vec![e.clone()]
            };
            out.push(tokens);
        } else if let Some(last) = out.last_mut() {
            last.push(e.clone());
        } else {
            warnings.push(format!(
                "engineOverrides.args entry {e:?} has no leading flag; ignored"
            ));
        }
    }
    out
}

/// The value an override group gives its flag: the inline `--flag=value` part, else the first
/// value token.
pub fn group_value(group: &[String]) -> Option<String> {
    let head = group.first()?;
    match head.split_once('=') {
        Some((_, v)) => Some(v.to_string()),
        None => group.get(1).cloned(),
    }
}

/// Edits replacing every occurrence in `occs` by `tokens` (at the first occurrence's place).
fn replace_occurrences(cmd: &EngineCommand, occs: &[FlagOcc], tokens: Vec<String>) -> Vec<Edit> {
    let mut edits = Vec::new();
    let mut tokens = Some(tokens);
    for occ in occs {
        for (k, i) in span(cmd, occ).into_iter().enumerate() {
            let t = if k == 0 {
                tokens.take().unwrap_or_default()
            } else {
                Vec::new()
            };
            edits.push(Edit::Replace {
                index: i,
                tokens: t,
            });
        }
    }
    if let Some(t) = tokens.filter(|t| !t.is_empty()) {
        edits.push(Edit::Append(t));
    }
    edits
}

fn is_reserved_flag(name: &str, reserved: &[&str]) -> bool {
    reserved.iter().any(|r| normalize_flag(r) == name)
}

/// Applies `ov` to the injected engine container `c`. `before` is the engine container's
/// snapshot taken before InjectEngineConfig. Returns warnings (ignored reserved entries).
///
/// Errors: a command edit that cannot be made safely ([`InjectError::Command`]); the webhook
/// then admits the pod unwired.
pub fn apply_overrides(
    c: &mut Container,
    runtime: Runtime,
    before: &EngineSnapshot,
    ov: &EngineOverrides,
    reserved_args: &[&str],
    reserved_env: &[&str],
) -> Result<Vec<String>, InjectError> {
    let mut warnings = Vec::new();
    let after = snapshot(c, runtime);
    let owned = adapter_owned(before, &after);

    for group in groups(&ov.args, &mut warnings) {
        let Some(head) = group.first() else { continue };
        let name = normalize_flag(head);
        if is_reserved_flag(&name, reserved_args) {
            warnings.push(format!(
                "engineOverrides.args entry {head:?} names reserved flag {name}; ignored"
            ));
            continue;
        }
        let cmd = EngineCommand::parse(c, runtime)?;
        let occs = cmd.find(&name);
        let edits = if owned.args.contains(&name) {
            replace_occurrences(&cmd, &occs, group)
        } else if occs.is_empty() {
            vec![Edit::Append(group)]
        } else {
            continue; // the pod template's own flag: silent no-op
        };
        *c = cmd.apply(c, &edits)?;
    }

    for s in &ov.suppress_args {
        let name = normalize_flag(s);
        if is_reserved_flag(&name, reserved_args) {
            warnings.push(format!(
                "engineOverrides.suppressArgs entry {s:?} names reserved flag {name}; ignored"
            ));
            continue;
        }
        if !owned.args.contains(&name) {
            continue;
        }
        let cmd = EngineCommand::parse(c, runtime)?;
        let occs = cmd.find(&name);
        let restore: Vec<String> = before
            .flags
            .get(&name)
            .map(|o| o.iter().flatten().cloned().collect())
            .unwrap_or_default();
        let edits = replace_occurrences(&cmd, &occs, restore);
        *c = cmd.apply(c, &edits)?;
    }

    for e in &ov.env {
        if reserved_env.contains(&e.name.as_str()) {
            warnings.push(format!(
                "engineOverrides.env entry {} names reserved env var; ignored",
                e.name
            ));
            continue;
        }
        let env = c.env.get_or_insert_with(Vec::new);
        if owned.env.contains(&e.name) {
            replace_env(env, &e.name, vec![e.clone()]);
        } else if !env.iter().any(|x| x.name == e.name) {
            env.push(e.clone());
        }
    }

    for name in &ov.suppress_env {
        if reserved_env.contains(&name.as_str()) {
            warnings.push(format!(
                "engineOverrides.suppressEnv entry {name} names reserved env var; ignored"
            ));
            continue;
        }
        if !owned.env.contains(name) {
            continue;
        }
        let restore = before.env.get(name).cloned().unwrap_or_default();
        let env = c.env.get_or_insert_with(Vec::new);
        replace_env(env, name, restore);
        if env.is_empty() && before.env.is_empty() {
            c.env = None;
        }
    }
    Ok(warnings)
}

/// Replaces every entry named `name` by `with`, at the first entry's position (appended when
/// there was none).
fn replace_env(env: &mut Vec<EnvVar>, name: &str, with: Vec<EnvVar>) {
    let at = env.iter().position(|x| x.name == name);
    env.retain(|x| x.name != name);
    match at {
        Some(i) => {
            let i = i.min(env.len());
            env.splice(i..i, with);
        }
        None => env.extend(with),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapters::env_var;

    fn c(args: &[&str], env: &[(&str, &str)]) -> Container {
        Container {
            name: "sglang".into(),
            command: Some(vec![
                "python3".into(),
                "-m".into(),
                "sglang.launch_server".into(),
            ]),
            args: Some(args.iter().map(|s| s.to_string()).collect()),
            env: (!env.is_empty()).then(|| env.iter().map(|(n, v)| env_var(n, v)).collect()),
            ..Default::default()
        }
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    /// The template `--user 1`, `U=1`; the adapter adds `--a 1`, `A=1` and changes `--m 1` → `--m 2`,
    /// `M=1` → `M=2`.
    fn fixture() -> (EngineSnapshot, Container) {
        let before = c(&["--user", "1", "--m", "1"], &[("U", "1"), ("M", "1")]);
        let after = c(
            &["--user", "1", "--m", "2", "--a", "1"],
            &[("U", "1"), ("M", "2"), ("A", "1")],
        );
        (snapshot(&before, Runtime::SgLang), after)
    }

    fn run(ov: EngineOverrides) -> (Container, Vec<String>) {
        let (before, mut after) = fixture();
        let w = apply_overrides(
            &mut after,
            Runtime::SgLang,
            &before,
            &ov,
            &["--reserved"],
            &["R"],
        )
        .unwrap();
        (after, w)
    }

    fn env(c: &Container) -> Vec<(String, String)> {
        c.env
            .iter()
            .flatten()
            .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
            .collect()
    }

    #[test]
    fn owned_set_is_the_diff() {
        let (before, after) = fixture();
        let owned = adapter_owned(&before, &snapshot(&after, Runtime::SgLang));
        assert_eq!(
            owned.args,
            BTreeSet::from(["--a".to_string(), "--m".to_string()])
        );
        assert_eq!(
            owned.env,
            BTreeSet::from(["A".to_string(), "M".to_string()])
        );
    }

    #[test]
    fn args_replace_an_adapter_owned_flag_in_place() {
        let (c, _) = run(EngineOverrides {
            args: strings(&["--a=9"]),
            ..Default::default()
        });
        assert_eq!(
            c.args.unwrap(),
            strings(&["--user", "1", "--m", "2", "--a=9"])
        );
        let (c, _) = run(EngineOverrides {
            args: strings(&["--m", "7"]),
            ..Default::default()
        });
        assert_eq!(
            c.args.unwrap(),
            strings(&["--user", "1", "--m", "7", "--a", "1"])
        );
        let (c, _) = run(EngineOverrides {
            args: strings(&["--m 8"]),
            ..Default::default()
        });
        assert_eq!(
            c.args.unwrap(),
            strings(&["--user", "1", "--m", "8", "--a", "1"])
        );
    }

    #[test]
    fn args_append_a_new_flag_in_order() {
        let (c, _) = run(EngineOverrides {
            args: strings(&["--new", "x", "--b"]),
            ..Default::default()
        });
        assert_eq!(
            c.args.unwrap(),
            strings(&["--user", "1", "--m", "2", "--a", "1", "--new", "x", "--b"])
        );
    }

    #[test]
    fn args_on_a_user_flag_are_a_silent_no_op() {
        let (c, w) = run(EngineOverrides {
            args: strings(&["--user=5"]),
            ..Default::default()
        });
        assert_eq!(
            c.args.unwrap(),
            strings(&["--user", "1", "--m", "2", "--a", "1"])
        );
        assert!(w.is_empty());
    }

    #[test]
    fn suppress_args_removes_added_and_restores_changed() {
        let (c, _) = run(EngineOverrides {
            suppress_args: strings(&["--a", "--m", "--user"]),
            ..Default::default()
        });
        assert_eq!(c.args.unwrap(), strings(&["--user", "1", "--m", "1"]));
    }

    #[test]
    fn env_override_wins_appends_or_is_a_no_op() {
        let (c, _) = run(EngineOverrides {
            env: vec![
                env_var("A", "9"),
                env_var("NEW", "n"),
                env_var("U", "changed"),
            ],
            ..Default::default()
        });
        assert_eq!(
            env(&c),
            vec![
                ("U".into(), "1".into()),
                ("M".into(), "2".into()),
                ("A".into(), "9".into()),
                ("NEW".into(), "n".into()),
            ]
        );
    }

    #[test]
    fn suppress_env_removes_added_and_restores_changed() {
        let (c, _) = run(EngineOverrides {
            suppress_env: strings(&["A", "M", "U", "NOPE"]),
            ..Default::default()
        });
        assert_eq!(
            env(&c),
            vec![("U".into(), "1".into()), ("M".into(), "1".into())]
        );
    }

    #[test]
    fn reserved_entries_are_ignored_with_a_warning() {
        let (c, w) = run(EngineOverrides {
            args: strings(&["--reserved=1"]),
            suppress_args: strings(&["--reserved"]),
            env: vec![env_var("R", "1")],
            suppress_env: strings(&["R"]),
        });
        assert_eq!(
            c.args.unwrap(),
            strings(&["--user", "1", "--m", "2", "--a", "1"])
        );
        assert_eq!(w.len(), 4);
    }

    #[test]
    fn empty_overrides_change_nothing() {
        let (before, after) = fixture();
        let mut c = after.clone();
        apply_overrides(
            &mut c,
            Runtime::SgLang,
            &before,
            &EngineOverrides::default(),
            &[],
            &[],
        )
        .unwrap();
        assert_eq!(c, after);
    }

    #[test]
    fn value_without_flag_is_ignored() {
        let (_, w) = run(EngineOverrides {
            args: strings(&["orphan"]),
            ..Default::default()
        });
        assert_eq!(w.len(), 1);
    }
}
