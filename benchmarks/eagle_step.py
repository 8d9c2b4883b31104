"""The cost of one proposal step of the `eagle` speculator (an EAGLE-3 head, random weights), so that its speed-up at a
given acceptance can be computed: ms per draft token at batch 1 and 64.

Per batch size B it times, on the device and dtype given, what eagle adds to a speculative step of k drafts:
- catch-up: the head over the k + 1 verification rows of each sequence (the engine's `observe`: fc, one decoder
  layer, its K/V written into its paged cache, the first draft from the last accepted row);
- propose: the k - 1 further draft steps (one row per sequence each, attending to the cache and the drafts so far),
  and the one copy of the drafts to the host.
"ms/draft" is (catch-up + propose) / k: the time per draft position of the whole batch (each gives B draft tokens).
With the target's step time T(B, rows) and acceptance a, the speed-up follows (vLLM's model):
tokens per step = (1 - a^(k+1)) / (1 - a), step = T(B, B(k+1)) + k * ms/draft.

The head is the target's shape with one layer (as the speculators package trains them): `--shape default` is the
embedded default model's (SmolLM2-135M: hidden 576, 9 heads over 3, MLP 1536, vocabulary 49152), `--shape llama8b`
Llama-3.1-8B's (4096, 32 over 8, 14336, 128256; draft vocabulary 32000), the head people ship for it. Its files are
written in the speculators format (config.json, model.safetensors) and loaded by the plugin itself.

    python benchmarks/eagle_step.py                                       # CPU, the default model's shape, float32
    python benchmarks/eagle_step.py --device cuda --dtype bfloat16 --shape llama8b
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

SHAPES = {  # hidden, heads, kv heads, head dim, MLP, vocabulary, draft vocabulary, target layers, rope theta
    "default": (576, 9, 3, 64, 1536, 49152, 49152, 30, 100000.0),
    "llama8b": (4096, 32, 8, 128, 14336, 128256, 32000, 32, 500000.0),
    "tiny": (64, 4, 2, 16, 128, 1000, 500, 8, 10000.0),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16, float16")
    p.add_argument("--shape", default="default", choices=sorted(SHAPES))
    p.add_argument("--batches", default="1,64")
    p.add_argument("--k", type=int, default=4, help="drafts per step")
    p.add_argument("--context", type=int, default=512, help="tokens each sequence has (the head attends to them)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    return p.parse_args()


def write_head(folder: Path, shape: str, seed: int = 0) -> None:
    """A random EAGLE-3 head as the speculators package writes one (config.json, model.safetensors)."""
    from safetensors.torch import save_file

    hidden, heads, kv_heads, head_dim, mlp, vocab, draft_vocab, layers, theta = SHAPES[shape]
    ids = [2, layers // 2, layers - 3]
    layer = dict(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp,
                 num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, num_hidden_layers=1,
                 rms_norm_eps=1e-5, hidden_act="silu", rope_parameters={"rope_type": "default", "rope_theta": theta})
    config = dict(architectures=["Eagle3DraftModel"], speculators_model_type="eagle3", draft_vocab_size=draft_vocab,
                  eagle_aux_hidden_state_layer_ids=ids, norm_before_residual=False, transformer_layer_config=layer,
                  speculators_config=dict(algorithm="eagle3", default_proposal_method="greedy",
                                          proposal_methods=[dict(proposal_type="greedy", speculative_tokens=3)],
                                          verifier=dict(name_or_path=None, architectures=["LlamaForCausalLM"])))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape_):
        return torch.randn(*shape_, generator=gen) * 0.02

    p = "layers.0."
    tensors = {
        "fc.weight": rand(hidden, 3 * hidden), "norm.weight": torch.ones(hidden),
        "lm_head.weight": rand(draft_vocab, hidden),
        "embed_tokens.weight": rand(vocab, hidden), p + "hidden_norm.weight": torch.ones(hidden),
        p + "input_layernorm.weight": torch.ones(hidden), p + "post_attention_layernorm.weight": torch.ones(hidden),
        p + "self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        p + "mlp.gate_proj.weight": rand(mlp, hidden), p + "mlp.up_proj.weight": rand(mlp, hidden),
        p + "mlp.down_proj.weight": rand(hidden, mlp),
    }
    if draft_vocab != vocab:
        targets = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
        tensors["d2t"] = targets - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[targets] = True
        tensors["t2d"] = t2d
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))


def measure(folder: Path, args, batch: int) -> dict:
    from nanoplug.api import HiddenStateSource, HiddenStep, SpeculatorSpec
    from nanoplug.plugins.speculators.eagle import EagleSpeculator

    hidden, *_, vocab, _, layers, _ = SHAPES[args.shape]
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    bs, k, ctx = args.block_size, args.k, args.context
    per_seq = -(-(ctx + k + 2) // bs)
    source = HiddenStateSource(device, dtype, layers, hidden, vocab, bs, batch * per_seq + 1, ctx + k + 8,
                               embed=lambda ids: None)
    eagle = EagleSpeculator(SpeculatorSpec(k, {"model": str(folder)}, None, SimpleNamespace(num_layers=layers),
                                           lambda ids: source))
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    start = ctx - 1  # the verification rows: the last token at ctx - 1, then k drafts
    rows = k + 1
    positions = torch.arange(start, start + rows, device=device).repeat(batch)
    slots = torch.tensor([t[p // bs] * bs + p % bs for t in tables for p in range(start, start + rows)], device=device)
    step = HiddenStep(torch.randn(batch * rows, 3 * hidden, device=device, dtype=dtype), positions, slots,
                      [5] * (batch * rows), [(i, start, i * rows, rows, 1) for i in range(batch)], tables)
    ids, lengths = list(range(batch)), [start + 2] * batch  # one row accepted: each proposes from position `start`

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    catch_up, propose = [], []
    for i in range(args.repeats + 3):
        sync()
        t0 = time.perf_counter()
        eagle.observe(step)
        sync()
        t1 = time.perf_counter()
        drafts = eagle.propose_hidden(ids, lengths, tables, [k] * batch)
        t2 = time.perf_counter()
        assert all(len(d) == k for d in drafts)
        if i >= 3:  # warm-up first
            catch_up.append(t1 - t0)
            propose.append(t2 - t1)
    c, p = statistics.median(catch_up) * 1e3, statistics.median(propose) * 1e3
    return dict(batch=batch, k=k, context=ctx, catch_up_ms=round(c, 3), propose_ms=round(p, 3),
                ms_per_draft=round((c + p) / k, 3), ms_per_draft_token_per_seq=round((c + p) / k / batch, 4))


def main() -> None:
    args = parse_args()
    torch.set_grad_enabled(False)
    print(json.dumps(dict(device=args.device, dtype=args.dtype, shape=args.shape, machine=platform.processor() or
                          platform.machine(), threads=torch.get_num_threads(), torch=torch.__version__)))
    with tempfile.TemporaryDirectory(prefix="nanoplug-eagle-head-") as tmp:
        write_head(Path(tmp), args.shape)
        for b in (int(x) for x in args.batches.split(",")):
            print(json.dumps(measure(Path(tmp), args, b)), flush=True)


if __name__ == "__main__":
    main()
