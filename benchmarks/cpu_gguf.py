"""The default model's GGUF on CPU: nanoplug against llama.cpp on the very same file, in one process.

llama.cpp (llama-cpp-python, built from source where no wheel exists: `pip install llama-cpp-python==0.3.36`)
and nanoplug (`LLM(file.gguf)`: the GGUF's Q4_1/Q8_0 blocks kept as they are) are measured alternately,
best of `--repeats`, since the machine may be shared. One prompt of `--prompt-tokens` tokens,
`--new-tokens` greedy tokens, `--threads` threads for both:

- prefill tok/s = prompt tokens / time to the first token;
- batch-1 decode tok/s = (new tokens - 1) / (time to the last token - time to the first);
  llama.cpp is driven token by token (`eval` + argmax of its logits), nanoplug through `generate`
  (first token alone, then all of them: the difference is the decode steps, as benchmarks/cpu_smollm2.py);
- nanoplug at `--batch` concurrent prompts (benchmarks/cpu_smollm2.py's workload) against nanoplug's
  float32 engine on the dequantized checkpoint, same run;
- resident weight memory: the bytes of the model's parameters and buffers (the RoPE tables apart), and
  the process's resident memory after each engine is built;
- `--quality`: per-token log-probabilities of a fixed text (benchmarks/data/apache-2.0.txt, 2,224 tokens):
  mean KL(float32 compute || nanoplug) against the float32 engine on the same file dequantized
  (`quantization=None`; the default's target: 0.002 nats), and KL(llama.cpp || nanoplug) on the same file
  where llama.cpp runs.

    python benchmarks/cpu_gguf.py --threads 2 --kv-cache fp16 --base-tree ../8c5112a --quality   # RESULTS.md
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from _engines import TEXT, Nanoplug

DATA = Path(__file__).with_name("data") / "apache-2.0.txt"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        name = next(ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name"))
        flags = set(next(ln.split(":", 1)[1] for ln in lines if ln.startswith("flags")).split())
        simd = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
        return f"{name} ({os.cpu_count()} CPUs; {', '.join(simd)})"
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def commit() -> str:
    try:
        here = Path(__file__).parent
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True,
                               text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except OSError:
        return "?"


# ------------------------------------------------------------------------------------------ llama.cpp
class LlamaCpp:
    label = "llama.cpp"

    def __init__(self, gguf: str, threads: int, logits_all: bool = False, n_ctx: int = 1024,
                 extra_bufts: bool = True):
        import llama_cpp
        from llama_cpp import Llama

        if not extra_bufts:  # llama.cpp's repacked (AMX / interleaved) weight buffers off: they crash on some hosts
            default = llama_cpp.llama_model_default_params

            def params():
                p = default()
                p.use_extra_bufts = False
                return p

            llama_cpp.llama_cpp.llama_model_default_params = params
            llama_cpp.llama.llama_cpp.llama_model_default_params = params

        self.llm = Llama(gguf, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=512,
                         logits_all=logits_all, verbose=False)
        self.vocab = self.llm.n_vocab()

    def _last_logits(self) -> np.ndarray:
        return np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.vocab,))

    def run(self, ids: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
        """(time to the first token, time of the other tokens, greedy tokens), KV cache cleared first."""
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(ids)
        tokens = [int(self._last_logits().argmax())]
        first = time.perf_counter()
        for _ in range(new_tokens - 1):
            self.llm.eval([tokens[-1]])
            tokens.append(int(self._last_logits().argmax()))
        return first - start, time.perf_counter() - first, tokens

    def logprobs(self, ids: list[int]) -> np.ndarray:
        """log-softmax rows [len(ids) - 1, vocab] predicting ids[1:] (needs logits_all)."""
        self.llm.reset()
        self.llm.eval(ids)
        return log_softmax(np.array(self.llm.scores[: len(ids) - 1], dtype=np.float64))


# ------------------------------------------------------------------------------------------ nanoplug
def model_of(llm) -> torch.nn.Module:
    """The engine's model (single-device engines), found by its `compute_logits`."""
    seen, todo = set(), [llm]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module) and hasattr(obj, "compute_logits"):
            return obj
        if isinstance(obj, torch.nn.Module) or not hasattr(obj, "__dict__"):
            continue
        todo.extend(v for v in vars(obj).values() if hasattr(v, "__dict__"))
    raise RuntimeError("could not find the model inside the engine")


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of parameters and buffers holding weights, bytes of the RoPE tables), each tensor once."""
    seen, weights, rope = set(), 0, 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t is None or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        size = t.numel() * t.element_size()
        if name.endswith((".cos", ".sin")):
            rope += size
        else:
            weights += size
    return weights, rope


class NanoplugEngine(Nanoplug):
    def __init__(self, path: str, label: str, **options):
        super().__init__(path, **options)
        self.label = label
        self.model = model_of(self.llm)

    def run(self, ids: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
        start = time.perf_counter()
        self.generate([ids], 1)
        first = time.perf_counter() - start
        start = time.perf_counter()
        tokens = self.generate([ids], new_tokens)[0]
        return first, time.perf_counter() - start - first, tokens

    def logprobs(self, ids: list[int]) -> np.ndarray:
        """log-softmax rows predicting ids[1:]: the hidden states of every prompt position, captured as
        the prefill computes them, through the model's own LM head."""
        hidden = []
        hook = self.model.register_forward_hook(lambda m, args, out: hidden.append(out.detach().clone()))
        try:
            self.generate([ids], 1)
        finally:
            hook.remove()
        rows = torch.cat(hidden)[: len(ids) - 1]
        with torch.inference_mode():
            logits = torch.cat([self.model.compute_logits(rows[i:i + 256]) for i in range(0, len(rows), 256)])
        return log_softmax(logits.double().numpy())


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare_logprobs(ref: np.ndarray, got: np.ndarray, ids: list[int]) -> dict[str, float]:
    """Mean KL(ref || got) per position, and each side's perplexity of the text."""
    kl = (np.exp(ref) * (ref - got)).sum(axis=-1)
    targets = np.array(ids[1:])
    nll_ref = -ref[np.arange(len(targets)), targets].mean()
    nll_got = -got[np.arange(len(targets)), targets].mean()
    return dict(kl_mean=float(kl.mean()), kl_max=float(kl.max()), ppl_ref=float(np.exp(nll_ref)),
                ppl_got=float(np.exp(nll_got)), top1=float((ref.argmax(-1) == got.argmax(-1)).mean()))


# ------------------------------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None, help="GGUF file (default: the default model's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32, help="concurrent prompts for the batch figure (0: skip)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quality", action="store_true", help="also compare per-token log-probabilities")
    parser.add_argument("--no-llama", action="store_true", help="nanoplug only (llama-cpp-python not installed)")
    parser.add_argument("--no-extra-bufts", action="store_true",
                        help="llama.cpp without its repacked weight buffers (use_extra_bufts=False): where they crash")
    parser.add_argument("--kv-cache", default="auto",
                        help="the GGUF engine's KV-cache store (fp16: half the bytes decode attention reads, as "
                             "llama.cpp's default f16 cache; auto: float32)")
    parser.add_argument("--base-tree", default=None,
                        help="a checkout of another commit (e.g. 8c5112a): its float32 engine on the same 32-prompt "
                             "workload (its benchmarks/cpu_smollm2.py, in a subprocess) after nanoplug's figures")
    parser.add_argument("--gguf-activations", default="auto", choices=["auto", "float", "int8x2", "int8"],
                        help="cpu={'gguf_activations': ...} of the GGUF engine (int8: 40c35ae's default, for A/B runs)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with the process's CPU clock, not the wall clock (with --threads 1 on a shared "
                             "machine: time the process was not running is not counted)")
    args = parser.parse_args()
    if args.cpu_time:
        if args.threads != 1:
            parser.error("--cpu-time measures one thread's work: pass --threads 1")
        time.perf_counter = time.process_time  # every timer below, the cpu_smollm2 helpers' included
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from nanoplug.checkpoint.default_model import default_gguf_path, default_model_path

    gguf = args.gguf or str(default_gguf_path())
    folder = str(default_model_path(float32=True))  # the float32 engine of the batch figure
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = (tokenizer.encode(TEXT) * 8)[: args.prompt_tokens]
    print(f"# {cpu_name()}, torch {torch.__version__} ({torch.get_num_threads()} threads), nanoplug {commit()}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print(f"# {Path(gguf).name}; one {len(ids)}-token prompt, {args.new_tokens} greedy tokens, {args.threads} threads, "
          f"best of {args.repeats}, engines alternately in one process")

    options = dict(device="cpu", kv_block_size=16, max_model_len=4096, cpu={"kv_cache_gb": 1.0},
                   enable_prefix_caching=False, max_num_batched_tokens=4096)
    rss0 = rss_mb()
    quant = NanoplugEngine(gguf, "nanoplug (GGUF blocks)", **{**options, "cpu": {**options["cpu"], **(
        {} if args.gguf_activations == "auto" else {"gguf_activations": args.gguf_activations})}}, kv_cache=args.kv_cache)
    rss_quant = rss_mb() - rss0
    method = next(m.linear_method for m in quant.model.modules() if hasattr(m, "linear_method"))
    acts = getattr(method, "activations", None)
    print(f"# GGUF activations: {acts}")
    engines = [quant]
    if not args.no_llama:
        rss1 = rss_mb()
        engines.append(LlamaCpp(gguf, args.threads, extra_bufts=not args.no_extra_bufts))
        rss_llama = rss_mb() - rss1
    for engine in engines:  # warm-up
        engine.run(ids, 4)
    best = {e.label: [float("inf"), float("inf"), None] for e in engines}
    for _ in range(args.repeats):
        for engine in engines:
            first, rest, tokens = engine.run(ids, args.new_tokens)
            b = best[engine.label]
            b[0], b[1], b[2] = min(b[0], first), min(b[1], rest), tokens
    print("\n| engine | prefill tok/s | batch-1 decode tok/s | greedy tokens equal to llama.cpp's |")
    print("|---|---:|---:|---:|")
    ref_tokens = best["llama.cpp"][2] if "llama.cpp" in best else None
    for label, (first, rest, tokens) in best.items():
        same = (f"{sum(a == b for a, b in zip(tokens, ref_tokens))}/{len(ref_tokens)}" if ref_tokens else "-")
        print(f"| {label} | {len(ids) / first:.0f} | {(args.new_tokens - 1) / rest:.1f} | {same} |")
    if ref_tokens:
        q, l = best[quant.label], best["llama.cpp"]
        print(f"\nnanoplug / llama.cpp: prefill {l[0] / q[0]:.2f}x, batch-1 decode {l[1] / q[1]:.2f}x")

    weights, rope = weight_bytes(quant.model)
    print(f"\nresident weights: nanoplug {weights / 2**20:.1f} MiB in parameters and buffers (+{rope / 2**20:.1f} MiB "
          f"RoPE tables); process RSS grew {rss_quant:.0f} MiB building it (KV cache of {options['cpu']['kv_cache_gb']} GB "
          f"allocated, untouched pages not resident)"
          + (f"; llama.cpp's model grew it {rss_llama:.0f} MiB" if not args.no_llama else ""))

    if args.quality:  # against float32 compute over the same weights (the file dequantized): the issue's target
        text_ids = tokenizer.encode(DATA.read_text())
        got = quant.logprobs(text_ids)
        reference = NanoplugEngine(gguf, "float32", quantization=None, **options)
        r = compare_logprobs(reference.logprobs(text_ids), got, text_ids)
        reference.llm.close()
        print(f"\nquality on {DATA.name} ({len(text_ids)} tokens), activations {acts}: mean KL(float32 compute || "
              f"nanoplug) {r['kl_mean']:.3g} nats (max {r['kl_max']:.3g}), perplexity {r['ppl_ref']:.4f} vs "
              f"{r['ppl_got']:.4f} ({100 * (r['ppl_got'] / r['ppl_ref'] - 1):+.3f}%), top-1 agreement {100 * r['top1']:.1f}%")
    if args.quality and not args.no_llama:
        engines = [e for e in engines if e.label != "llama.cpp"]
        gc.collect()
        ref = LlamaCpp(gguf, args.threads, logits_all=True, n_ctx=4096,
                       extra_bufts=not args.no_extra_bufts).logprobs(text_ids)
        r = compare_logprobs(ref, got, text_ids)
        print(f"\nquality on {DATA.name} ({len(text_ids)} tokens): mean KL(llama.cpp || nanoplug) {r['kl_mean']:.5f} "
              f"nats (max {r['kl_max']:.4f}), perplexity llama.cpp {r['ppl_ref']:.4f} vs nanoplug {r['ppl_got']:.4f} "
              f"({100 * (r['ppl_got'] / r['ppl_ref'] - 1):+.2f}%), top-1 agreement {100 * r['top1']:.1f}%")

    if args.batch:
        sys.path.insert(0, str(Path(__file__).parent))
        from cpu_smollm2 import make_prompts, measure

        dense = NanoplugEngine(folder, "nanoplug float32 (dequantized checkpoint)", **options)
        prompts = make_prompts(tokenizer, args.batch)
        result = measure([quant, dense], prompts, args.new_tokens, args.repeats)
        print(f"\n| {args.batch} prompts | decode tok/s | end-to-end tok/s | vs float32 (decode) | greedy tokens equal to float32's |")
        print("|---|---:|---:|---:|---:|")
        ref = result[dense.label]["decode_tps"]
        for engine in (quant, dense):
            r = result[engine.label]
            print(f"| {engine.label} | {r['decode_tps']:.1f} | {r['total_tps']:.1f} | {r['decode_tps'] / ref:.2f}x | "
                  f"{100 * r['match']:.1f}% |")


    if args.batch and args.base_tree:
        base_figures(args, folder, result[quant.label])


def base_figures(args, folder: str, quant: dict) -> None:
    """The base commit's float32 engine on cpu_smollm2.py's workload (its own script, its own tree), and the
    GGUF engine's figures of this run against it."""
    tree = Path(args.base_tree).resolve()
    cmd = [sys.executable, str(tree / "benchmarks" / "cpu_smollm2.py"), "--model", folder, "--batch", str(args.batch),
           "--repeats", str(args.repeats), "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    row = next(line for line in out.splitlines() if line.startswith(f"| {args.batch} | nanoplug"))
    decode, total = (float(x) for x in row.split("|")[3:5])
    base = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or tree.name
    print(f"\n| {args.batch} prompts, same run | decode tok/s | end-to-end tok/s |\n|---|---:|---:|")
    print(f"| nanoplug float32 at {base} (its cpu_smollm2.py) | {decode:.1f} | {total:.1f} |")
    print(f"| nanoplug, the GGUF's blocks | {quant['decode_tps']:.1f} ({quant['decode_tps'] / decode:.2f}x) | "
          f"{quant['total_tps']:.1f} ({quant['total_tps'] / total:.2f}x) |")


if __name__ == "__main__":
    main()
