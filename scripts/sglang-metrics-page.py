#!/usr/bin/env python3
"""Renders the `/metrics` page a real SGLang engine serves, from SGLang's own metrics code.

    target/ci-cache/sglang/venv/bin/python scripts/sglang-metrics-page.py \
        target/ci-cache/sglang/0.5.23 <scenario> > testdata/metrics/sglang-0.5.23-<scenario>.metrics

The collectors are SGLang's: `sglang/srt/observability/metrics_collector.py` from the released
wheel (`scripts/fetch-sglang.sh` unpacks the few files used here), executed unchanged with the
`prometheus_client` package. The page is what SGLang's HTTP server answers on `/metrics`
(`sglang/srt/utils/common.py` `add_prometheus_middleware`): prometheus_client in multiprocess
mode (`PROMETHEUS_MULTIPROC_DIR`), one `MultiProcessCollector` over the files every engine
process wrote, the text exposition format 0.0.4. As in the engine, every process (each TP rank's
scheduler, the tokenizer manager) is its own OS process (forked here), so the page carries one
file per process and the multiprocess collector merges them the way it does in a pod. Two runs
differ only in the order of families (the collector reads the files in directory order) and in
the `pid` label of SGLang's per-process gauges.

Replaced, because they pull in torch or the whole runtime (nothing here is SGLang code):
- `sglang.srt.runtime_context` (`get_observability()`, `get_serving()`, ...): the few settings
  the collectors read, with SGLang's defaults (`served_model_name`, no extra labels, default
  buckets, no priority scheduling, no PD disaggregation);
- `sglang.srt.server_args.ServerArgs`, `sglang.srt.utils.get_bool_env_var`, and
  `sglang.srt.utils.nvtx_utils` (profiling decorators, no-ops here);
- `DisaggregationMode` (`sglang/srt/disaggregation/utils.py`) and `ForwardMode`
  (`sglang/srt/model_executor/forward_batch_info.py`): their class definitions are taken from the
  wheel's source (by `ast`) and executed, not retyped.

What the engine does is driven through the collectors' own methods, the calls SGLang's
scheduler, radix cache and tokenizer manager make (`log_stats`, `increment_backup_num_tokens`,
`increment_load_back_num_tokens`, `observe_one_finished_request`, ...). Scenarios:

- `roundtrip`: TP=2, HiCache on (`--enable-hierarchical-cache`): blocks were backed up to the
  host pool (both TP ranks report the same token count, each its own bytes), evicted from the
  GPU, loaded back, and a request was served partly from the host tier
  (`cached_tokens_total{cache_source="host"}`).
- `written`: TP=1, HiCache on: blocks were backed up to host, every hit so far came from the GPU.
- `idle`: TP=1, HiCache on, no request yet: only the scheduler's periodic gauges.
- `no-hicache`: TP=1, HiCache off, `--enable-metrics`: requests served from the GPU cache.
- `dp2`: `--enable-dp-attention`, DP=2 (attention TP 1 each), HiCache on: rank 0 wrote to and
  served from the host tier, rank 1 wrote nothing yet; the tokenizer's counter is the pod's.
"""

from __future__ import annotations

import ast
import multiprocessing
import os
import sys
import tempfile
import types
from pathlib import Path

MODEL = "Qwen/Qwen3-8B"


def class_from_source(path: Path, name: str, namespace: dict):
    """Executes the definition of class `name` from `path` in `namespace`."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
            return namespace[name]
    raise SystemExit(f"{path}: no class {name}")


def exec_module(name: str, path: Path) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__file__ = str(path)
    sys.modules[name] = mod
    exec(compile(path.read_text(), str(path), "exec"), mod.__dict__)
    return mod


class Settings:
    """A settings bag: the named attributes, None for anything else the collectors ask."""

    def __init__(self, **values):
        self.__dict__.update(values)

    def __getattr__(self, name):
        return None


def install(root: Path, dp_size: int | None) -> types.ModuleType:
    """Loads `metrics_collector.py` from the unzipped wheel at `root` with the stubs above."""
    srt = root / "sglang" / "srt"
    for pkg in ["sglang", "sglang.srt", "sglang.srt.observability", "sglang.srt.utils",
                "sglang.srt.disaggregation", "sglang.srt.model_executor"]:
        m = types.ModuleType(pkg)
        m.__path__ = []
        sys.modules[pkg] = m

    from enum import Enum, IntEnum, auto

    disagg = types.ModuleType("sglang.srt.disaggregation.utils")
    disagg.DisaggregationMode = class_from_source(
        srt / "disaggregation" / "utils.py", "DisaggregationMode", {"Enum": Enum})
    sys.modules[disagg.__name__] = disagg

    fbi = types.ModuleType("sglang.srt.model_executor.forward_batch_info")
    fbi.ForwardMode = class_from_source(srt / "model_executor" / "forward_batch_info.py",
                                        "ForwardMode", {"IntEnum": IntEnum, "auto": auto})
    sys.modules[fbi.__name__] = fbi

    nvtx = types.ModuleType("sglang.srt.utils.nvtx_utils")
    nvtx.NVTX_SCHEDULER_ENABLED = False

    def profile_range(*_a, **_k):
        from contextlib import nullcontext
        return nullcontext()

    nvtx.profile_range = profile_range
    nvtx.scheduler_nvtx_method = lambda *a, **k: (a[0] if a and callable(a[0]) else (lambda f: f))
    sys.modules[nvtx.__name__] = nvtx

    utils = sys.modules["sglang.srt.utils"]
    utils.get_bool_env_var = lambda name, default="false": (
        os.environ.get(name, default).strip().lower() in ("1", "true"))
    exec_module("sglang.srt.utils.gauge_histogram", srt / "utils" / "gauge_histogram.py")

    sa = types.ModuleType("sglang.srt.server_args")
    sa.ServerArgs = type("ServerArgs", (), {})
    sys.modules[sa.__name__] = sa

    rc = types.ModuleType("sglang.srt.runtime_context")
    observability = Settings(enable_metrics=True, extra_metric_labels=None, stat_loggers=None,
                             tokenizer_metrics_allowed_custom_labels=None,
                             enable_metrics_for_all_schedulers=False)
    serving = Settings(served_model_name=MODEL, enable_streaming_session=False)
    # Defaults from sglang/srt/arg_groups/fields/schedule.py.
    schedule = Settings(enable_priority_scheduling=False, prefill_delayer_max_delay_passes=30)
    disagg_cfg = Settings(disaggregation_mode="null", enable_pd_role_switch=False)
    rc.get_observability = lambda: observability
    rc.get_serving = lambda: serving
    rc.get_schedule = lambda: schedule
    rc.get_disagg = lambda: disagg_cfg
    rc.get_parallel = lambda: Settings(dp_size=dp_size)
    rc.get_context = lambda: Settings(is_config_namespace_published=lambda _ns: False)
    rc.exports_expert_balancedness_to_prometheus = lambda *a, **k: False
    sys.modules[rc.__name__] = rc

    exec_module("sglang.srt.observability.utils", srt / "observability" / "utils.py")
    exec_module("sglang.srt.observability.scheduler_stage_metrics",
                srt / "observability" / "scheduler_stage_metrics.py")
    return exec_module("sglang.srt.observability.metrics_collector",
                       srt / "observability" / "metrics_collector.py")


def scheduler_labels(tp_rank: int, dp_rank: int | None) -> dict:
    """`SchedulerMetricsCollector.init_new`'s labels (no priority, no extra labels)."""
    labels = {"model_name": MODEL, "engine_type": "unified", "tp_rank": tp_rank,
              "pp_rank": 0, "moe_ep_rank": 0}
    if dp_rank is not None:
        labels["dp_rank"] = dp_rank
    return labels


def scheduler(mc, tp_rank: int, dp_rank: int | None, hicache: bool, used: int, total: int,
              running: int = 0):
    """What a stats-logging scheduler rank publishes each log interval."""
    c = mc.SchedulerMetricsCollector(labels=scheduler_labels(tp_rank, dp_rank),
                                     server_args=None, enable_hierarchical_cache=hicache)
    stats = mc.SchedulerStats(num_running_reqs=mc.QueueCount(total=running),
                              num_queue_reqs=mc.QueueCount(total=0),
                              hicache_host_used_tokens=used, hicache_host_total_tokens=total)
    c.log_stats(stats)


def radix(mc, tp_rank: int, dp_rank: int | None, backup: int, evicted: int, loaded: int,
          shard_bytes_per_token: int):
    """A rank's radix cache: D->H backups acknowledged, device evictions, H->D load-backs.
    `dp_rank` is the attention-DP rank with --enable-dp-attention, else None."""
    parallel = Settings(tp_rank=tp_rank, attn_tp_rank=tp_rank, attn_dp_rank=dp_rank, pp_rank=0)
    labels = mc.radix_cache_metric_labels("UnifiedRadixCache", parallel, dp_rank is not None)
    c = mc.RadixCacheMetricsCollector(labels=labels)
    if backup:
        c.increment_backup_num_tokens(num_tokens=backup, pool="kv")
        c.increment_backup_num_bytes(backup * shard_bytes_per_token)
        c.observe_backup_duration(0.004)
    if evicted:
        c.increment_eviction_num_tokens(evicted)
        c.observe_eviction_duration(0.002)
    if loaded:
        c.increment_load_back_num_tokens(loaded, pool="kv")
        c.increment_load_back_num_bytes(loaded * shard_bytes_per_token)
        c.observe_load_back_duration(0.003)


def tokenizer(mc, requests):
    """The tokenizer manager: one `observe_one_finished_request` per finished request,
    (prompt, generated, device-cached, host-cached) tokens."""
    c = mc.TokenizerMetricsCollector(server_args=None, labels=mc.tokenizer_metric_labels())
    for prompt, generated, device, host in requests:
        details = {"device": device, "host": host}
        c.observe_one_finished_request(
            labels=c.labels, prompt_tokens=prompt, generation_tokens=generated,
            cached_tokens=device + host, e2e_latency=0.8, has_grammar=False,
            cached_tokens_details=details if device + host > 0 else None,
            time_per_output_token=0.012)


SCENARIOS = {
    "roundtrip": "TP=2, HiCache on: backed up to host, evicted, loaded back, served from host",
    "written": "TP=1, HiCache on: backed up to host, every hit so far from the GPU",
    "idle": "TP=1, HiCache on, no request yet",
    "no-hicache": "TP=1, HiCache off, --enable-metrics: GPU prefix-cache hits only",
    "dp2": "--enable-dp-attention DP=2, HiCache on: rank 0 wrote and served, rank 1 idle",
}


def scenario(name: str):
    """The processes of the engine and what each does: (function, args)."""
    # Qwen3-8B: 36 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes = 144 KiB per token;
    # each of 2 TP ranks holds half the heads.
    per_token = 36 * 8 * 128 * 2 * 2
    if name == "roundtrip":
        return [
            (scheduler, (0, None, True, 2048, 458752, 1)),
            (radix, (0, None, 3072, 4096, 2048, per_token // 2)),
            (radix, (1, None, 3072, 4096, 2048, per_token // 2)),
            (tokenizer, ([(2100, 128, 0, 0), (2100, 64, 2048, 0), (2200, 96, 0, 2048),
                          (1100, 32, 1024, 0)],)),
        ]
    if name == "written":
        return [
            (scheduler, (0, None, True, 3072, 917504, 0)),
            (radix, (0, None, 3072, 0, 0, per_token)),
            (tokenizer, ([(2100, 128, 0, 0), (2100, 64, 2048, 0), (1100, 32, 1024, 0)],)),
        ]
    if name == "idle":
        return [(scheduler, (0, None, True, 0, 917504, 0))]
    if name == "no-hicache":
        return [
            (scheduler, (0, None, False, 0, 0, 0)),
            (tokenizer, ([(2100, 128, 0, 0), (2100, 64, 2048, 0)],)),
        ]
    if name == "dp2":
        return [
            (scheduler, (0, 0, True, 1024, 458752, 1)),
            # tp_size 2 over dp_size 2: scheduler labels carry the global TP rank, the radix
            # cache's the attention-TP rank (0 on both).
            (scheduler, (1, 1, True, 0, 458752, 0)),
            (radix, (0, 0, 2048, 2048, 1024, per_token)),
            (radix, (0, 1, 0, 0, 0, per_token)),
            (tokenizer, ([(2100, 128, 0, 0), (2100, 64, 0, 1024), (1100, 32, 1024, 0)],)),
        ]
    raise SystemExit(f"unknown scenario {name!r}")


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    root, name = Path(sys.argv[1]), sys.argv[2]
    procs = scenario(name)
    with tempfile.TemporaryDirectory() as d:
        # As SGLang's set_prometheus_multiproc_dir: before prometheus_client is imported.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = d
        mc = install(root, 2 if name == "dp2" else None)
        ctx = multiprocessing.get_context("fork")
        for fn, args in procs:
            p = ctx.Process(target=fn, args=(mc, *args))
            p.start()
            p.join()
            if p.exitcode != 0:
                raise SystemExit(f"{fn.__name__}{args}: exit {p.exitcode}")
        # add_prometheus_middleware: CollectorRegistry + MultiProcessCollector, served by
        # make_asgi_app, which answers a text/plain Accept with generate_latest.
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        from importlib.metadata import version

        whl = "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl"
        sys.stdout.write(
            f"# SGLang 0.5.23 /metrics, scenario {name}: {SCENARIOS[name]}.\n"
            f"# Rendered by scripts/sglang-metrics-page.py from SGLang's own collectors\n"
            f"# (sglang/srt/observability/metrics_collector.py of {whl},\n"
            f"# sha256 00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937, fetched by\n"
            f"# scripts/fetch-sglang.sh) with prometheus_client {version('prometheus_client')}\n"
            f"# in multiprocess mode, as SGLang's HTTP server serves it. Regenerate:\n"
            f"#   target/ci-cache/sglang/venv/bin/python scripts/sglang-metrics-page.py \\\n"
            f"#     target/ci-cache/sglang/0.5.23 {name} \\\n"
            f"#     > testdata/metrics/sglang-0.5.23-{name}.metrics\n"
            + generate_latest(registry).decode())


if __name__ == "__main__":
    main()
