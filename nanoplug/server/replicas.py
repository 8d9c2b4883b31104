"""Data-parallel replicas (`nanoplug serve --data-parallel-size N`): N engine processes behind one front end.

Each replica is an `EngineProcess` (its own model copy, scheduler and prefix cache) pinned to one GPU, or on
the CPU to its share of the cores. `Replicas` has the same surface as one engine (submit, abort, stats,
streams), so the app, the routes and the metrics are unchanged; the streams are shared, each marked with its
replica.

Dispatch is by prefix affinity, then load (as SGLang's cache-aware router and llm-d's prefix scorer do): the
prompt's first blocks are hashed in a chain (`PrefixAffinity`), and a request goes to the replica that last
served the longest chain of them, since its prefix cache likely still holds them; with no match, or when that
replica has no free batch slot while another has one, or holds `balance_slack` more open requests than the least
loaded, the least loaded replica takes it.
The blocks are of the prompt as the front end has it: token ids when the client sent ids, else the text (or
a chat's messages) in blocks of `kv_block_size * 4` characters (about a KV block of tokens): the front end
never tokenizes a prompt twice.

A replica that dies fails only its own requests (a 503 naming it, so a client retries at once), is reported
on /health, and gets no more requests; the server dies (or restarts, with --restart-engine) only when every
replica has.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from collections import OrderedDict
from typing import Any

from nanoplug.config import EngineConfig
from nanoplug.server.engine_process import EngineProcess, Stats
from nanoplug.server.errors import APIError
from nanoplug.server.streams import RequestStream, Streams

log = logging.getLogger("nanoplug.server")
CHARS_PER_TOKEN = 4  # a text block of kv_block_size * 4 characters stands for one KV block of tokens


class PrefixAffinity:
    """Which replica last served each chain of prompt blocks (bounded, least recently used dropped first)."""

    def __init__(self, block_tokens: int, max_blocks: int = 4, capacity: int = 1 << 16):
        self.block_tokens, self.max_blocks, self.capacity = block_tokens, max_blocks, capacity
        self.owner: OrderedDict[bytes, int] = OrderedDict()

    def keys(self, prompt: Any) -> list[bytes]:
        """Chained hashes of the prompt's first full blocks (none for a prompt shorter than a block)."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            unit, seq = self.block_tokens, prompt
        else:
            if not isinstance(prompt, str):  # chat messages (and tools): their JSON, the system prompt first
                prompt = json.dumps(prompt, ensure_ascii=False, separators=(",", ":"), default=str)
            unit, seq = self.block_tokens * CHARS_PER_TOKEN, prompt
        keys, digest = [], hashlib.blake2b(digest_size=16)
        for b in range(min(self.max_blocks, len(seq) // unit)):
            digest.update(repr(seq[b * unit:(b + 1) * unit]).encode())
            keys.append(digest.copy().digest())
        return keys

    def lookup(self, keys: list[bytes]) -> int | None:
        """The replica holding the longest chain of these blocks, if any."""
        for key in reversed(keys):
            replica = self.owner.get(key)
            if replica is not None:
                return replica
        return None

    def record(self, keys: list[bytes], replica: int) -> None:
        for key in keys:
            self.owner[key] = replica
            self.owner.move_to_end(key)
        while len(self.owner) > self.capacity:
            self.owner.popitem(last=False)

    def forget(self, replica: int) -> None:
        for key in [k for k, r in self.owner.items() if r == replica]:
            del self.owner[key]


class Replicas:
    """N engine processes behind one front end, with EngineProcess's surface."""

    def __init__(self, config: EngineConfig, size: int, routing: str = "prefix", balance_slack: int | None = None):
        if routing not in ("prefix", "round_robin"):
            raise ValueError(f"routing {routing!r}: choose 'prefix' (affinity, then load) or 'round_robin'")
        self.config, self.routing = config, routing
        self.streams = Streams()
        self.on_death = lambda reason: None  # the app's: restart or exit, once every replica is dead
        self.replicas: list[EngineProcess] = []
        try:
            for i, env in enumerate(replica_envs(config, size)):  # one at a time: replicas sharing a GPU size their
                self.replicas.append(EngineProcess(config, streams=self.streams, owner=i,  # KV caches from what
                                                   label=f"engine replica {i}", env=env))  # the others left free
        except BaseException:
            self.stop()
            raise
        for i, replica in enumerate(self.replicas):
            replica.on_death = lambda reason, i=i: self._replica_died(i, reason)
        first = self.replicas[0]
        self.tokenizer, self.token_text, self.tool_call_format = first.tokenizer, first.token_text, first.tool_call_format
        self.max_model_len, self.vocab_size, self.max_lora = first.max_model_len, first.vocab_size, first.max_lora
        self.max_num_seqs = sum(r.max_num_seqs for r in self.replicas)  # the server's capacity counts them all
        self.affinity = PrefixAffinity(config.kv_block_size)
        self.balance_slack = balance_slack if balance_slack is not None else max(4, first.max_num_seqs // 4)
        self._next = 0  # round robin's turn
        self.dispatched = [0] * size  # requests sent to each replica, for tests and the benchmark

    # ------------------------------------------------------------------ what the app reads
    @property
    def failure(self) -> str | None:
        """Set only when every replica is dead (one dead replica is a degraded server, not a dead one)."""
        failures = [r.failure for r in self.replicas]
        return None if any(f is None for f in failures) else "; ".join(f"{r.label}: {f}" for r, f in
                                                                       zip(self.replicas, failures))

    @property
    def stats(self) -> Stats:
        """The replicas' stats summed (the live ones'; a dead replica holds nothing)."""
        live = [r.stats for r in self.replicas if r.failure is None] or [self.replicas[0].stats]
        total = Stats(*(sum(getattr(s, f) for s in live) for f in Stats.__struct_fields__[:7]))
        total.running_adapters = sorted({a for s in live for a in s.running_adapters})
        total.waiting_adapters = sorted({a for s in live for a in s.waiting_adapters})
        return total

    def health(self) -> list[dict]:
        """Each replica's state, how many requests it was sent and holds now (open: what dispatch weighs), and its
        scheduler's running and waiting counts as of its last step."""
        load = self.streams.load
        return [{"replica": i, "status": "ok", "requests": self.dispatched[i], "open": load.get(i, 0),
                 "running": r.stats.num_running, "waiting": r.stats.num_waiting} if r.failure is None else
                {"replica": i, "status": "dead", "error": r.failure, "requests": self.dispatched[i]}
                for i, r in enumerate(self.replicas)]

    # ------------------------------------------------------------------ requests
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        for replica in self.replicas:
            replica.start(loop)

    def pick(self, prompt: Any) -> int:
        """The replica for a request whose first prompt is `prompt` (loop thread only)."""
        live = [i for i, r in enumerate(self.replicas) if r.failure is None]
        if not live:
            raise APIError(503, f"every engine replica is dead ({self.failure})", type="server_error",
                           code="engine_dead")
        if self.routing == "round_robin":
            self._next += 1
            return live[self._next % len(live)]
        load = self.streams.load
        least = min(live, key=lambda i: (load.get(i, 0), self.dispatched[i]))  # ties: the one sent fewer so far
        keys = self.affinity.keys(prompt)
        chosen = self.affinity.lookup(keys)
        if chosen is None or self.replicas[chosen].failure is not None or self._passes_on(chosen, least, load):
            chosen = least
        self.affinity.record(keys, chosen)
        return chosen

    def _passes_on(self, chosen: int, least: int, load: dict[int, int]) -> bool:
        """Whether the replica that holds the prompt's prefix gives the request to the least loaded one: when the
        request would wait there for a batch slot that the other has free now (the wait is a whole request's time,
        the prefix computed again one prefill), or when it holds `balance_slack` more open requests."""
        mine, other = load.get(chosen, 0), load.get(least, 0)
        if mine >= self.replicas[chosen].max_num_seqs and other < self.replicas[least].max_num_seqs:
            return True
        return mine > other + self.balance_slack

    async def submit(self, items: list, fill_context: bool = False, want_prompt_ids: bool = False) -> list[RequestStream]:
        chosen = self.pick(items[0][0])
        self.dispatched[chosen] += 1
        return await self.replicas[chosen].submit(items, fill_context, want_prompt_ids)

    def abort(self, request_id: str) -> None:
        stream = self.streams.open.get(request_id)
        if stream is not None:
            self.replicas[stream.owner].abort(request_id)

    async def load_adapter(self, name: str, path: str) -> None:
        """On every live replica, or on none: one that refuses undoes the others' loads."""
        done = []
        try:
            for replica in self.replicas:
                if replica.failure is None:
                    await replica.load_adapter(name, path)
                    done.append(replica)
        except BaseException:
            for replica in done:
                await replica.unload_adapter(name)
            raise

    async def unload_adapter(self, name: str) -> None:
        for replica in self.replicas:
            if replica.failure is None:
                await replica.unload_adapter(name)

    # ------------------------------------------------------------------ life and death
    def _replica_died(self, index: int, reason: str | None) -> None:
        self.affinity.forget(index)
        if self.failure is not None:
            self.on_death(self.failure)
        else:
            log.error("engine replica %s died (%s); the others serve on", index, reason)

    async def restart(self) -> None:
        """After every replica died (--restart-engine): each started again."""
        for replica in self.replicas:
            if replica.failure is not None:
                await replica.restart()

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()


def replica_envs(config: EngineConfig, size: int) -> list[dict[str, str]]:
    """What each replica's process gets: on CUDA one GPU each (replicas share GPUs round robin when there are
    fewer), on the CPU an equal share of this process's cores."""
    device = config.device
    import torch

    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        if len(gpus) < size:
            log.warning("%d replicas share %d GPU(s): each sizes its KV cache from the memory the others left "
                        "(lower --gpu-memory-utilization to leave room, e.g. 0.9 / replicas per GPU)", size, len(gpus))
        return [{"CUDA_VISIBLE_DEVICES": gpus[i % len(gpus)]} for i in range(size)]
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < size:
        return [{} for _ in range(size)]  # fewer cores than replicas: they share them all
    share = len(cpus) // size
    return [{"NANOPLUG_REPLICA_CPUS": ",".join(map(str, cpus[i * share:(i + 1) * share])), "OMP_NUM_THREADS": str(share)}
            for i in range(size)]
