"""What a plugin is judged against: the checkpoint's facts and the narrow `Target` of one engine.

A plugin sees only what it needs to say whether it can serve (device, dtype, head sizes, block
size, parallel size, the cache's dtype), never the engine's whole config: that keeps what a plugin
may depend on small, and the config free to change.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class ModelFacts:
    """What a plugin may need to know about the checkpoint to say whether it can serve it (read once)."""

    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    intermediate_size: int | None = None
    max_position_embeddings: int | None = None
    # per layer: how many keys (itself included) a query attends to, None for full attention
    sliding_windows: tuple[int | None, ...] = ()
    # attention logit soft-capping (Gemma-2): every score s becomes tanh(s / cap) * cap before the softmax; None: off
    attn_softcap: float | None = None
    # the Hugging Face config itself, for model plugins that judge its fields (api/config_fields.py)
    config: Any = field(default=None, compare=False, hash=False, repr=False)

    @property
    def has_sliding_window(self) -> bool:
        return any(w is not None for w in self.sliding_windows)

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> "ModelFacts":
        """The numbers plugins judge a checkpoint by, read off a Hugging Face config."""
        heads = hf_config.num_attention_heads
        return cls(
            architecture=(getattr(hf_config, "architectures", None) or ["?"])[0],
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
            hidden_size=hf_config.hidden_size,
            vocab_size=hf_config.vocab_size,
            intermediate_size=getattr(hf_config, "intermediate_size", None),
            max_position_embeddings=getattr(hf_config, "max_position_embeddings", None),
            sliding_windows=sliding_windows(hf_config),
            attn_softcap=getattr(hf_config, "attn_logit_softcapping", None) or None,
            config=hf_config,
        )


def sliding_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Each layer's window as transformers reads the config: `sliding_window` (Qwen2's and Qwen3's only with
    `use_sliding_window`, which their configs fold in) on the layers `layer_types` marks "sliding_attention"
    (Qwen2's from `max_window_layers` on, Gemma's interleaved), on every layer where a config has no
    `layer_types` (Mistral, Phi-3). A query at position i sees keys j with i - window < j <= i."""
    layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    if window is not None and getattr(hf_config, "use_sliding_window", True) is False:
        window = None  # a config class that keeps the field although the switch is off
    if not window:
        return (None,) * layers
    types = getattr(hf_config, "layer_types", None)
    if types is None:
        return (int(window),) * layers
    if len(types) != layers:
        raise ValueError(f"layer_types names {len(types)} layers, the model has {layers}")
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not attention this engine runs (sliding_attention, full_attention)")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


@dataclass(frozen=True)
class Target:
    """One engine as a plugin's `unavailable(target)` sees it.

    `model` is None when plugins are listed without a checkpoint (`nanoplug plugins`): judge only
    what is known. `kv_cache_dtype` is what K/V are stored as (the chosen KV-cache store decides;
    None: the model's dtype)."""

    device: torch.device
    dtype: torch.dtype
    model: ModelFacts | None = None
    block_size: int = 256
    tensor_parallel_size: int = 1
    kv_cache_dtype: torch.dtype | None = None
    # the most query rows one sequence brings to a decode step: 1, or 1 + k drafts to verify with a speculator
    decode_query_len: int = 1

    @property
    def cache_dtype(self) -> torch.dtype:
        """What K/V are stored as."""
        return self.kv_cache_dtype or self.dtype
