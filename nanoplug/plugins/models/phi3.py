"""Model `phi3` (Phi3ForCausalLM). Llama's decoder, with q/k/v and gate/up already fused in the checkpoint."""
from __future__ import annotations

from nanoplug.api.decoder import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    description = "Phi-3: fused qkv_proj and gate_up_proj in the checkpoint, optional sliding window"
    qk_norm = False
    qkv_bias = False
    # the checkpoint's qkv_proj and gate_up_proj load whole into the fused layers (one device: a rank's slice
    # would need rows of every part, which the layers refuse with the fix)
    packed_modules_mapping: dict = {}
    # original_max_position_embeddings is read only by the rope types that scale (longrope is refused)
    honoured_fields = DecoderForCausalLM.honoured_fields | {"original_max_position_embeddings"}
