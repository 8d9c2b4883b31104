"""Model `gemma2` (Gemma2ForCausalLM). Gemma-3's decoder (gemma3.py) as Gemma-2 has it: no q/k norms, one rope for
every layer, and attention logit soft-capping (tanh(s / cap) * cap of every score), which the attention backend
applies (`AttentionSpec.softcap`; a backend that cannot refuses in its `unavailable`)."""
from __future__ import annotations

from typing import Any

from nanoplug.plugins.models.gemma3 import Gemma3ForCausalLM


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    description = ("Gemma-2: interleaved sliding-window and global layers, attention and final logit soft-capping, "
                   "pre/post norms, GeGLU, scaled embeddings")
    per_type_rope = False
    qk_norm = False
    honoured_fields = (Gemma3ForCausalLM.honoured_fields - {"_sliding_window_pattern", "sliding_window_pattern"}) | {
        "attn_logit_softcapping"}
    fixed_fields: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh", "use_bidirectional_attention": None}
