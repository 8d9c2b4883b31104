"""KV memory a sliding-window model's sequence holds at 32k tokens, relative to full attention on every layer.

The engine's own scheduler and block manager with a fake step (no model, no device): a 32,000-token prompt
prefilled in chunks of 8,192, then decoded to 32,768 tokens; the layer pages the sequence holds at the end
(blocks held times the layers' pages a block holds: every layer's for one window kind, `num_slots` under KV
groups, engine/hybrid_blocks.py), over the pages full attention on every layer would hold. A page is one layer's
K/V of one block, the same bytes on every layer, so the ratio of pages is the ratio of bytes. Also the peak:
a prompt is admitted with blocks for all its tokens in every group (the windowed groups give theirs back as its
chunks pass), so under KV groups the admission takes groups x num_slots pages per block of prompt.

    python benchmarks/kv_windows.py
"""
from __future__ import annotations

from nanoplug.config import EngineConfig, SamplingParams
from nanoplug.api.step import kv_groups
from nanoplug.engine.hybrid_blocks import block_manager_for
from nanoplug.engine.scheduler import Scheduler
from nanoplug.engine.sequence import Sequence

BLOCK, PROMPT, TOTAL = 16, 32_000, 32_768
SHAPES = {  # layers, and each one's window (None: global), as the configs of transformers read them
    "Mistral-7B (32 layers, window 4096)": [4096] * 32,
    "Gemma-3-27B (62 layers: 5 local of window 1024, then 1 global)": [None if i % 6 == 5 else 1024 for i in range(62)],
    "Gemma-2-9B (42 layers: local of window 4096 and global in turn)": [4096 if i % 2 == 0 else None for i in range(42)],
}


def held_blocks(windows: list[int | None]) -> tuple[int, int, int]:
    """(layer pages held at TOTAL tokens, the most held on the way, layer pages of full attention on every layer)."""
    groups = kv_groups(tuple(windows), len(windows))
    pages_per_block = groups.num_slots
    num_blocks = (TOTAL // BLOCK + 8) * len(groups.windows)  # room to admit the prompt in every group
    config = EngineConfig(model="unused", kv_block_size=BLOCK, max_num_batched_tokens=8192, max_num_seqs=1,
                          max_model_len=TOTAL + BLOCK)
    sched = Scheduler(config, block_manager_for(num_blocks, BLOCK, True, tuple(windows), len(windows)))
    seq = Sequence(list(range(PROMPT)), SamplingParams(temperature=0, max_tokens=TOTAL - PROMPT, ignore_eos=True))
    sched.add(seq)
    peak = 0
    while len(seq) < TOTAL:
        batch, _ = sched.schedule()
        sampled = [item.seq for item in batch if item.samples]
        sched.advance(batch)
        for s in sampled:
            sched.append_token(s, 1)
        sched.commit(batch)
        peak = max(peak, sched.blocks.num_held(seq))
    sched.schedule()  # the next step's releases
    held = sched.blocks.num_held(seq) * pages_per_block
    full = -(-TOTAL // BLOCK) * len(windows)
    return held, peak * pages_per_block, full


if __name__ == "__main__":
    for name, windows in SHAPES.items():
        held, peak, full = held_blocks(windows)
        print(f"{name}: {held} of {full} layer pages held at {TOTAL} tokens, {held / full:.3f}x of full attention "
              f"(peak {peak / full:.3f}x, at admission)")
