"""PEFT LoRA folders written by PEFT itself on the tiny random checkpoints (shared by the LoRA and server tests)."""
from __future__ import annotations

from functools import lru_cache

import torch

from _checkpoints import checkpoint, scratch_dir
from nanoplug.bench.checkpoints import write_random_checkpoint

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@lru_cache(maxsize=None)
def base(arch: str) -> str:
    if arch == "qwen3":
        return checkpoint("qwen3")
    return str(write_random_checkpoint(scratch_dir("lora-llama"), "LlamaForCausalLM", seed=5, tie_word_embeddings=False))


@lru_cache(maxsize=None)
def hf_base(arch: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base(arch), dtype=torch.float32)


@lru_cache(maxsize=None)
def peft_lora(arch: str, seed: int, r: int = 8, alpha: int = 16, rslora: bool = False) -> str:
    """A PEFT LoRA on all seven projections, saved by PEFT itself, with random non-zero B."""
    import copy

    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(hf_base(arch)),
                           LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=ALL_SEVEN))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # A too, so two adapters of the same seed-free init still differ
                p.copy_(torch.randn(p.shape, generator=generator) * (0.1 if "lora_B" in name else 0.2))
    folder = scratch_dir(f"lora-{arch}-{seed}-{r}-{alpha}-{rslora}")
    model.save_pretrained(str(folder))
    return str(folder)
