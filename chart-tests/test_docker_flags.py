"""The mapping from the rendered chart to `docker run` flags that scripts/image-tests.sh uses to run
the images under the chart's securityContext (docker_flags.py): what it emits for the default
agent and controller, and that it refuses what it cannot express."""

from __future__ import annotations

from pathlib import Path

import pytest

from docker_flags import Unmapped, security_flags, workload_flags


def _pairs(flags: list[str], flag: str) -> list[str]:
    return [flags[i + 1] for i, f in enumerate(flags) if f == flag]


def test_agent_flags_follow_the_daemonset(tmp_path: Path) -> None:
    flags = workload_flags(
        "agent",
        {"agent": {"hostPaths": {"kubeletPodsDir": str(tmp_path / "pods"), "state": str(tmp_path / "state")}}},
        tmp_path,
    )
    assert "--privileged" not in flags
    assert _pairs(flags, "--cap-drop") == ["ALL"]
    assert _pairs(flags, "--cap-add") == ["SYS_PTRACE", "SYS_ADMIN", "DAC_READ_SEARCH"]
    assert "--read-only" in flags
    assert _pairs(flags, "--user") == ["0:0"]
    assert _pairs(flags, "--pid") == ["host"] and _pairs(flags, "--network") == ["host"]
    # No no-new-privileges: the chart leaves allowPrivilegeEscalation unset (SYS_ADMIN).
    assert "no-new-privileges" not in _pairs(flags, "--security-opt")
    mounts = _pairs(flags, "-v")
    assert "/proc:/host/proc:ro" in mounts and "/dev/shm:/host/dev/shm:ro" in mounts
    assert f"{tmp_path / 'pods'}:{tmp_path / 'pods'}:ro,rslave" in mounts
    assert (tmp_path / "volume-controller-token" / "token").is_file()
    assert _pairs(flags, "--tmpfs") == ["/tmp:size=16m"]
    assert "IC_PROC_ROOT=/host/proc" in _pairs(flags, "-e")


def test_controller_flags(tmp_path: Path) -> None:
    flags = workload_flags("controller", {}, tmp_path)
    assert _pairs(flags, "--cap-drop") == ["ALL"] and not _pairs(flags, "--cap-add")
    assert "--read-only" in flags
    assert _pairs(flags, "--security-opt") == ["no-new-privileges"]
    assert "--pid" not in flags and "--network" not in flags


@pytest.mark.parametrize(
    "sc",
    [
        {"procMount": "Unmasked"},
        {"seccompProfile": {"type": "Localhost", "localhostProfile": "x.json"}},
        {"capabilities": {"add": ["NET_ADMIN"], "bogus": []}},
    ],
)
def test_unknown_fields_are_refused(sc: dict) -> None:
    with pytest.raises(Unmapped):
        security_flags(sc)
