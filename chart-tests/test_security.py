"""The chart's hardening values (docs/security.md): the Pod webhook's scope, the controller's
hostNetwork option, the connection limits passed to both binaries, and the opt-in
NetworkPolicies."""

from __future__ import annotations

from conftest import NAMESPACE, render
from test_chart import _webhooks, agent_daemonset, args_of, controller_deployment, the_container

POD_HOOK = "mpod.inferencecache.io"


def _ns_exprs(r) -> list[dict]:
    return _webhooks(r)[POD_HOOK]["namespaceSelector"]["matchExpressions"]


def test_release_namespace_and_kube_system_are_always_excluded() -> None:
    r = render({"webhook": {"pod": {"excludeNamespaces": []}}})
    excluded = _ns_exprs(r)[0]
    assert excluded["key"] == "kubernetes.io/metadata.name" and excluded["operator"] == "NotIn"
    assert {NAMESPACE, "kube-system"} <= set(excluded["values"])


def test_namespaces_opt_out_by_label_by_default() -> None:
    r = render({})
    assert {"key": "inferencecache.io/webhook", "operator": "NotIn", "values": ["disabled"]} in _ns_exprs(r)


def test_namespace_opt_in_mode_needs_the_label() -> None:
    r = render({"webhook": {"pod": {"namespaceMode": "optIn", "namespaceLabel": "example.com/inject"}}})
    exprs = _ns_exprs(r)
    assert {"key": "example.com/inject", "operator": "In", "values": ["enabled"]} in exprs
    assert not [e for e in exprs if e["operator"] == "NotIn" and e["key"] == "example.com/inject"]
    # The exclusions still apply in opt-in mode.
    assert {NAMESPACE, "kube-system"} <= set(exprs[0]["values"])


def test_controller_host_network_option() -> None:
    spec = controller_deployment(render({}))["spec"]["template"]["spec"]
    assert "hostNetwork" not in spec
    spec = controller_deployment(render({"controller": {"hostNetwork": True}}))["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"


def test_connection_limits_reach_both_binaries() -> None:
    r = render(
        {
            "controller": {"connectionLimits": {"maxConnections": 77, "headerReadTimeoutSeconds": 9}},
            "agent": {"connectionLimits": {"maxConnections": 33, "requestTimeoutSeconds": 8}},
        }
    )
    c = args_of(the_container(controller_deployment(r)))
    assert (c["--max-connections"], c["--header-read-timeout-seconds"]) == ("77", "9")
    assert c["--request-timeout-seconds"] == "60"
    assert (c["--grpc-keepalive-seconds"], c["--grpc-keepalive-timeout-seconds"]) == ("30", "20")
    # The stream, idle, handshake and health-listener bounds (docs/security.md "Streams,
    # handshakes and idle connections"), and the probes on their own listener.
    assert (c["--max-concurrent-streams"], c["--idle-timeout-seconds"]) == ("128", "60")
    assert (c["--agent-hello-timeout-seconds"], c["--agent-pre-auth-bytes"]) == ("10", "65536")
    assert (c["--agent-max-pending-hellos"], c["--health-max-connections"]) == ("1024", "32")
    assert c["--health-addr"] == "0.0.0.0:8081"
    the = the_container(controller_deployment(r))
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert the[probe]["httpGet"]["port"] == "health"
    a = args_of(the_container(agent_daemonset(r)))
    assert (a["--max-connections"], a["--request-timeout-seconds"]) == ("33", "8")
    assert a["--header-read-timeout-seconds"] == "30"


def test_network_policies_are_opt_in() -> None:
    assert render({}).of_kind("NetworkPolicy") == []
    r = render({"networkPolicy": {"enabled": True}})
    [np] = r.of_kind("NetworkPolicy")
    assert np["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "controller"
    ports = {i["ports"][0]["port"]: i for i in np["spec"]["ingress"]}
    # gRPC from the agents only; HTTP from nobody until peers are named; the webhook from any.
    grpc = ports[50051]["from"]
    assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in grpc] == ["agent"]
    assert 8080 not in ports
    assert "from" not in ports[9443]


def test_network_policy_peers_from_values() -> None:
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    r = render(
        {
            "networkPolicy": {
                "enabled": True,
                "nodeCIDRs": ["10.0.0.0/16"],
                "httpFrom": peers,
                "grpcFrom": peers,
                "webhookFrom": [{"ipBlock": {"cidr": "172.16.0.0/28"}}],
                "agentFrom": peers,
            },
            "agent": {"hostNetwork": False},
        }
    )
    nps = {n["metadata"]["name"]: n for n in r.of_kind("NetworkPolicy")}
    ctl = {i["ports"][0]["port"]: i["from"] for i in nps["inference-cache-controller"]["spec"]["ingress"]}
    assert {"ipBlock": {"cidr": "10.0.0.0/16"}} in ctl[50051] and peers[0] in ctl[50051]
    assert ctl[8080] == [{"ipBlock": {"cidr": "10.0.0.0/16"}}] + peers
    assert ctl[9443] == [{"ipBlock": {"cidr": "172.16.0.0/28"}}]
    agent = nps["inference-cache-agent"]["spec"]
    assert {p["port"] for p in agent["ingress"][0]["ports"]} == {9090, 9091}
    assert agent["ingress"][0]["from"] == [{"ipBlock": {"cidr": "10.0.0.0/16"}}] + peers


def test_agent_mounts_no_kubelet_pod_directory_unless_asked() -> None:
    """Issue 38 item 7: the kubelet's pods directory holds every pod's Secrets and projected
    service-account tokens, and no check reads it (docs/security.md "The agent mounts only what
    its checks read"). By default the agent mounts the host's /proc, /sys and /dev/shm read-only,
    its state dir, and nothing under /var/lib/kubelet; `agent.hostPaths.kubeletPodsDir` mounts it
    read-only for `ic-agent qualify` only when an operator sets it."""
    ds = agent_daemonset(render({}))
    spec = ds["spec"]["template"]["spec"]
    host_paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert not [p for p in host_paths.values() if "kubelet" in p], host_paths
    assert sorted(host_paths) == ["host-dev-shm", "host-proc", "host-sys", "kv-state"]
    mounted = {m["mountPath"] for m in the_container(ds)["volumeMounts"]}
    assert not [p for p in mounted if "kubelet" in p], mounted

    ds = agent_daemonset(render({"agent": {"hostPaths": {"kubeletPodsDir": "/var/lib/kubelet/pods"}}}))
    vols = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert vols["kubelet-pods"]["hostPath"]["path"] == "/var/lib/kubelet/pods"
    mounts = {m["name"]: m for m in the_container(ds)["volumeMounts"]}
    assert mounts["kubelet-pods"]["readOnly"] is True
    assert mounts["kubelet-pods"]["mountPath"] == "/var/lib/kubelet/pods"


def test_agent_is_not_privileged_and_holds_only_the_measured_capabilities() -> None:
    """Issue 15 item 6: the agent drops every capability but the three its checks need
    (docs/checks.md "Capabilities"; proven in Docker by scripts/image-tests.sh), on a read-only
    root under the runtime's seccomp profile, and is not evicted first."""
    ds = agent_daemonset(render({}))
    spec = ds["spec"]["template"]["spec"]
    sc = the_container(ds)["securityContext"]
    assert sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE", "SYS_ADMIN", "DAC_READ_SEARCH"]}
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    # Kubernetes rejects allowPrivilegeEscalation: false together with CAP_SYS_ADMIN.
    assert "allowPrivilegeEscalation" not in sc
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["hostPID"] is True
    # Overridable: an empty priorityClassName renders none.
    spec = agent_daemonset(render({"agent": {"priorityClassName": ""}}))["spec"]["template"]["spec"]
    assert "priorityClassName" not in spec
