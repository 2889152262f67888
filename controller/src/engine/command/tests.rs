//! Tests of the engine command as a whole: each command shape parsed, edited and re-parsed.

use k8s_openapi::api::core::v1::Container;

use ic_shared::crd::Runtime;

use super::args::referenced_variables;
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
