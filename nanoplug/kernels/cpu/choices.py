"""Choices whose best value depends on the CPU, measured once per machine and kept beside the kernel builds.

Which way is faster differs between CPU families: on a 2-core AVX2 EPYC packing the float32 weights for
nanoplug's GEMM halved batch-16 decode, where on AVX-512 machines it is the faster way; whether a GGUF
decode GEMV runs faster with float32 activations or with int8x2 ones (both float32 compute's quality)
depends on the SIMD width and the memory. So each is timed briefly (tens of milliseconds, on the shapes of
a small model's decode step) the first time an engine needs it on this machine, and the answer is cached
per CPU signature, kernel sources, torch version and thread count (`cpu_kernels/choices-<key>.json`). The
cpu platform logs what it uses and where it came from; `nanoplug plugins` shows the cached answers; an
explicit option (`cpu={"weight_packing": ...}`, `cpu={"gguf_activations": ...}`) wins over both.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import platform
import time
from typing import Any, Callable

import torch

from nanoplug.kernels.cpu.build import SOURCE, _cpu_signature, cache_dir

log = logging.getLogger("nanoplug")

# the rows a decode step of the packed GEMM is timed at (the batch 16), and the GGUF GEMV's
PACKING_ROWS = 16
GGUF_ROWS = (1, 2, 4, 8, 16, 64)
# SmolLM2-135M's MLP: the fused gate/up [3072, 576] and the down projection [576, 1536]
SHAPES = ((3072, 576), (576, 1536))
ALWAYS = 1 << 30  # switch_rows when one mode serves every size
NOISE = 1.25  # two timings of one thing further apart than this: the machine was too busy to measure
NOISY_ATTEMPTS = 3  # disturbed measurements before their safe answer is kept (each costs start-up time)


def _key() -> str:
    from nanoplug.kernels.cpu.quant_ops import SOURCE as QUANT_SOURCE

    parts = [_cpu_signature(), platform.machine(), torch.__version__, str(torch.get_num_threads()),
             hashlib.sha256(SOURCE.read_bytes() + QUANT_SOURCE.read_bytes()).hexdigest(), "1"]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def path() -> pathlib.Path:
    """This machine's (and thread count's) file of measured choices."""
    return cache_dir() / f"choices-{_key()}.json"


def cached() -> dict[str, Any]:
    """The choices measured on this machine so far ({} when none)."""
    try:
        return json.loads(path().read_text())
    except (OSError, ValueError):
        return {}


def choice(name: str, measure: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """The cached answer of `name`, or `measure()`'s, stored; and where it came from ("cached"/"measured")."""
    known = cached()
    before = known.get(name)
    if before is not None and (not before.get("noisy") or before.get("attempts", 1) >= NOISY_ATTEMPTS):
        return before, "cached"
    answer = measure()
    if answer.get("noisy"):  # a busy machine: its safe answer, measured again at the next starts (a few)
        answer["attempts"] = (before or {}).get("attempts", 0) + 1
        log.warning("cpu: the %s measurement was disturbed (repeats differ by more than %.0f%%; attempt %d of %d): "
                    "the safe choice is used and the next start measures again", name, 100 * (NOISE - 1),
                    answer["attempts"], NOISY_ATTEMPTS)
    known = {**cached(), name: answer}  # another process may have stored others meanwhile
    target = path()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
        os.replace(tmp, target)
    except OSError as exc:
        log.warning("cpu: could not cache the measured %s in %s: %s", name, target, exc)
    return answer, "measured, noisy" if answer.get("noisy") else "measured"


def _best_s(fn: Callable[[], Any], repeats: int = 15) -> float:
    fn()  # warm: caches, thread pool, page faults of the output
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)  # the least disturbed run: a shared machine descheduling a thread adds whole time slices


def _timed(fn: Callable[[], Any], noisy: list[bool], repeats: int = 15) -> float:
    """`_best_s` twice; when the two differ by more than NOISE (a thread descheduled in every repeat of one of
    them: a busy machine), `noisy` gets True and the answer is not cached."""
    a, b = _best_s(fn, repeats), _best_s(fn, repeats)
    if max(a, b) > NOISE * min(a, b):
        noisy.append(True)
    return min(a, b)


@torch.inference_mode()
def measure_packing(kernels: Any) -> dict[str, Any]:
    """nanoplug's packed GEMM against F.linear (MKL) at PACKING_ROWS rows on a small model's MLP shapes."""
    gen = torch.Generator().manual_seed(0)
    packed_s = plain_s = 0.0
    noisy: list[bool] = []
    for n, k in SHAPES:
        w, x = torch.randn(n, k, generator=gen), torch.randn(PACKING_ROWS, k, generator=gen)
        p = kernels.pack_weight(w)
        packed_s += _timed(lambda: kernels.linear(x, p, w, None), noisy)
        plain_s += _timed(lambda: torch.nn.functional.linear(x, w), noisy)
    faster = packed_s < plain_s if not noisy else True  # a busy machine: packing, as before it was measured
    return {"weight_packing": faster, "rows": PACKING_ROWS, "packed_ms": round(packed_s * 1e3, 4),
            "f_linear_ms": round(plain_s * 1e3, 4), "noisy": bool(noisy)}


def _random_q4_1(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random Q4_1 blocks of a [n, k] weight: float16 scale and minimum of a real weight's size, random quants."""
    blocks = n * k // 32
    raw = torch.randint(0, 256, (blocks, 20), dtype=torch.uint8, generator=gen)
    factors = torch.empty(blocks, 2, dtype=torch.float16)
    factors[:, 0] = torch.rand(blocks, generator=gen) * 0.01 + 0.001
    factors[:, 1] = -torch.rand(blocks, generator=gen) * 0.08
    raw[:, :4] = factors.view(torch.uint8)
    return raw.view(n, k // 32 * 20)


@torch.inference_mode()
def measure_gguf_activations(quant: Any) -> dict[str, Any]:
    """The GGUF GEMV with float32 activations against int8x2 ones, at GGUF_ROWS rows on a Q4_1 MLP: `small`,
    the faster at one row, serves up to `switch_rows` rows (as long as it stays the faster), `large` above."""
    gen = torch.Generator().manual_seed(0)
    weights = [(quant.pack("Q4_1", _random_q4_1(n, k, gen), n, k), n, k) for n, k in SHAPES]
    ms: dict[str, list[float]] = {"float": [], "int8x2": []}
    noisy: list[bool] = []
    for rows in GGUF_ROWS:
        xs = [torch.randn(rows, k, generator=gen) for _, _, k in weights]
        for act in ms:
            seconds = sum(_timed(lambda: quant.linear(x, "Q4_1", p, n, k, act=act), noisy, repeats=7 if rows > 8 else 15)
                          for x, (p, n, k) in zip(xs, weights))
            ms[act].append(round(seconds * 1e3, 4))
    faster = ["float" if f < i else "int8x2" for f, i in zip(ms["float"], ms["int8x2"])]
    small = faster[0]
    first_other = next((i for i, f in enumerate(faster) if f != small), None)
    if noisy:  # a busy machine: int8x2 everywhere (float32's quality; the faster on every CPU measured so far)
        return {"small": "int8x2", "switch_rows": ALWAYS, "large": "int8x2", "rows": list(GGUF_ROWS), "ms": ms,
                "noisy": True}
    if first_other is None:  # one mode the faster at every size measured
        return {"small": small, "switch_rows": ALWAYS, "large": small, "rows": list(GGUF_ROWS), "ms": ms}
    return {"small": small, "switch_rows": GGUF_ROWS[first_other - 1], "large": faster[first_other],
            "rows": list(GGUF_ROWS), "ms": ms}


def describe(name: str, answer: dict[str, Any], source: str) -> str:
    """One line for the start-up log and `nanoplug plugins`."""
    if name == "weight_packing":
        return (f"weight_packing={answer['weight_packing']} ({source}: packed GEMM {answer['packed_ms']} ms vs "
                f"F.linear {answer['f_linear_ms']} ms at {answer['rows']} rows)")
    if answer["small"] == answer["large"]:
        return f"gguf_activations={answer['small']} ({source})"
    return (f"gguf_activations={answer['small']} up to {answer['switch_rows']} rows, {answer['large']} above "
            f"({source}: {answer['ms']} ms at {answer['rows']} rows)")
