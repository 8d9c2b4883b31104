"""Penalties and logit bias on the device: the changes to a row's logits before it is sampled.

Semantics are vLLM's (and so OpenAI's and transformers'), in vLLM's order: the logit bias is added,
then the repetition penalty divides positive and multiplies negative logits of every token seen in
the prompt or the output (transformers' RepetitionPenaltyLogitsProcessor), then the frequency
penalty is subtracted once per time a token was generated and the presence penalty once if it was
(OpenAI's formula; over generated tokens only).

The token counts these need live on the device, one row per *slot*: each penalized sequence holds a
slot from its first sampled token until it finishes (preemption keeps it). A slot is filled once from
the sequence's tokens (`SlotInit`), then every step adds its sampled tokens on the device, so nothing
is rebuilt from host lists per step and nothing waits for the device. The scheduler hands out slots
(`nanoplug.engine.penalties.PenaltySlots`); the sampler's `LogitsProcessors` owns the tensors. A batch whose rows ask for none
of this carries no `LogitsProcessingBatch` and the sampler never enters this module.
"""
from __future__ import annotations

import torch

from nanoplug.api import LogitsProcessingBatch, SlotInit, to_device


# ------------------------------------------------------------------------------------- the math
def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, values: torch.Tensor) -> None:
    """logits[rows[i], token_ids[i]] += values[i], in place."""
    logits.index_put_((rows, token_ids), values.to(logits.dtype), accumulate=True)


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """Penalized logits of rows [B, V], given each row's output token counts [B, V], prompt-token mask
    [B, V] and its three penalties [B]. Neutral values (0, 0, 1) leave a row as it was."""
    generated = counts > 0
    seen = generated | prompt_mask
    rep = repetition.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * generated


# ------------------------------------------------------------------------------ device state
class LogitsProcessors:
    """Applies a step's penalties and biases, and keeps the per-slot token counts on the device.

    counts[slot, token]: times the slot's sequence generated `token`; prompt_mask[slot, token]:
    whether its prompt holds `token`. Both grow (doubling) when a slot past their size appears."""

    def __init__(self, device: torch.device):
        self.device = device
        self.counts: torch.Tensor | None = None  # int32 [slots, vocab]
        self.prompt_mask: torch.Tensor | None = None  # bool [slots, vocab]
        self._penalized: tuple[torch.Tensor, torch.Tensor] | None = None  # this step's (rows, slots) on the device

    def _ensure(self, num_slots: int, vocab: int) -> None:
        have = 0 if self.counts is None else self.counts.shape[0]
        if num_slots <= have:
            return
        size = max(num_slots, 2 * have, 8)
        counts = torch.zeros(size, vocab, dtype=torch.int32, device=self.device)
        mask = torch.zeros(size, vocab, dtype=torch.bool, device=self.device)
        if have:
            counts[:have], mask[:have] = self.counts, self.prompt_mask
        self.counts, self.prompt_mask = counts, mask

    def _init_slots(self, inits: list[SlotInit]) -> None:
        dev = self.device
        slots = to_device([i.slot for i in inits], torch.int64, dev)
        self.counts.index_fill_(0, slots, 0)
        self.prompt_mask.index_fill_(0, slots, False)
        prompt_rows = [i.slot for i in inits for _ in i.prompt_token_ids]
        prompt_ids = [t for i in inits for t in i.prompt_token_ids]
        if prompt_ids:
            self.prompt_mask.index_put_((to_device(prompt_rows, torch.int64, dev), to_device(prompt_ids, torch.int64, dev)),
                                        torch.ones((), dtype=torch.bool, device=dev))
        out_rows = [i.slot for i in inits for _ in i.output_token_ids]
        out_ids = [t for i in inits for t in i.output_token_ids]
        if out_ids:
            self.counts.index_put_((to_device(out_rows, torch.int64, dev), to_device(out_ids, torch.int64, dev)),
                                   torch.ones((), dtype=torch.int32, device=dev), accumulate=True)

    def apply(self, logits: torch.Tensor, batch: LogitsProcessingBatch) -> torch.Tensor:
        """The processed logits as a new float32 tensor (the raw ones stay for logprobs and output_logits)."""
        dev = logits.device
        out = logits.to(torch.float32, copy=True)
        if batch.inits or batch.rows:
            self._ensure(1 + max([i.slot for i in batch.inits] + batch.slots), logits.shape[1])
        if batch.inits:
            self._init_slots(batch.inits)
        if batch.bias_rows:
            apply_logit_bias(out, to_device(batch.bias_rows, torch.int64, dev), to_device(batch.bias_token_ids, torch.int64, dev),
                             to_device(batch.bias_values, torch.float32, dev))
        self._penalized = None
        if batch.rows:
            rows = to_device(batch.rows, torch.int64, dev)
            slots = to_device(batch.slots, torch.int64, dev)
            self._penalized = rows, slots
            penalties = to_device([batch.presence, batch.frequency, batch.repetition], torch.float32, dev)
            penalized = apply_penalties(out.index_select(0, rows), self.counts.index_select(0, slots),
                                        self.prompt_mask.index_select(0, slots), *penalties)
            out.index_copy_(0, rows, penalized)
        return out

    def record(self, tokens: torch.Tensor, batch: LogitsProcessingBatch) -> None:
        """Count the tokens just sampled for the rows `apply` penalized (on the device: no wait for them)."""
        if not batch.rows:
            return
        rows, slots = self._penalized
        self.counts.index_put_((slots, tokens.index_select(0, rows).long()),
                               torch.ones((), dtype=torch.int32, device=tokens.device), accumulate=True)

    def slot_state(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(counts, prompt mask) of one slot, for tests and debugging."""
        return self.counts[slot], self.prompt_mask[slot]
