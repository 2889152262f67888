"""The dcgm-exporter joins in docs/operations.md ("Joining dcgm-exporter") work: each `promql` block
of that section runs with `promtool test rules` on series shaped as ic-agent writes them
(`gpu`, `uuid`, `model`: agent/tests/checks_gpu.rs pins those labels on the real /metrics) and as
dcgm-exporter writes them (`gpu`, `UUID`, `modelName`, `Hostname`, `device`)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from conftest import ROOT
from test_alerts import promtool

H100 = "NVIDIA H100 80GB HBM3"
AGENT = '{{job="inference-cache/inference-cache-agent", namespace="inference-cache", node="n1", pod="agent-1", gpu="{i}", uuid="GPU-{u}", model="%s"}}' % H100
DCGM = '{{job="gpu-operator/nvidia-dcgm-exporter", Hostname="n1", gpu="{i}", device="nvidia{i}", UUID="GPU-{u}", modelName="%s", DCGM_FI_DRIVER_VERSION="550.54.15"}}' % H100


def join_examples() -> list[str]:
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("### Joining dcgm-exporter", 1)[1].split("\n#", 1)[0]
    blocks = re.findall(r"```promql\n(.*?)```", section, re.S)
    assert len(blocks) == 2, blocks
    return [" ".join(b.split()) for b in blocks]


def test_the_documented_dcgm_joins_answer(tmp_path: Path) -> None:
    status, xid = join_examples()
    series = [
        # gpu0 (GPU-a) Critical here, gpu1 (GPU-b) Ok here, gpu2 (GPU-c) only in DCGM
        {"series": "inferencecache_agent_gpu_status" + AGENT.format(i=0, u="a"), "values": "3x5"},
        {"series": "inferencecache_agent_gpu_status" + AGENT.format(i=1, u="b"), "values": "0x5"},
        {"series": "DCGM_FI_DEV_GPU_TEMP" + DCGM.format(i=0, u="a"), "values": "71x5"},
        {"series": "DCGM_FI_DEV_GPU_TEMP" + DCGM.format(i=1, u="b"), "values": "40x5"},
        {"series": "DCGM_FI_DEV_GPU_TEMP" + DCGM.format(i=2, u="c"), "values": "45x5"},
        {"series": "DCGM_FI_DEV_XID_ERRORS" + DCGM.format(i=0, u="a"), "values": "79x5"},
        {"series": "DCGM_FI_DEV_XID_ERRORS" + DCGM.format(i=1, u="b"), "values": "13x5"},
        {"series": "DCGM_FI_DEV_XID_ERRORS" + DCGM.format(i=2, u="c"), "values": "0x5"},
    ]
    tests = {
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "promql_expr_test": [
                    # DCGM's temperature of the GPU the agent does not call Ok, with our node and index
                    {
                        "expr": status,
                        "eval_time": "3m",
                        "exp_samples": [
                            {"labels": f'{{UUID="GPU-a", modelName="{H100}", node="n1", gpu="0"}}', "value": 71}
                        ],
                    },
                    # DCGM saw XID 13 on GPU-b, which the agent calls Ok (its policy ignores 13)
                    {
                        "expr": xid,
                        "eval_time": "3m",
                        "exp_samples": [
                            {"labels": f'{{UUID="GPU-b", uuid="GPU-b", modelName="{H100}"}}', "value": 13}
                        ],
                    },
                ],
            }
        ]
    }
    (tmp_path / "join-test.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    r = subprocess.run([promtool(), "test", "rules", str(tmp_path / "join-test.yaml")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
