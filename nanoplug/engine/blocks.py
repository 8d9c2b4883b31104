"""Paged KV blocks with prefix caching by chained block hashes and reference counts.

A full block is registered under the hash of (previous block's hash, its token ids) only once its
K/V are computed, so a later prompt with the same prefix reuses it. Freed blocks keep their hash and
data until they are handed out again, so a prefix stays reusable while memory allows.

When every layer of the model attends over a sliding window (Mistral), a sequence gives back each block
that the window of its next query has passed (`release_passed`): its table entry then names the scratch
block past those handed out (api/step.py), which the attention masks, so a long sequence holds about one
window of blocks. A released block keeps its hash like any freed one, so prefixes stay reusable.
"""
from __future__ import annotations

from collections import deque

import xxhash
import numpy as np

from nanoplug.engine.sequence import Sequence


def chain_root(seq: Sequence) -> int:
    """The hash a sequence's first block chains from: per adapter, since K/V differ under each one."""
    return -1 - seq.adapter_id - (seq.adapter_load << 16)


def block_hash(prev: int, token_ids: list[int]) -> int:
    h = xxhash.xxh64(prev.to_bytes(8, "little", signed=True))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest() & ((1 << 63) - 1)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None):
        self.block_size = block_size
        self.num_blocks = num_blocks
        # the sliding window every layer attends over (None: some layer sees every token, no block is released)
        self.window = window
        self.released = num_blocks  # what a released block's table entry names: the scratch block
        self.num_released: dict[int, int] = {}  # seq_id -> its leading blocks released
        self.prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.hashes = [-1] * num_blocks
        self.tokens: list[list[int] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_ids: deque[int] = deque(range(num_blocks))
        # a block's memory is cleared the first time it is handed out (see take_new_blocks)
        self.never_used = bytearray(b"\x01") * num_blocks
        self.new_blocks: list[int] = []
        self.copies: list[tuple[int, int]] = []  # (from, to): KV blocks to copy after the next step's forward

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ------------------------------------------------------------------------------ prefixes
    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Committed blocks that hold this sequence's leading full blocks.

        The block holding the last token is never reused: its logits must be computed, so at least
        one token of every prompt runs through the model (right on 100% hits).
        """
        if not self.prefix_caching or self._owes_prompt_logprobs(seq):
            return []
        hits, prev, bs = [], chain_root(seq), self.block_size
        for i in range((len(seq) - 1) // bs):
            ids = seq.token_ids[i * bs:(i + 1) * bs]
            h = block_hash(prev, ids)
            block = self.hash_to_block.get(h)
            if block is None or self.tokens[block] != ids:
                break
            hits.append(block)
            prev = h
        return hits

    @staticmethod
    def _owes_prompt_logprobs(seq: Sequence) -> bool:
        """Prompt logprobs need the logits of every prompt position: such a prompt is computed, not reused (vLLM's rule)."""
        return seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._prefix_hits(seq)
        reclaimed = sum(1 for b in hits if self.ref_counts[b] == 0)
        return self.blocks_needed(len(seq)) - len(hits) + reclaimed <= len(self.free_ids)

    def allocate(self, seq: Sequence) -> int:
        """Give `seq` blocks for all its tokens, reusing cached prefix blocks; returns the tokens those
        hits hold (their K/V are computed already: the scheduler counts them)."""
        assert not seq.block_table
        hits = self._prefix_hits(seq)
        for b in hits:
            if self.ref_counts[b] == 0:
                self.free_ids.remove(b)
            self.ref_counts[b] += 1
        seq.block_table = list(hits)
        seq.block_hashes = [self.hashes[b] for b in hits]
        for _ in range(self.blocks_needed(len(seq)) - len(hits)):
            seq.block_table.append(self._take_free())
        seq.num_cached_tokens = len(hits) * self.block_size  # the hits it had, reported with its output
        return seq.num_cached_tokens

    def _take_free(self) -> int:
        b = self.free_ids.popleft()
        if self.hashes[b] != -1:
            if self.hash_to_block.get(self.hashes[b]) == b:
                del self.hash_to_block[self.hashes[b]]
            self.hashes[b], self.tokens[b] = -1, None
        self.ref_counts[b] = 1
        if self.never_used[b]:
            self.never_used[b] = 0
            self.new_blocks.append(b)
        return b

    def take_new_blocks(self) -> list[int]:
        """Blocks handed out for the first time since the last call: the runner clears them before use.

        A fresh CPU cache is uninitialized memory, and backends that read a whole padded block (sdpa)
        would turn NaN garbage past a sequence's end into NaN outputs (0 * NaN). Clearing each block
        once, when first used, costs nothing per step and commits no memory the run never touches."""
        new, self.new_blocks = self.new_blocks, []
        return new

    def take_copies(self) -> list[tuple[int, int]]:
        """Block copies that forks asked for since the last call (they go with the step being built)."""
        copies, self.copies = self.copies, []
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Give another sample of `parent`'s prompt the prompt's blocks, before the step that computes the
        prompt's last token: the full blocks are shared (one more reference each); the block holding the
        last token, when not full, is copied into a new block after that step, since each sample writes
        its own tokens there. False (nothing changed) when no block is free for the copy."""
        bs, n = self.block_size, parent.num_prompt_tokens
        full = n // bs
        partial = n % bs != 0
        if partial and not self.free_ids:
            return False
        assert not child.block_table and len(parent.block_table) == self.blocks_needed(n)
        child.block_table = parent.block_table[:full]
        for b in child.block_table:
            if b != self.released:
                self.ref_counts[b] += 1
        if parent.seq_id in self.num_released:
            self.num_released[child.seq_id] = min(self.num_released[parent.seq_id], full)
        if partial:
            copy = self._take_free()
            self.copies.append((parent.block_table[full], copy))
            child.block_table.append(copy)
        child.block_hashes = parent.block_hashes[:full]
        child.num_cached_tokens = parent.num_cached_tokens
        return True

    def free(self, seq: Sequence) -> None:
        for b in reversed(seq.block_table):
            if b != self.released:
                self._unref(b)
        seq.block_table, seq.block_hashes = [], []
        self.num_released.pop(seq.seq_id, None)

    def _unref(self, b: int) -> None:
        self.ref_counts[b] -= 1
        if self.ref_counts[b] == 0:
            self.free_ids.append(b)

    def release_passed(self, seq: Sequence) -> None:
        """Give back the leading blocks no query of `seq` from now on can see: its next query sits at position
        num_computed_tokens and sees keys from (that - window + 1) on. With prefix caching, only blocks already
        registered (commit), so they stay reusable by later prompts."""
        if self.window is None or not seq.block_table:
            return
        passed = max(0, seq.num_computed_tokens - self.window + 1) // self.block_size
        if self.prefix_caching:
            passed = min(passed, len(seq.block_hashes))
        first = self.num_released.get(seq.seq_id, 0)
        for i in range(first, passed):
            b, seq.block_table[i] = seq.block_table[i], self.released
            if b != self.released:
                self._unref(b)
        if passed > first:
            self.num_released[seq.seq_id] = passed

    def num_held(self, seq: Sequence) -> int:
        """Blocks `seq` holds now (its released ones not counted)."""
        return len(seq.block_table) - self.num_released.get(seq.seq_id, 0)

    # -------------------------------------------------------------------------------- decode
    def can_append(self, seq: Sequence) -> bool:
        return len(self.free_ids) >= self.blocks_needed(len(seq)) - len(seq.block_table)

    def append_slots(self, seq: Sequence) -> None:
        """Make room for every token of `seq` (the newest one included)."""
        while len(seq.block_table) < self.blocks_needed(len(seq)):
            seq.block_table.append(self._take_free())

    def reserve_lookahead(self, seq: Sequence, num_tokens: int) -> int:
        """Slots for up to `num_tokens` tokens past the sequence's end (a speculative step's drafts), as far
        as free blocks allow; returns how many it has room for."""
        need = self.blocks_needed(len(seq) + num_tokens)
        while len(seq.block_table) < need and self.free_ids:
            seq.block_table.append(self._take_free())
        return min(num_tokens, len(seq.block_table) * self.block_size - len(seq))

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past the sequence's tokens (lookahead slots of rejected drafts; never committed)."""
        need = self.blocks_needed(len(seq))
        while len(seq.block_table) > need:
            self._unref(seq.block_table.pop())

    def commit(self, seq: Sequence) -> None:
        """Register the blocks whose K/V are now all computed, so later prompts can reuse them."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens, seq.num_known_tokens) // bs
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            ids = seq.token_ids[i * bs:(i + 1) * bs]
            h = block_hash(seq.block_hashes[-1] if seq.block_hashes else chain_root(seq), ids)
            b = seq.block_table[i]
            if b != self.released and self.hashes[b] == -1:
                self.hashes[b], self.tokens[b] = h, ids
                self.hash_to_block.setdefault(h, b)
            seq.block_hashes.append(h)
