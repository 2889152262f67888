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
//!
//! The module is split by concept: `parse.rs` finds the engine invocation (direct, image
//! entrypoint, `sh -c` script, `"$@"` forwarding) and builds an [`EngineCommand`]; `shell.rs` is
//! the small POSIX shell tokeniser the script form is read with; `args.rs` reads the engine's
//! arguments (flags, values, flags hidden in expansions); `edit.rs` writes [`Edit`]s back and
//! verifies the result; `tests.rs` drives each shape through parse, edit and re-parse. The
//! types they share live here.

use ic_shared::crd::Runtime;

mod args;
mod edit;
mod parse;
mod shell;
#[cfg(test)]
mod tests;

pub use args::normalize_flag;

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
