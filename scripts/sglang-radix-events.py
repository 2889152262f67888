#!/usr/bin/env python3
"""KV-event batches as SGLang 0.5.5's own radix cache emits them (issue 39 item 9).

Runs `sglang/srt/mem_cache/radix_cache.py` of the sglang 0.5.5 wheel unchanged — its
`insert`, `_split_node`, `evict`, `reset` and `_record_*_event` — with the event classes of the
same wheel's `sglang/srt/disaggregation/kv_events.py`, and encodes every scheduler step's
events as its `ZmqEventPublisher` does (`msgspec.msgpack.Encoder().encode(KVEventBatch(...))`).
Only torch, triton-backed allocator/memory-pool modules, pydantic and zmq are stubbed (nothing of
them runs: values are plain lists, the allocator's `free` is a no-op).

    scripts/sglang-radix-events.py DIR [OUT]

DIR holds the wheel's files (`scripts/fetch-sglang-radix.sh` puts them in
target/ci-cache/sglang/0.5.5); OUT defaults to stdout. The committed output is
testdata/kv-events/radix/sglang-0.5.5.json, read by agent/tests/kv_sglang_radix.rs.

What 0.5.5 does on the wire (read in radix_cache.py): every radix node's first page is sent
with parent_block_hash None (`node.parent is None or node != self.root_node` is always true),
and page hashes are `hash(tuple(page_tokens))` — content only, so the same page at two depths
has one hash. 0.5.6 chains SHA-256 page hashes and links a node to its parent's last page.
"""
import json
import sys
import types

PAGE = 16


def stub(name, **attrs):
    m = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(m, k, v)
    sys.modules[name] = m
    return m


def load(base):
    sys.path.insert(0, base)
    stub("torch", device=lambda *a, **k: "cpu", Tensor=list, int64="int64")
    stub("pydantic", BaseModel=object)
    # The publisher's sockets are not used: batches are encoded here as it encodes them.
    zmq = stub("zmq")
    zmq.__getattr__ = lambda name: type(name, (), {})
    stub("sglang.srt.mem_cache.allocator", BaseTokenToKVPoolAllocator=object)
    stub("sglang.srt.mem_cache.memory_pool", ReqToTokenPool=object)
    import msgspec  # noqa: F401  (the publisher's encoder)
    from sglang.srt.disaggregation import kv_events
    from sglang.srt.mem_cache import radix_cache
    return kv_events, radix_cache


class Allocator:
    device = "cpu"

    def free(self, _value):
        pass


def main():
    base = sys.argv[1]
    kv_events, rc = load(base)
    import msgspec

    enc = msgspec.msgpack.Encoder()
    ts = [1780000000.0]

    def step(cache):
        """One scheduler step: the events queued so far as one batch, as the publisher sends it."""
        events = cache.take_events()
        ts[0] += 0.05
        batch = kv_events.KVEventBatch(ts=round(ts[0], 3), events=events, attn_dp_rank=0)
        return {"payload_hex": enc.encode(batch).hex(), "events": len(events)}

    def tokens(*ranges):
        out = []
        for a, b in ranges:
            out.extend(range(a, b))
        return out

    scenarios = []

    # 1. A node split and a child under a non-root node: 0.5.5 sends both parentless.
    cache = rc.RadixCache(None, Allocator(), page_size=PAGE, enable_kv_cache_events=True)
    steps, requests = [step(cache)], []
    for req in (tokens((0, 64)), tokens((0, 32), (1000, 1032)), tokens((0, 80))):
        cache.insert(rc.RadixKey(req), list(req))
        requests.append(req)
        steps.append(step(cache))
    scenarios.append({
        "label": "split and continuation: 0..63, then 0..31+1000..1031 (splits at 32), then 0..79",
        "steps": steps,
        "requests": requests,
        "probes": [tokens((32, 64)), tokens((32, 80)), tokens((1000, 1032)), tokens((64, 80)),
                   tokens((0, 64)), tokens((0, 32), (1000, 1032)), tokens((0, 80))],
    })

    # 2. A repeated page: pages P Q S P T of one request in a fresh cache (its reset is sent).
    cache = rc.RadixCache(None, Allocator(), page_size=PAGE, enable_kv_cache_events=True)
    steps = [step(cache)]
    req = tokens((0, 48), (0, 16), (48, 64))
    cache.insert(rc.RadixKey(list(req)), list(req))
    steps.append(step(cache))
    scenarios.append({
        "label": "repeated page: P Q S P T (page 0 content again at page 3) in a fresh cache",
        "steps": list(steps),
        "requests": [req],
        "probes": [req, tokens((0, 16), (48, 64))],
    })

    # 3. The repeated page's request evicted (one BlockRemoved per page, the repeat included).
    cache.evict(10_000)
    steps.append(step(cache))
    scenarios.append({
        "label": "repeated page evicted: every page removed",
        "steps": steps,
        "requests": [],
        "probes": [req],
    })

    doc = {
        "engine": "sglang",
        "version": "0.5.5",
        "source": "sglang-0.5.5-py3-none-any.whl (PyPI, sha256 "
                  "3c57f135ec0a7a5cf6ae4ed5e0b231d7bf7e0fae588bbc1a881560f1c18db995): "
                  "sglang/srt/mem_cache/radix_cache.py RadixCache and "
                  "sglang/srt/disaggregation/kv_events.py KVEventBatch, run by "
                  "scripts/sglang-radix-events.py",
        "page_size": PAGE,
        "scenarios": scenarios,
    }
    text = json.dumps(doc, indent=1) + "\n"
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
