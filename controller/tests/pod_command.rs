//! Engines found and wired in pods as people write them (issue 4 "Real pods"): flags inside
//! `sh -c` / `bash -c` scripts (with `"$@"` forwarding and trailing backslashes), command-only
//! pods, `--flag=value` and underscore spellings, an existing connector, `/dev/shm` under any
//! volume name, native sidecars already present, the engine not being the first container,
//! restricted security contexts — and a fail-open with the reason whenever the command cannot
//! be changed safely.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod pod_support;

use ic_controller::admission::pod::{PodWebhookConfig, REASON_INJECTED};
use ic_shared::crd::CacheBackend;
use pod_support::*;
use serde_json::{json, Value};

const KV: &str = r#"{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}"#;

fn pod(containers: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "ns", "labels": {"app": "llm"}},
        "spec": {"containers": containers}
    })
}

fn engine(command: Value, args: Value) -> Value {
    let mut c = json!({"name": "engine", "image": "vllm/vllm-openai:v0.9.0"});
    if !command.is_null() {
        c["command"] = command;
    }
    if !args.is_null() {
        c["args"] = args;
    }
    c
}

fn backend(runtime: &str, extra: Value) -> CacheBackend {
    let mut spec = json!({"runtime": runtime, "engineSelector": {"matchLabels": {"app": "llm"}}});
    if let (Some(s), Some(e)) = (spec.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            s.insert(k.clone(), v.clone());
        }
    }
    serde_json::from_value(json!({
        "apiVersion": "inferencecache.io/v1alpha1",
        "kind": "CacheBackend",
        "metadata": {"name": "cb", "namespace": "ns", "uid": "u"},
        "spec": spec
    }))
    .unwrap()
}

fn vllm() -> Vec<CacheBackend> {
    vec![backend("VLLM", json!({}))]
}

fn sglang_mp() -> Vec<CacheBackend> {
    vec![backend("SGLang", json!({}))]
}

fn wire(
    p: &Value,
    backends: &[CacheBackend],
) -> (ic_controller::admission::pod::PodOutcome, Value) {
    let (o, w) = admit_converged(p, backends, &PodWebhookConfig::default());
    assert_eq!(o.reason, REASON_INJECTED, "{}", o.reason);
    (o, w)
}

fn fail_open(p: &Value, backends: &[CacheBackend]) -> String {
    let o = admit(p, backends, &PodWebhookConfig::default());
    assert_fail_open_marked(p, &o);
    o.reason
}

#[test]
fn sh_c_script_gets_the_flag_shell_quoted() {
    let p = pod(json!([engine(
        json!(["/bin/sh", "-c"]),
        json!(["vllm serve m --max_num_batched_tokens 1024"])
    )]));
    let (_, w) = wire(&p, &vllm());
    assert_eq!(
        strings(&container(&w, "engine")["args"]),
        vec![format!(
            "vllm serve m --max_num_batched_tokens 1024 --kv-transfer-config '{KV}'"
        )]
    );
}

#[test]
fn bash_c_multiline_script_with_trailing_backslashes() {
    let script = "set -euo pipefail\npip install --quiet lmcache==0.3.9\nexec vllm serve \"$MODEL\" \\\n  --port 8000 \\\n  --gpu-memory-utilization 0.9 \\\n";
    let p = pod(json!([engine(json!(["bash", "-c", script]), Value::Null)]));
    let (o, w) = wire(&p, &vllm());
    assert_eq!(
        strings(&container(&w, "engine")["command"])[2],
        format!("set -euo pipefail\npip install --quiet lmcache==0.3.9\nexec vllm serve \"$MODEL\" \\\n  --port 8000 \\\n  --gpu-memory-utilization 0.9 --kv-transfer-config '{KV}' \\\n")
    );
    assert!(
        o.warnings.iter().any(|w| w.contains("$MODEL")),
        "{:?}",
        o.warnings
    );
}

#[test]
fn dollar_at_forwarding_appends_to_args() {
    let p = pod(json!([engine(
        json!([
            "/bin/sh",
            "-c",
            "python3 /scripts/render.py || exit 1\nexec vllm serve \"$@\"\n",
            "--"
        ]),
        json!(["m", "--port=8000"])
    )]));
    let (_, w) = wire(&p, &vllm());
    let c = container(&w, "engine");
    assert_eq!(
        strings(&c["command"]),
        strings(&p["spec"]["containers"][0]["command"])
    );
    assert_eq!(
        strings(&c["args"]),
        vec!["m", "--port=8000", "--kv-transfer-config", KV]
    );
}

#[test]
fn command_only_pod_gets_an_args_list() {
    let p = pod(json!([engine(
        json!(["/opt/venv/bin/vllm", "serve", "m", "--port", "8000"]),
        Value::Null
    )]));
    let (_, w) = wire(&p, &vllm());
    let c = container(&w, "engine");
    assert_eq!(
        strings(&c["command"]),
        vec!["/opt/venv/bin/vllm", "serve", "m", "--port", "8000"]
    );
    assert_eq!(strings(&c["args"]), vec!["--kv-transfer-config", KV]);
}

#[test]
fn image_entrypoint_args_only() {
    let p = pod(json!([engine(Value::Null, json!(["--model", "m"]))]));
    let (_, w) = wire(&p, &vllm());
    assert_eq!(
        strings(&container(&w, "engine")["args"]),
        vec!["--model", "m", "--kv-transfer-config", KV]
    );
}

#[test]
fn no_command_and_no_args_fails_open() {
    let p = pod(json!([engine(Value::Null, Value::Null)]));
    assert_eq!(
        fail_open(&p, &vllm()),
        "CacheBackend ns/cb: no engine container found for VLLM: container \"engine\" sets neither command nor args (the image's own entrypoint and CMD run); adding args would replace the CMD; pod admitted unwired"
    );
}

#[test]
fn existing_connector_in_every_spelling_is_never_duplicated() {
    for args in [
        json!(["--kv-transfer-config", KV]),
        json!([format!("--kv-transfer-config={KV}")]),
        json!(["--kv_transfer_config", KV]),
        json!([format!("--kv_transfer_config={KV}")]),
    ] {
        let p = pod(json!([engine(json!(["vllm", "serve", "m"]), args.clone())]));
        let (_, w) = wire(&p, &vllm());
        assert_eq!(
            container(&w, "engine")["args"],
            args,
            "adopted byte for byte"
        );
    }
    // Inside a script too.
    let p = pod(json!([engine(
        json!([
            "sh",
            "-c",
            format!("vllm serve m --kv_transfer_config '{KV}'")
        ]),
        Value::Null
    )]));
    let (_, w) = wire(&p, &vllm());
    assert_eq!(
        container(&w, "engine")["command"],
        p["spec"]["containers"][0]["command"]
    );
}

#[test]
fn a_different_connector_fails_open() {
    let other = r#"{"kv_connector":"LMCacheMPConnector","kv_role":"kv_both"}"#;
    let p = pod(json!([engine(
        json!([
            "sh",
            "-c",
            format!("exec vllm serve m --kv-transfer-config '{other}'")
        ]),
        Value::Null
    )]));
    assert_eq!(
        fail_open(&p, &vllm()),
        "CacheBackend ns/cb: container \"engine\" already sets --kv-transfer-config with kv_connector \"LMCacheMPConnector\"; refusing to replace the operator's connector with LMCacheConnectorV1; pod admitted unwired"
    );
}

#[test]
fn connector_from_a_shell_variable_fails_open() {
    let p = pod(json!([engine(
        json!([
            "sh",
            "-c",
            "vllm serve m --kv-transfer-config \"$KV_CONFIG\""
        ]),
        Value::Null
    )]));
    assert_eq!(
        fail_open(&p, &vllm()),
        "CacheBackend ns/cb: container \"engine\": the value of --kv-transfer-config is a shell expansion ($KV_CONFIG) that cannot be checked; pod admitted unwired"
    );
}

#[test]
fn unsafe_scripts_fail_open_with_the_reason() {
    let cases = [
        (json!(["sh", "-c", "vllm serve a &\nvllm serve b"]), "the shell script of container \"engine\" launches VLLM 2 times; cannot tell which invocation to wire"),
        (json!(["bash", "/start.sh"]), "container \"engine\" runs a shell script file (\"/start.sh\"), whose content cannot be edited"),
        (json!(["sh", "-c", "vllm serve 'm --port 1"]), "cannot parse the shell script of container \"engine\": unterminated single quote at byte 11"),
    ];
    for (command, why) in cases {
        let p = pod(json!([engine(command, Value::Null)]));
        assert_eq!(
            fail_open(&p, &vllm()),
            format!("CacheBackend ns/cb: no engine container found for VLLM: {why}; pod admitted unwired")
        );
    }
}

#[test]
fn engine_not_the_first_container() {
    let p = pod(json!([
        {"name": "proxy", "image": "envoy", "command": ["envoy", "-c", "/etc/envoy.yaml"]},
        engine(json!(["python3", "-m", "vllm.entrypoints.openai.api_server"]), json!(["--model", "m"]))
    ]));
    let (_, w) = wire(&p, &vllm());
    assert_eq!(container(&w, "proxy"), container(&p, "proxy"));
    assert_eq!(
        strings(&container(&w, "engine")["args"]),
        vec!["--model", "m", "--kv-transfer-config", KV]
    );
}

#[test]
fn two_engine_containers_need_the_runtime_name() {
    let a = engine(json!(["vllm", "serve", "a"]), Value::Null);
    let mut b = engine(json!(["vllm", "serve", "b"]), Value::Null);
    b["name"] = json!("other");
    assert_eq!(
        fail_open(&pod(json!([a.clone(), b.clone()])), &vllm()),
        "CacheBackend ns/cb: several containers launch VLLM (engine, other); name the engine container \"vllm\"; pod admitted unwired"
    );
    b["name"] = json!("vllm");
    let (_, w) = wire(&pod(json!([a, b])), &vllm());
    assert!(strings(&container(&w, "vllm")["args"]).contains(&"--kv-transfer-config".to_string()));
}

fn sglang_engine(mounts: Value) -> Value {
    json!({
        "name": "sglang",
        "image": "lmsysorg/sglang:v0.5.16",
        "command": ["python3", "-m", "sglang.launch_server"],
        "args": ["--model-path", "Q"],
        "volumeMounts": mounts
    })
}

#[test]
fn dev_shm_under_any_volume_name_is_reused() {
    let mut p = pod(json!([sglang_engine(
        json!([{"name": "my-shm", "mountPath": "/dev/shm"}])
    )]));
    p["spec"]["volumes"] =
        json!([{"name": "my-shm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}}]);
    let (o, w) = wire(&p, &sglang_mp());
    assert!(o.warnings.is_empty(), "{:?}", o.warnings);
    let vols: Vec<&str> = w["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(vols, vec!["my-shm", "lmcache-config"]);
    let worker = init_container(&w, "lmcache-mp-worker").unwrap();
    assert!(worker["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["name"] == "my-shm" && m["mountPath"] == "/dev/shm"));
    // The engine keeps its one /dev/shm mount (a duplicate mountPath is an invalid pod).
    let shm_mounts = container(&w, "sglang")["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["mountPath"] == "/dev/shm")
        .count();
    assert_eq!(shm_mounts, 1);
}

#[test]
fn read_only_or_projected_dev_shm_fails_open() {
    let p = pod(json!([sglang_engine(
        json!([{"name": "s", "mountPath": "/dev/shm", "readOnly": true}])
    )]));
    assert_eq!(
        fail_open(&p, &sglang_mp()),
        "CacheBackend ns/cb: container \"sglang\" mounts /dev/shm (volume \"s\") read-only; the LMCache MP data path writes there; pod admitted unwired"
    );
    let mut p = pod(json!([sglang_engine(
        json!([{"name": "s", "mountPath": "/dev/shm/"}])
    )]));
    p["spec"]["volumes"] = json!([{"name": "s", "secret": {"secretName": "x"}}]);
    assert_eq!(
        fail_open(&p, &sglang_mp()),
        "CacheBackend ns/cb: container \"sglang\" mounts /dev/shm from a secret volume (\"s\"); the LMCache MP data path needs a writable tmpfs; pod admitted unwired"
    );
}

#[test]
fn reserved_mp_names_fail_open_but_own_worker_converges() {
    let mut p = pod(json!([sglang_engine(json!([]))]));
    p["spec"]["volumes"] = json!([{"name": "lmcache-config", "configMap": {"name": "mine"}}]);
    assert_eq!(
        fail_open(&p, &sglang_mp()),
        "CacheBackend ns/cb: the pod already has a volume named \"lmcache-config\" that inference-cache did not render; rename it to get the pod wired; pod admitted unwired"
    );
    // A pod copied from a wired pod (same worker, older render) converges on the current one.
    let (_, wired) = wire(&pod(json!([sglang_engine(json!([]))])), &sglang_mp());
    let changed = vec![backend(
        "SGLang",
        json!({"lmCache": {"chunkSizeTokens": 128}}),
    )];
    let (o, rewired) = admit_converged(&wired, &changed, &PodWebhookConfig::default());
    assert_eq!(o.reason, REASON_INJECTED);
    let args = strings(&init_container(&rewired, "lmcache-mp-worker").unwrap()["args"]);
    assert!(args.windows(2).any(|p| p == ["--chunk-size", "128"]));
    assert_eq!(
        rewired["spec"]["initContainers"].as_array().unwrap().len(),
        1
    );
}

#[test]
fn native_sidecars_already_present_stay_in_place() {
    let mut p = pod(json!([sglang_engine(json!([]))]));
    p["spec"]["initContainers"] = json!([
        {"name": "istio-proxy", "image": "istio/proxyv2", "restartPolicy": "Always"},
        {"name": "download", "image": "busybox", "command": ["true"]}
    ]);
    let (_, w) = wire(&p, &sglang_mp());
    let names: Vec<&str> = w["spec"]["initContainers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["istio-proxy", "download", "lmcache-mp-worker"]);
}

/// The restricted Pod Security profile's container rules, as far as a pod spec shows them.
fn restricted_ok(pod: &Value) -> Result<(), String> {
    let spec = &pod["spec"];
    let pod_sc = &spec["securityContext"];
    for c in spec["containers"]
        .as_array()
        .into_iter()
        .flatten()
        .chain(spec["initContainers"].as_array().into_iter().flatten())
    {
        let sc = &c["securityContext"];
        let name = c["name"].as_str().unwrap_or("");
        if sc["allowPrivilegeEscalation"] != json!(false) {
            return Err(format!("{name}: allowPrivilegeEscalation"));
        }
        if !sc["capabilities"]["drop"]
            .as_array()
            .is_some_and(|d| d.contains(&json!("ALL")))
        {
            return Err(format!("{name}: capabilities.drop ALL"));
        }
        if sc["runAsNonRoot"] != json!(true) && pod_sc["runAsNonRoot"] != json!(true) {
            return Err(format!("{name}: runAsNonRoot"));
        }
        if sc["seccompProfile"].is_null() && pod_sc["seccompProfile"].is_null() {
            return Err(format!("{name}: seccompProfile"));
        }
    }
    Ok(())
}

#[test]
fn restricted_security_contexts_stay_restricted() {
    let sc = json!({"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}, "runAsUser": 1000});
    let mut v = engine(json!(["vllm", "serve", "m"]), Value::Null);
    v["securityContext"] = sc.clone();
    v["resources"] = json!({"limits": {"nvidia.com/gpu": 1}});
    let mut p = pod(json!([v]));
    p["spec"]["securityContext"] =
        json!({"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}});
    restricted_ok(&p).unwrap();
    let cfg = PodWebhookConfig {
        kvevent_subscriber_image: Some("ic-agent:1".into()),
        ..Default::default()
    };
    let b = vec![backend("VLLM", json!({"observation": {"modelID": "m"}}))];
    let (_, w) = admit_converged(&p, &b, &cfg);
    assert!(init_container(&w, "lmcache-kernel-check").is_some());
    assert!(w["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .any(|c| c["name"] == "kvevent-subscriber"));
    restricted_ok(&w).unwrap();
    assert_eq!(
        init_container(&w, "lmcache-kernel-check").unwrap()["securityContext"],
        sc
    );

    let mut s = sglang_engine(json!([]));
    s["securityContext"] = sc.clone();
    let mut p = pod(json!([s]));
    p["spec"]["securityContext"] =
        json!({"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}});
    let (_, w) = wire(&p, &sglang_mp());
    restricted_ok(&w).unwrap();
    assert_eq!(
        init_container(&w, "lmcache-mp-worker").unwrap()["securityContext"],
        sc
    );
}

#[test]
fn hicache_flags_go_into_the_script() {
    let p = pod(json!([{
        "name": "server",
        "image": "lmsysorg/sglang:v0.5.16",
        "command": ["/bin/bash", "-c"],
        "args": ["python3 -m sglang.launch_server --model-path Q --page-size 64 2>&1 | tee /tmp/log"]
    }]));
    let b = vec![backend(
        "SGLang",
        json!({"type": "SGLangHiCache", "hiCache": {"ratio": "2.0", "writePolicy": "write_through_selective"}}),
    )];
    let (_, w) = wire(&p, &b);
    assert_eq!(
        strings(&container(&w, "server")["args"]),
        vec!["python3 -m sglang.launch_server --model-path Q --page-size 64 --enable-hierarchical-cache --hicache-ratio 2.0 --hicache-write-policy write_through_selective 2>&1 | tee /tmp/log"]
    );
}

#[test]
fn sglang_mp_in_a_forwarding_script() {
    let p = pod(json!([{
        "name": "sglang",
        "image": "lmsysorg/sglang:v0.5.16",
        "command": ["/bin/sh", "-c", "exec python3 -m sglang.launch_server \"$@\"", "--"],
        "args": ["--model-path=Q", "--enable-lmcache"]
    }]));
    let (_, w) = wire(&p, &sglang_mp());
    assert_eq!(
        strings(&container(&w, "sglang")["args"]),
        vec![
            "--model-path=Q",
            "--enable-lmcache",
            "--lmcache-config-file",
            "/etc/lmcache/lmcache.yaml"
        ]
    );
}

#[test]
fn engine_launched_by_an_exec_dollar_at_wrapper() {
    let p = pod(json!([engine(
        json!(["/bin/sh", "-c", "ulimit -n 65536\nexec \"$@\"", "--"]),
        json!(["vllm", "serve", "m", "--port", "8000"])
    )]));
    let (_, w) = wire(&p, &vllm());
    assert_eq!(
        strings(&container(&w, "engine")["args"]),
        vec![
            "vllm",
            "serve",
            "m",
            "--port",
            "8000",
            "--kv-transfer-config",
            KV
        ]
    );
}

#[test]
fn a_connector_hidden_in_an_env_expansion_fails_open() {
    let mut c = engine(
        json!(["sh", "-c", "vllm serve m $VLLM_EXTRA_ARGS"]),
        Value::Null,
    );
    c["env"] = json!([{"name": "VLLM_EXTRA_ARGS", "value": format!("--kv-transfer-config={KV}")}]);
    assert_eq!(
        fail_open(&pod(json!([c])), &vllm()),
        "CacheBackend ns/cb: container \"engine\": the engine command expands $VLLM_EXTRA_ARGS, which sets --kv-transfer-config; refusing to add a second one; pod admitted unwired"
    );
    // An expansion that carries other flags is wired, with a warning.
    let mut c = engine(
        json!(["sh", "-c", "vllm serve m $VLLM_EXTRA_ARGS"]),
        Value::Null,
    );
    c["env"] = json!([{"name": "VLLM_EXTRA_ARGS", "value": "--max-model-len 4096"}]);
    let (o, _) = wire(&pod(json!([c])), &vllm());
    assert!(o.warnings.iter().any(|w| w.contains("$VLLM_EXTRA_ARGS")));
}
