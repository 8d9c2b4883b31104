"""Paged KV blocks of a model whose layers mix sliding windows and full attention (KV-cache groups).

The layers form groups (`KVGroups`, nanoplug/api/step.py): group 0's table is `seq.block_table`, group g's is
`seq.group_tables[g - 1]`, all drawn from the one pool, all as long as the sequence's blocks (an entry a window
has passed names the scratch block), so the scheduler's checks on `block_table` hold for every group. A group
of window w gives back the blocks its next query no longer sees (`release_passed`), while a full group keeps its
own: Gemma-3's local layers hold a window, its global layers everything.

Prefix caching is per group (a block holds one group's K/V: it is registered under (group, chain hash)), and a
hit is the longest prefix for which each group has what the next query reads: a full group every block of it,
a windowed group only the blocks of its window, as vLLM's sliding-window manager finds them, so a prompt whose
early blocks a window released still hits. The plain `BlockManager` serves every model with one window kind.
"""
from __future__ import annotations

from nanoplug.api.step import KVGroups, kv_groups
from nanoplug.engine.blocks import BlockManager, block_hash, chain_root
from nanoplug.engine.sequence import Sequence


def block_manager_for(num_blocks: int, block_size: int, prefix_caching: bool,
                      sliding_windows: tuple[int | None, ...], num_layers: int) -> BlockManager:
    """The block manager of a model with these per-layer windows: the plain one unless its layers mix windows."""
    groups = kv_groups(sliding_windows, num_layers)
    if groups.hybrid:
        return HybridBlockManager(num_blocks, block_size, prefix_caching, groups)
    return BlockManager(num_blocks, block_size, prefix_caching, groups.windows[0])


class HybridBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, groups: KVGroups):
        super().__init__(num_blocks, block_size, enable_prefix_caching, window=None)
        self.groups = groups
        self.windows = groups.windows
        self.num_released: dict[int, list[int]] = {}  # seq_id -> per group, its leading blocks released

    @staticmethod
    def tables(seq: Sequence) -> list[list[int]]:
        return [seq.block_table, *seq.group_tables]

    def _first_seen(self, num_tokens: int, window: int | None) -> int:
        """The first block a query at position `num_tokens` reads under `window`."""
        return 0 if window is None else max(0, num_tokens - window + 1) // self.block_size

    # ------------------------------------------------------------------------------ prefixes
    def _hits(self, seq: Sequence) -> tuple[list[list[int]], list[int]]:
        """Per group, the blocks of the longest cached prefix each group can serve (the scratch block where a
        window needs none; every group's list has the same length), and that prefix's chain hashes."""
        if not self.prefix_caching or self._owes_prompt_logprobs(seq):
            return [[] for _ in self.windows], []
        bs, prev, chain = self.block_size, chain_root(seq), []
        for i in range((len(seq) - 1) // bs):
            ids = seq.token_ids[i * bs:(i + 1) * bs]
            prev = block_hash(prev, ids)
            chain.append((prev, ids))
        found = []
        for g in range(len(self.windows)):
            row = []
            for h, ids in chain:
                b = self.hash_to_block.get((g, h))
                row.append(b if b is not None and self.tokens[b] == ids else None)
            found.append(row)
        n = len(chain)
        for row, w in zip(found, self.windows):  # a full group: its leading run
            if w is None:
                n = min(n, next((i for i, b in enumerate(row) if b is None), n))
        while n > 0 and not all(None not in row[self._first_seen(n * bs, w):n] for row, w in zip(found, self.windows)):
            n -= 1
        return [[row[i] if i >= self._first_seen(n * bs, w) else self.released for i in range(n)]
                for row, w in zip(found, self.windows)], [h for h, _ in chain[:n]]

    def can_allocate(self, seq: Sequence) -> bool:
        hits, _ = self._hits(seq)
        fresh = (self.blocks_needed(len(seq)) - len(hits[0])) * len(self.windows)
        reclaimed = sum(1 for row in hits for b in row if b != self.released and self.ref_counts[b] == 0)
        return fresh + reclaimed <= len(self.free_ids)

    def allocate(self, seq: Sequence) -> int:
        assert not seq.block_table
        hits, hashes = self._hits(seq)
        n = len(hits[0])
        tables = []
        for row in hits:
            for b in row:
                if b != self.released:
                    if self.ref_counts[b] == 0:
                        self.free_ids.remove(b)
                    self.ref_counts[b] += 1
            tables.append(row + [self._take_free() for _ in range(self.blocks_needed(len(seq)) - n)])
        seq.block_table, seq.group_tables = tables[0], tables[1:]
        seq.block_hashes = hashes
        self.num_released[seq.seq_id] = [self._first_seen(n * self.block_size, w) if n else 0 for w in self.windows]
        seq.num_cached_tokens = n * self.block_size
        return seq.num_cached_tokens

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        bs, n = self.block_size, parent.num_prompt_tokens
        full = n // bs
        partial = n % bs != 0
        if partial and len(self.free_ids) < len(self.windows):
            return False
        tables = []
        for table in self.tables(parent):
            shared = table[:full]
            for b in shared:
                if b != self.released:
                    self.ref_counts[b] += 1
            if partial:
                copy = self._take_free()
                self.copies.append((table[full], copy))
                shared = shared + [copy]
            tables.append(shared)
        child.block_table, child.group_tables = tables[0], tables[1:]
        if parent.seq_id in self.num_released:
            self.num_released[child.seq_id] = [min(r, full) for r in self.num_released[parent.seq_id]]
        child.block_hashes = parent.block_hashes[:full]
        child.num_cached_tokens = parent.num_cached_tokens
        return True

    def free(self, seq: Sequence) -> None:
        for table in self.tables(seq):
            for b in reversed(table):
                if b != self.released:
                    self._unref(b)
        seq.block_table, seq.group_tables, seq.block_hashes = [], [], []
        self.num_released.pop(seq.seq_id, None)

    def release_passed(self, seq: Sequence) -> None:
        """Each windowed group gives back the leading blocks its next query (at num_computed_tokens) does not
        see; with prefix caching only registered ones, so that they stay reusable."""
        if not seq.block_table:
            return
        released = self.num_released.setdefault(seq.seq_id, [0] * len(self.windows))
        for g, (table, w) in enumerate(zip(self.tables(seq), self.windows)):
            if w is None:
                continue
            passed = self._first_seen(seq.num_computed_tokens, w)
            if self.prefix_caching:
                passed = min(passed, len(seq.block_hashes))
            for i in range(released[g], passed):
                b, table[i] = table[i], self.released
                if b != self.released:
                    self._unref(b)
            released[g] = max(released[g], passed)

    def num_held(self, seq: Sequence) -> int:
        """Blocks `seq` holds now over all its groups (each holds `groups.num_slots` layer pages)."""
        released = self.num_released.get(seq.seq_id, [0] * len(self.windows))
        return sum(len(t) for t in self.tables(seq)) - sum(released)

    # -------------------------------------------------------------------------------- decode
    def can_append(self, seq: Sequence) -> bool:
        return len(self.free_ids) >= (self.blocks_needed(len(seq)) - len(seq.block_table)) * len(self.windows)

    def append_slots(self, seq: Sequence) -> None:
        need = self.blocks_needed(len(seq))
        for table in self.tables(seq):
            while len(table) < need:
                table.append(self._take_free())

    def commit(self, seq: Sequence) -> None:
        if not self.prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens, seq.num_known_tokens) // bs
        tables = self.tables(seq)
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            ids = seq.token_ids[i * bs:(i + 1) * bs]
            h = block_hash(seq.block_hashes[-1] if seq.block_hashes else chain_root(seq), ids)
            for g, table in enumerate(tables):
                b = table[i]
                if b != self.released and self.hashes[b] == -1:
                    self.hashes[b], self.tokens[b] = (g, h), ids
                    self.hash_to_block.setdefault((g, h), b)
            seq.block_hashes.append(h)
