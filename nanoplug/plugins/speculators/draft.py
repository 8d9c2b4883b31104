"""Speculator `draft`: a smaller checkpoint with the target's tokenizer proposes the drafts, greedily.

The engine runs it (`SpeculatorSpec.load_draft_model`): its own model plugin and KV cache on the target's
device, with prefix caching, so each step's proposals recompute only the tokens past the draft's cached
blocks. Drafting with the target checkpoint itself keeps every draft: a correctness bound on the verifier.
"""
from __future__ import annotations

from nanoplug.api import Speculator, SpeculatorSpec


class DraftSpeculator(Speculator):
    description = "a smaller checkpoint with the same tokenizer drafts greedily (its own model and KV cache)"
    priority = 5
    options = frozenset({"model", "num_kv_blocks", "attention"})

    def __init__(self, spec: SpeculatorSpec):
        super().__init__(spec)
        if "model" not in spec.options:
            raise ValueError("speculator 'draft' needs the draft checkpoint: speculator_options={'model': DIR} "
                             "(a checkpoint with the target's tokenizer)")
        if spec.load_draft_model is None:
            raise ValueError("speculator 'draft' needs an engine that loads draft checkpoints")
        rest = {k: v for k, v in spec.options.items() if k != "model"}
        self.model = spec.load_draft_model(str(spec.options["model"]), rest)

    def propose(self, token_ids: list[list[int]], num_drafts: list[int]) -> list[list[int]]:
        return self.model.greedy(token_ids, num_drafts)
