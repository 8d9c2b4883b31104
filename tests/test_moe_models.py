"""The mixture-of-experts model plugins (Qwen3-MoE, Qwen2-MoE, Mixtral) against transformers, float32, through the
oracle of tests/test_engine_vs_hf.py: logits within 1e-4 at the prefill and every decode step, and greedy tokens
equal to `generate` on batched prompts of mixed lengths, prefix-cache hits, chunked prefill and preemption.
Also: the Triton experts kernel inside the engine (interpreted), the config fields each plugin honours or refuses,
and a checkpoint lacking an expert."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from _checkpoints import checkpoint, hf_greedy, hf_logits, prompt_ids, relative_error, scratch_dir
from _triton_interpreter import interpreted
from nanoplug import LLM, SamplingParams
from nanoplug.api.decoder import DecoderMLP
from nanoplug.api.layers import FusedMoE, SparseMoeBlock
from nanoplug.errors import ModelLoadError, PluginUnavailableError
from test_engine_vs_hf import GREEDY, VARIANTS, cache_prompts, engine, reference, tokens_of

MODELS = ["qwen3_moe", "qwen2_moe", "mixtral"]
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("attention", ["manual", "sdpa"])
def test_logits_and_greedy_tokens_match_transformers(name, attention):
    llm = engine(name, attention=attention)
    assert llm.choices["model"].name == ARCHITECTURES[name]
    params = SamplingParams(temperature=0, max_tokens=6, output_logits=True, ignore_eos=True)
    prompts = prompt_ids(name)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for ids, out in zip(prompts, outputs):
        want = hf_logits(name, ids + out.token_ids[:-1])[len(ids) - 1:]
        got = torch.stack(out.logits)
        assert got.shape == want.shape
        assert relative_error(got, want) < 1e-4, (name, attention, len(ids))
    assert tokens_of(outputs) == [hf_greedy(name, ids, 6) for ids in prompts]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("variant", ["manual", "chunks_of_7", "preemption_chunks_sdpa"])
def test_greedy_equals_transformers(name, variant):
    """Shared prefixes, repeats, block-long prompts, chunked prefill and preemption, twice (the second round
    from the prefix cache)."""
    options = VARIANTS[variant]
    llm = engine(name, **options)
    prompts = cache_prompts(name)
    want = reference(name, GREEDY.max_tokens, "cache")
    assert tokens_of(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens_of(second) == want
    assert sum(o.num_cached_tokens for o in second) > 0
    if "num_kv_blocks" in options:
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.blocks.num_free_blocks == llm.engine.num_kv_blocks


def test_sparse_and_dense_layers_follow_the_config():
    """mlp_only_layers (qwen3_moe: [1]) and decoder_sparse_step (qwen2_moe: 2) as transformers reads them;
    Qwen2-MoE's shared expert is built, the others have none."""
    kinds = {}
    for name in MODELS:
        llm = engine(name)  # held: a dropped LLM closes its engine
        layers = llm.engine.worker.model.model.layers
        kinds[name] = ["moe" if isinstance(layer.mlp, SparseMoeBlock) else "dense" for layer in layers]
        for layer in layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                assert (layer.mlp.shared_expert is not None) == (name == "qwen2_moe")
            else:
                assert isinstance(layer.mlp, DecoderMLP)
    assert kinds == {"qwen3_moe": ["moe", "dense", "moe"], "qwen2_moe": ["dense", "moe"], "mixtral": ["moe", "moe"]}


@pytest.mark.slow
def test_triton_experts_in_the_engine_equal_transformers():
    """The grouped-GEMM kernel (interpreted) as the CUDA platform installs it, serving every MoE layer."""
    from nanoplug.kernels.moe import fused_moe

    name = "mixtral"
    llm = engine(name)
    prompts = prompt_ids(name)[:3]
    with interpreted(fused_moe) as fm:
        moes = [m for m in llm.engine.worker.model.modules() if isinstance(m, FusedMoE)]
        for m in moes:
            m.fused = fm.fused_experts
        try:
            got = tokens_of(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False))
        finally:
            for m in moes:
                m.fused = None
    assert got == [hf_greedy(name, ids, 4) for ids in prompts]


# ------------------------------------------------------------------------------- config fields and refusals
def _variant(name: str, folder: str, **config) -> str:
    """A copy of checkpoint `name` with config.json settings changed (the weights linked, not copied)."""
    import json
    import os

    src = checkpoint(name)
    dst = scratch_dir(folder)
    for f in os.listdir(src):
        if f != "config.json":
            os.symlink(os.path.join(src, f), dst / f)
    cfg = json.loads(open(os.path.join(src, "config.json")).read())
    cfg.update(config)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_a_sliding_window_is_refused_unless_it_spans_the_context():
    path = _variant("mixtral", "mixtral_window", sliding_window=64)
    with pytest.raises(ModelLoadError, match="sliding window of 64 tokens.*max_model_len <= 64"):
        LLM(path, kv_block_size=16, num_kv_blocks=64, max_model_len=256)
    llm = LLM(path, kv_block_size=16, num_kv_blocks=64, max_model_len=64)  # the window changes nothing here
    ids = prompt_ids("mixtral")[:2]
    assert tokens_of(llm.generate(ids, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)) == \
        [hf_greedy("mixtral", p, 4) for p in ids]
    qwen = _variant("qwen3_moe", "qwen3_moe_window", use_sliding_window=True, sliding_window=32)
    with pytest.raises(ModelLoadError, match="sliding window of 32 tokens"):
        LLM(qwen, kv_block_size=16, num_kv_blocks=64, max_model_len=256)


def test_an_activation_other_than_silu_is_refused():
    path = _variant("qwen2_moe", "qwen2_moe_gelu", hidden_act="gelu")
    with pytest.raises(PluginUnavailableError, match="hidden_act='gelu'"):  # refused at start-up, with its reason
        LLM(path, kv_block_size=16, num_kv_blocks=64, max_model_len=256)


def test_a_weight_format_that_does_not_say_how_it_keeps_experts_is_refused():
    from types import SimpleNamespace

    from nanoplug.api import LinearMethod

    class RowsOnly(LinearMethod):  # a format with 2-D layers only, silent about experts
        def apply(self, layer, x, bias):
            raise AssertionError("not called")

    with pytest.raises(ModelLoadError, match="does not apply to mixture-of-experts weights"):
        FusedMoE(SimpleNamespace(world_size=1, rank=0), 4, 64, 32, RowsOnly())


def _fp8_exact(name: str) -> str:
    """A copy of checkpoint `name` whose 2-D weights (but the embedding and LM head) are e4m3 values times a
    power-of-two scale per row, each row holding a +-448: the fp8 format's per-row quantization keeps them exactly,
    so its engine must compute transformers' float32 logits over the same file."""
    import os

    src = checkpoint(name)
    dst = scratch_dir(f"{name}_fp8_exact")
    for f in os.listdir(src):
        if f != "model.safetensors":
            os.symlink(os.path.join(src, f), dst / f)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for key, w in tensors.items():
        if w.dim() == 2 and "embed" not in key and "lm_head" not in key:
            scale = torch.exp2(torch.round(torch.log2(w.abs().amax(dim=1, keepdim=True) / 448)))
            q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
            top = w.abs().argmax(dim=1, keepdim=True)
            q.scatter_(1, top, 448 * torch.sign(w.gather(1, top)))
            tensors[key] = q * scale
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_fp8_experts_split_over_ranks_sum_to_one_process():
    """Each expert is quantized whole, then its rows (gate_up) or columns (down) narrowed: the ranks' partial sums
    add up to one process's output, with one process's scales (gate_up's split by rows, down's whole)."""
    from types import SimpleNamespace

    from nanoplug.plugins.weight_formats.fp8 import FP8LinearMethod

    g = torch.Generator().manual_seed(0)
    e, h, i = 4, 32, 16
    gate, up, down = (torch.randn(e, *shape, generator=g) for shape in ((i, h), (i, h), (h, i)))

    def loaded(world_size, rank):
        moe = FusedMoE(SimpleNamespace(world_size=world_size, rank=rank), e, h, i, FP8LinearMethod())
        for x in range(e):
            moe.gate_up_proj.weight.weight_loader(moe.gate_up_proj.weight, gate[x], (x, 0))
            moe.gate_up_proj.weight.weight_loader(moe.gate_up_proj.weight, up[x], (x, 1))
            moe.down_proj.weight.weight_loader(moe.down_proj.weight, down[x], x)
        return moe

    x = torch.randn(5, h, generator=g)
    weights, ids = torch.rand(5, 2, generator=g), torch.randint(0, e, (5, 2), generator=g)
    one = loaded(1, 0)
    ranks = [loaded(2, r) for r in range(2)]
    assert torch.equal(ranks[0].down_proj.weight_scale, one.down_proj.weight_scale)
    assert torch.equal(torch.cat([r.gate_up_proj.weight_scale[:, :i // 2] for r in ranks], 1),
                       one.gate_up_proj.weight_scale[:, :i])
    total = sum(r.partial(x, weights, ids) for r in ranks)
    assert torch.allclose(total, one.partial(x, weights, ids), atol=1e-5, rtol=1e-5)


def test_fp8_experts_equal_transformers_where_fp8_is_exact():
    """quantization="fp8" on an MoE: every expert quantized per row on load and kept stacked (e4m3 values, float32
    scales), served by the batched CPU path and by the Triton kernels (interpreted), logits equal to transformers'."""
    from transformers import AutoModelForCausalLM

    from nanoplug.kernels.moe import fused_moe

    name = "qwen3_moe"
    path = _fp8_exact(name)
    llm = LLM(path, quantization="fp8", attention="manual", kv_block_size=16, num_kv_blocks=64, max_model_len=256)
    moes = [m for m in llm.engine.worker.model.modules() if isinstance(m, FusedMoE)]
    assert moes and all(m.gate_up_proj.weight.dtype == m.down_proj.weight.dtype == torch.float8_e4m3fn
                        and m.gate_up_proj.weight_scale.dtype == torch.float32 for m in moes)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = prompt_ids(name)[:3]
    params = SamplingParams(temperature=0, max_tokens=4, output_logits=True, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for ids, out in zip(prompts, outputs):
        with torch.no_grad():
            want = hf(torch.tensor([ids + out.token_ids[:-1]])).logits[0, len(ids) - 1:].float()
        assert relative_error(torch.stack(out.logits), want) < 1e-4
    with interpreted(fused_moe) as fm:
        for m in moes:
            m.fused = fm.fused_experts
        try:
            again = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        finally:
            for m in moes:
                m.fused = None
    assert tokens_of(again) == tokens_of(outputs)


def test_experts_kept_in_a_checkpoints_format_are_refused_over_several_ranks():
    """A pre-quantized checkpoint's experts are a layer per expert on one rank; split over ranks they are refused with
    the setting that serves them, never loaded wrong."""
    from types import SimpleNamespace

    from nanoplug.api.layers.moe import FusedMoE
    from nanoplug.plugins.weight_formats.prequantized import PrequantizedLinearMethod

    two_ranks = SimpleNamespace(world_size=2, rank=0)
    with pytest.raises(ModelLoadError, match="one rank only .* use tensor_parallel_size=1"):
        FusedMoE(two_ranks, 4, 64, 32, PrequantizedLinearMethod())


def test_a_missing_expert_is_named():
    import os

    src = checkpoint("mixtral")
    dst = scratch_dir("mixtral_missing_expert")
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            os.symlink(os.path.join(src, f), dst / f)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.block_sparse_moe\.experts\.5\.w3\.weight"):
        LLM(str(dst), kv_block_size=16, num_kv_blocks=64, max_model_len=256)
