"""The token embedding and the LM head, their vocabulary split over the ranks of a process group."""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from nanoplug.api.linear import LinearMethod, check_shape


class VocabParallelEmbedding(nn.Module):
    """Rows of the vocabulary split over ranks; each rank embeds its ids, the all-reduce fills the rest."""

    role: ClassVar[str] = "embedding"

    def __init__(self, group: Any, vocab_size: int, hidden_size: int, linear_method: LinearMethod):
        super().__init__()
        self.group = group
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.per_rank = (vocab_size + group.world_size - 1) // group.world_size
        self.start = group.rank * self.per_rank
        self.linear_method = linear_method
        linear_method.create_weights(self, hidden_size, self.per_rank, torch.get_default_dtype())
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: Any = None) -> None:
        check_shape(tensor, [self.vocab_size, self.hidden_size], "vocab_size x hidden_size of config.json")
        rows = tensor[self.start:self.start + self.per_rank]
        if rows.shape[0] < self.per_rank:  # the last rank's padding rows stay zero
            param.data.zero_()
        self.linear_method.load(self, param, rows, 0, rows.shape[0])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        embed = self.linear_method.embed
        if self.group.world_size == 1:
            return embed(self, ids)
        local = ids - self.start
        mask = (local >= 0) & (local < self.per_rank)
        y = embed(self, local.clamp(0, self.per_rank - 1))
        y = y * mask.unsqueeze(-1).to(y.dtype)
        return self.group.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, vocabulary split over ranks; logits gathered on every rank."""

    role: ClassVar[str] = "lm_head"

    def __init__(self, group: Any, vocab_size: int, hidden_size: int, linear_method: LinearMethod):
        super().__init__(group, vocab_size, hidden_size, linear_method)
        self.bias = None

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (and whatever else its method keeps beside it): tied embeddings."""
        for name, param in list(embedding.named_parameters(recurse=False)):
            setattr(self, name, param)
        for name, buf in list(embedding.named_buffers(recurse=False)):
            self.register_buffer(name, buf, persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits whatever the model's dtype (`LinearMethod.apply_float32`)."""
        logits = self.linear_method.apply_float32(self, hidden)
        if self.group.world_size > 1:
            logits = self.group.all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size]
