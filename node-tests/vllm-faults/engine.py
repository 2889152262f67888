#!/usr/bin/env python3
"""A stand-in vLLM engine for the KV-event fault suite (node-tests/tests/kv_faults_vllm.rs).

Publishing is vLLM's own: `vllm/distributed/kv_events.py` from the released wheel (unpacked by
scripts/fetch-vllm.sh) is loaded by file path with small stubs for the few vLLM modules it
imports (logger, config, network helpers, the block-hash type), so `ZmqEventPublisher` — its PUB
socket, sequence numbers, replay ROUTER and buffer — and the `KVEventBatch` / `BlockStored` /
`BlockRemoved` / `AllBlocksCleared` types run unchanged. Nothing here is vLLM code.

What drives it is a model of vLLM's prefix-caching block pool, written from vLLM's documented
behaviour (not its code): a fixed number of physical blocks; a request reuses the cached prefix of
its full blocks and takes new blocks from the least-recently-freed end of the free queue, evicting
what they cached (one BlockRemoved per evicted physical block); the new full blocks of a request are
cached when its step ends (one BlockStored per request and step, parent = the block before the run).
Requests of one step do not see each other's new blocks, so two identical block-aligned prompts in
one step hold one hash in two physical blocks — BlockStored twice, later BlockRemoved twice.
The model is the ground truth: `truth` lists every hash it holds.

Protocol: one JSON object per line on stdin, one JSON reply per line on stdout.
  {"cmd": "steps", "n": N, "per_step": R, "dup": bool}  run N scheduler steps (R requests each;
                                                      `dup`: every request repeats a prompt of
                                                      its step) -> {"seq": last seq published}
  {"cmd": "drain"}                                    wait until every batch was sent
  {"cmd": "drop", "n": K}                             the next K batches are buffered for replay
                                                      but not sent live (what a full PUB
                                                      high-water mark does)
  {"cmd": "forge", "seq": S}                          send one frame with seq S that the engine
                                                      never produced (not in its buffer)
  {"cmd": "repeat"}                                   send the last frame sent live again (same
                                                      seq, same bytes: a duplicate)
  {"cmd": "clear"}                                    reset the prefix cache (AllBlocksCleared)
  {"cmd": "truth"}                                    -> {"blocks": [[prompt id, blocks], …],
                                                      "prompts": {id: [tokens]} (new ones)}
  {"cmd": "load", "seconds": S, "blocks_per_s": B, "per_step": R, "probe_ms": M}
                                                      steps paced to B block events (stored +
                                                      removed hashes) per second for S seconds;
                                                      every M ms, right after a batch is handed
                                                      to the publisher, one line
                                                      {"probe": {"t_ns": wall-clock ns, "seq":
                                                      the batch's publisher seq, "tokens":
                                                      [the prefix of its deepest new run],
                                                      "blocks": its full blocks}} (ic-bench's
                                                      publish -> visible measurement) ->
                                                      {"seq", "batches", "block_events",
                                                      "seconds", "cpu_s", "sent_ns": [[seq,
                                                      wall-clock ns the publisher thread
                                                      handed that probe's batch to its PUB
                                                      socket], …]}
  {"cmd": "exit"}
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import random
import socket
import sys
import types
from collections import OrderedDict


def load_kv_events(path: str):
    """Loads vLLM's kv_events.py with stubs for its vLLM imports."""

    def module(name: str) -> types.ModuleType:
        m = sys.modules.get(name) or types.ModuleType(name)
        sys.modules[name] = m
        return m

    for name in ("vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core", "vllm.distributed"):
        module(name)

    class KVEventsConfig:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    module("vllm.config.kv_events").KVEventsConfig = KVEventsConfig
    module("vllm.logger").init_logger = logging.getLogger
    net = module("vllm.utils.network_utils")
    net.get_ip = lambda: "127.0.0.1"
    net.get_tcp_uri = lambda ip, port: f"tcp://{ip}:{port}"
    net.is_valid_ipv6_address = lambda ip: ":" in ip
    net.split_zmq_path = lambda p: (p.split("://")[0], *p.split("://")[1].rsplit(":", 1))
    module("vllm.v1.core.kv_cache_utils").ExternalBlockHash = bytes | int
    spec = importlib.util.spec_from_file_location("vllm.distributed.kv_events", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["vllm.distributed.kv_events"] = mod
    spec.loader.exec_module(mod)
    return mod


class BlockPool:
    """The prefix-caching pool model (see the module docs)."""

    def __init__(self, kv, num_blocks: int, block_size: int, seed: int, user_blocks: int = 6):
        self.kv = kv
        self.block_size = block_size
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.block_hash: dict[int, int] = {}  # physical block -> hash it caches
        self.cached: dict[int, list[int]] = {}  # hash -> physical blocks holding it
        self.origin: dict[int, tuple[int, int]] = {}  # hash -> (prompt id, blocks)
        self.rng = random.Random(seed)
        self.prompts: list[list[int]] = []
        self.reported = 0
        self.user_blocks = user_blocks
        # A few long shared prefixes (system prompts) and many suffixes.
        self.systems = [
            [self.rng.randrange(1, 50_000) for _ in range(block_size * self.rng.randrange(2, 8))]
            for _ in range(6)
        ]

    @staticmethod
    def chain(parent: int | None, tokens: list[int]) -> int:
        h = hashlib.blake2b(digest_size=8)
        h.update((parent or 0).to_bytes(8, "little"))
        h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
        return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)

    def new_prompt(self) -> int:
        bs = self.block_size
        sys_p = self.rng.choice(self.systems)
        user = [self.rng.randrange(1, 50_000) for _ in range(bs * self.rng.randrange(0, self.user_blocks))]
        tail = [self.rng.randrange(1, 50_000) for _ in range(self.rng.randrange(0, bs))]
        self.prompts.append(sys_p + user + tail)
        return len(self.prompts) - 1

    def step(self, per_step: int, dup: bool) -> list:
        """One scheduler step: admit requests, cache their full blocks, free them."""
        bs = self.block_size
        events = []
        held: list[list[int]] = []
        pids = []
        for r in range(per_step):
            if dup and r % 2 == 1 and pids:
                pids.append(pids[-1])
            elif self.prompts and self.rng.random() < 0.3:
                pids.append(self.rng.randrange(len(self.prompts)))
            else:
                pids.append(self.new_prompt())
        start_cache = set(self.cached)  # what requests of this step can reuse
        runs = []
        self.last_runs = runs
        for pid in pids:
            toks = self.prompts[pid]
            nfull = len(toks) // bs
            hashes, parent = [], None
            for i in range(nfull):
                parent = self.chain(parent, toks[i * bs:(i + 1) * bs])
                hashes.append(parent)
            blocks, i = [], 0
            while i < nfull and hashes[i] in start_cache and self.cached.get(hashes[i]):
                pb = self.cached[hashes[i]][0]
                self.free.pop(pb, None)
                blocks.append(pb)
                i += 1
            first_new = i
            for j in range(first_new, nfull):
                if not self.free:
                    break
                pb, _ = self.free.popitem(last=False)
                old = self.block_hash.pop(pb, None)
                if old is not None:
                    holders = self.cached.get(old, [])
                    if pb in holders:
                        holders.remove(pb)
                    if not holders:
                        self.cached.pop(old, None)
                    events.append(self.kv.BlockRemoved(block_hashes=[old], medium="GPU"))
                blocks.append(pb)
            held.append(blocks)
            runs.append((pid, hashes, first_new, len(blocks)))
        # The step ends: new full blocks are cached, one BlockStored per request.
        for pid, hashes, first_new, nblocks in runs:
            if nblocks <= first_new:
                continue
            toks = self.prompts[pid]
            new = hashes[first_new:nblocks]
            for k, h in enumerate(new, start=first_new):
                self.origin.setdefault(h, (pid, k + 1))
            events.append(
                self.kv.BlockStored(
                    block_hashes=new,
                    parent_block_hash=hashes[first_new - 1] if first_new > 0 else None,
                    token_ids=toks[first_new * bs:nblocks * bs],
                    block_size=bs,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                )
            )
        for (pid, hashes, first_new, nblocks), blocks in zip(runs, held):
            for k, pb in enumerate(blocks):
                if k >= first_new:
                    self.block_hash[pb] = hashes[k]
                    self.cached.setdefault(hashes[k], []).append(pb)
        # Finished: freed in reverse so a request's tail blocks are evicted first.
        for blocks in held:
            for pb in reversed(blocks):
                self.free[pb] = None
        return events

    def clear(self):
        self.cached.clear()
        self.block_hash.clear()

    def truth(self) -> dict:
        new = {str(i): p for i, p in enumerate(self.prompts) if i >= self.reported}
        self.reported = len(self.prompts)
        blocks = [list(self.origin[h]) for h in self.cached]
        return {"blocks": blocks, "copies": sum(len(v) for v in self.cached.values()), "prompts": new}


# Publisher seq -> wall-clock ns its batch went to the PUB socket (the publisher thread's
# send_multipart, wrapped in main); cleared by each `load`.
SENT_NS: dict = {}


def load(cmd, kv, pub, pool, seq, reply) -> int:
    """The `load` command: paced steps with publish-time probes (see the module docs)."""
    import time

    SENT_NS.clear()
    probed = []

    seconds = float(cmd["seconds"])
    rate = float(cmd["blocks_per_s"])
    per_step = int(cmd.get("per_step", 8))
    probe_ns = int(float(cmd.get("probe_ms", 50)) * 1e6)
    bs = pool.block_size
    cpu0 = time.process_time()
    t0 = time.monotonic()
    next_probe = time.time_ns()
    events_total = batches = 0
    while True:
        elapsed = time.monotonic() - t0
        if elapsed >= seconds:
            break
        ahead = events_total / rate - elapsed
        if ahead > 0:
            time.sleep(ahead)
        events = pool.step(per_step, False)
        if not events:
            continue
        pub.publish(kv.KVEventBatch(ts=time.time(), events=events))
        now = time.time_ns()
        seq += 1
        batches += 1
        for e in events:
            events_total += len(e.block_hashes)
        if now >= next_probe:
            runs = [r for r in pool.last_runs if r[3] > r[2]]
            if runs:
                pid, _, _, nblocks = max(runs, key=lambda r: r[3])
                probed.append(seq)
                reply({"probe": {"t_ns": now, "seq": seq, "tokens": pool.prompts[pid][: nblocks * bs], "blocks": nblocks}})
                next_probe = now + probe_ns
    pub._event_queue.join()
    return_seq = seq
    reply({
        "seq": return_seq,
        "batches": batches,
        "block_events": events_total,
        "seconds": time.monotonic() - t0,
        "cpu_s": time.process_time() - cpu0,
        "sent_ns": [[s, SENT_NS[s]] for s in probed if s in SENT_NS],
    })
    return return_seq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-events", required=True, help="path of vllm/distributed/kv_events.py")
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--replay-endpoint", required=True)
    ap.add_argument("--buffer-steps", type=int, default=10_000)
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dp-rank", type=int, default=0)
    ap.add_argument("--user-blocks", type=int, default=6, help="prompts carry 0 to N-1 blocks after their system prompt")
    args = ap.parse_args()

    kv = load_kv_events(args.kv_events)
    pub = kv.ZmqEventPublisher(
        data_parallel_rank=args.dp_rank,
        endpoint=args.endpoint,
        replay_endpoint=args.replay_endpoint,
        buffer_steps=args.buffer_steps,
    )
    pool = BlockPool(kv, args.num_blocks, args.block_size, args.seed, args.user_blocks)
    # `drop`: the publisher thread's PUB send is skipped for the next K batches; they still
    # enter the replay buffer, as with a full high-water mark.
    drops = {"left": 0}
    real_send = pub._pub.send_multipart
    last_frames = {"frames": None}

    def send(frames, *a, **kw):
        SENT_NS[int.from_bytes(frames[1], "big")] = time.time_ns()
        last_frames["frames"] = [bytes(f) for f in frames]
        if drops["left"] > 0:
            drops["left"] -= 1
            return None
        return real_send(frames, *a, **kw)

    pub._pub.send_multipart = send
    seq = -1
    import time

    def reply(obj):
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    for line in sys.stdin:
        cmd = json.loads(line)
        c = cmd["cmd"]
        if c == "steps":
            for _ in range(cmd["n"]):
                events = pool.step(cmd.get("per_step", 2), cmd.get("dup", False))
                if events:
                    pub.publish(kv.KVEventBatch(ts=time.time(), events=events))
                    seq += 1
            reply({"seq": seq})
        elif c == "drain":
            pub._event_queue.join()
            reply({"seq": seq})
        elif c == "drop":
            pub._event_queue.join()
            drops["left"] = cmd["n"]
            reply({"ok": True})
        elif c == "forge":
            pub._event_queue.join()
            payload = kv.msgspec.msgpack.encode(kv.KVEventBatch(ts=time.time(), events=[kv.AllBlocksCleared()]))
            real_send((b"", int(cmd["seq"]).to_bytes(8, "big"), payload))
            reply({"ok": True})
        elif c == "repeat":
            pub._event_queue.join()
            if last_frames["frames"] is not None:
                real_send(last_frames["frames"])
            reply({"ok": last_frames["frames"] is not None})
        elif c == "clear":
            pool.clear()
            pub.publish(kv.KVEventBatch(ts=time.time(), events=[kv.AllBlocksCleared()]))
            seq += 1
            pub._event_queue.join()
            reply({"seq": seq})
        elif c == "truth":
            pub._event_queue.join()
            reply(pool.truth())
        elif c == "load":
            seq = load(cmd, kv, pub, pool, seq, reply)
        elif c == "exit":
            break
    pub.shutdown()


if __name__ == "__main__":
    socket.setdefaulttimeout(10)
    main()
