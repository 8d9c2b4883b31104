"""The MoE router in one launch (nanoplug/kernels/moe/routing.py) against `route` (softmax, topk, sum, divide), on
the Qwen3-30B-A3B shape's router (128 experts, top 8, renormalised, bf16 scores):

(a) the router alone at 1, 64 and 256 tokens, each call in a CUDA graph (us a call), the experts checked equal;
(b) with `--folder` (written first if missing: the random 30B-A3B shape cut to `--layers` layers), batch-1 decode
    ms/token after a 512-token prompt, the engine with the kernel and with `route`, alternately, `--rounds` each.

    python3 benchmarks/studies/gpu_moe_router.py [--folder /tmp/moe-router-8l --layers 8]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _cuda_timing import graph_us  # noqa: E402


def router_alone() -> None:
    from nanoplug.api.layers import route
    from nanoplug.kernels.moe import routing

    dev = torch.device("cuda")
    print("| tokens | route (softmax, topk, sum, divide) us | one launch us | the same experts (ties aside) |")
    print("| ---: | ---: | ---: | --- |")
    for t in (1, 64, 256):
        logits = torch.randn(t, 128, device=dev).to(torch.bfloat16)
        plain = graph_us(lambda: route(logits, 8, True))
        fused = graph_us(lambda: routing.route(logits, 8, True))
        (w0, i0), (w1, i1) = route(logits, 8, True), routing.route(logits, 8, True)
        probs = torch.softmax(logits.float(), dim=-1)  # tied experts may come in either order
        same = bool(torch.equal(probs.gather(1, i0), probs.gather(1, i1))) and float((w0 - w1).abs().max()) < 1e-6
        print(f"| {t} | {plain:.2f} | {fused:.2f} | {same} |", flush=True)


def decode_ab(folder: Path, layers: int, rounds: int) -> None:
    from nanoplug import LLM, SamplingParams
    from nanoplug.api import layers as api_layers
    from nanoplug.bench.checkpoints import QWEN3_30B_A3B_SHAPE, write_large_random_checkpoint
    from nanoplug.bench.latency import FreshPrompts, stream_alone
    from nanoplug.kernels.moe import routing

    write_large_random_checkpoint(folder, "Qwen3MoeForCausalLM", dtype=torch.bfloat16, device="cuda",
                                  **dict(QWEN3_30B_A3B_SHAPE, num_hidden_layers=layers))
    kernel = routing.route
    results: dict[str, list[float]] = {"one launch": [], "route": []}
    for _ in range(rounds):
        for name in results:
            routing.route = kernel if name == "one launch" else api_layers.route  # what prepare_model installs
            llm = LLM(str(folder), attention="flash", kv_cache="triton", max_model_len=2048)
            fresh = FreshPrompts(llm.engine.facts.vocab_size)  # the same prompts for each engine
            warm, prompt = fresh.take(2, 512)
            params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=129)
            stream_alone(llm.engine, warm, params, "warm-up")
            arrivals = stream_alone(llm.engine, prompt, params, "decode")
            n = sum(k for _, k in arrivals) - arrivals[0][1]
            results[name].append((arrivals[-1][0] - arrivals[0][0]) * 1000 / n)
            print(f"{name}: {results[name][-1]:.3f} ms/token", flush=True)
            llm.close()
            del llm
            torch.cuda.empty_cache()
    routing.route = kernel
    for name, ms in results.items():
        runs = " / ".join(f"{m:.3f}" for m in ms)
        print(f"| {layers} layers, batch-1 decode, {name} | {min(ms):.3f} ms (runs {runs}) |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--folder", default=None, help="run (b) on this checkpoint (written first if missing)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    print(torch.cuda.get_device_name())
    router_alone()
    if args.folder:
        decode_ab(Path(args.folder), args.layers, args.rounds)


if __name__ == "__main__":
    main()
