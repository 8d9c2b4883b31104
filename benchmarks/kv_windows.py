"""KV memory a sliding-window model's sequence holds at 32k tokens, relative to full attention on every layer.

The engine's own scheduler and block manager with a fake step (no model, no device): a 32,000-token prompt
prefilled in chunks of 8,192, then decoded to 32,768 tokens; the blocks the sequence holds at the end, over
the blocks full attention would hold. KV bytes per block are the same on every layer, so the ratio of
layer-blocks is the ratio of bytes.

    python benchmarks/kv_windows.py
"""
from __future__ import annotations

from nanoplug.config import EngineConfig, SamplingParams
from nanoplug.engine.blocks import BlockManager
from nanoplug.engine.scheduler import Scheduler
from nanoplug.engine.sequence import Sequence

BLOCK, PROMPT, TOTAL = 16, 32_000, 32_768
SHAPES = {  # layers, and each one's window (None: global), as the configs of transformers read them
    "Mistral-7B (32 layers, window 4096)": [4096] * 32,
    "Gemma-3-27B (62 layers: 5 local of window 1024, then 1 global)": [None if i % 6 == 5 else 1024 for i in range(62)],
}


def held_blocks(windows: list[int | None]) -> tuple[int, int]:
    """(layer-blocks held at TOTAL tokens, layer-blocks of full attention on every layer)."""
    num_blocks = TOTAL // BLOCK + 8
    window = max(windows) if None not in windows else None  # what the engine releases by (engine_core.py)
    config = EngineConfig(model="unused", kv_block_size=BLOCK, max_num_batched_tokens=8192, max_num_seqs=1,
                          max_model_len=TOTAL + BLOCK)
    sched = Scheduler(config, BlockManager(num_blocks, BLOCK, True, window))
    seq = Sequence(list(range(PROMPT)), SamplingParams(temperature=0, max_tokens=TOTAL - PROMPT, ignore_eos=True))
    sched.add(seq)
    while len(seq) < TOTAL:
        batch, _ = sched.schedule()
        sampled = [item.seq for item in batch if item.samples]
        sched.advance(batch)
        for s in sampled:
            sched.append_token(s, 1)
        sched.commit(batch)
    sched.schedule()  # the next step's releases
    held = sched.blocks.num_held(seq)
    full = -(-TOTAL // BLOCK)
    return held * len(windows), full * len(windows)


if __name__ == "__main__":
    for name, windows in SHAPES.items():
        held, full = held_blocks(windows)
        print(f"{name}: {held // len(windows)} of {full // len(windows)} blocks per layer held at {TOTAL} tokens, "
              f"{held / full:.3f}x of full attention")
