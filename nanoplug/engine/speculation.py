"""Speculative decoding on the engine side: the speculator of this engine, how many drafts each step asks for,
which sequences may take them, and the counters `/metrics` reports.

A step speculates only where it pays, as measured (`AdaptiveK`): for each batch size (in powers of two) the
engine keeps the output tokens per second its decode steps reached with each number of drafts k (0: a plain,
overlapped step), and asks for the k that gave the most. Each k is tried a few times first, and the best's
neighbours again now and then, so the choice follows the workload: a compute-bound batch, where a step of
B (k + 1) rows costs about what k + 1 plain steps cost, settles at k = 0, and a prompt whose drafts stop being
accepted turns speculation off. Everything a choice costs is in the figure (the proposer's host time, a
verification's rows, the overlap a speculative step gives up), which a model of acceptance and row costs missed.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from nanoplug.api import HiddenStateSpeculator, HiddenStep, SpeculatorSpec
from nanoplug.config import EngineConfig
from nanoplug.engine.registry import Registry, Resolution
from nanoplug.engine.scheduler import Scheduled, Scheduler
from nanoplug.engine.sequence import PENDING, Status

log = logging.getLogger("nanoplug")


@dataclass
class SpecStats:
    """Counters since start-up: drafts proposed and accepted, and the sequence-steps that verified any."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    verifications: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification gives on average: its accepted drafts plus the target's own token."""
        return 1.0 + self.accepted_tokens / self.verifications if self.verifications else 0.0


class AdaptiveK:
    """The number of drafts a step asks for: the k whose steps gave the most output tokens per second at this
    batch size (see the module)."""

    def __init__(self, k_max: int, decay: float = 0.95, tries: int = 3, explore_every: int = 32, far: float = 0.5):
        self.k_max, self.decay, self.tries, self.explore_every = k_max, decay, tries, explore_every
        self.far = far
        # (batch bucket, k) -> [tokens, seconds], both decayed by `decay` a step of that kind: a rate over the last
        # ~1 / (1 - decay) such steps, each weighed by its time (a mean of per-step rates is led by the lucky
        # steps: whether a step found drafts to verify varies a lot from one to the next)
        self.sums: dict[tuple[int, int], list[float]] = {}
        self.samples: dict[tuple[int, int], int] = {}
        self.steps: dict[int, int] = {}  # batch bucket -> choices made

    @staticmethod
    def bucket(num_seqs: int) -> int:
        return 1 << max(num_seqs - 1, 0).bit_length()

    def observe(self, num_seqs: int, k: int, tokens: int, seconds: float) -> None:
        """A decode step of `num_seqs` sequences asked for `k` drafts each and gave `tokens` in `seconds`."""
        if num_seqs <= 0 or seconds <= 0:
            return
        key = (self.bucket(num_seqs), k)
        sums = self.sums.setdefault(key, [0.0, 0.0])
        sums[0] = self.decay * sums[0] + tokens
        sums[1] = self.decay * sums[1] + seconds
        self.samples[key] = self.samples.get(key, 0) + 1

    def rate(self, num_seqs: int, k: int) -> float:
        """Output tokens per second measured for `k` drafts at this batch size (0 before any)."""
        tokens, seconds = self.sums.get((self.bucket(num_seqs), k), (0.0, 0.0))
        return tokens / seconds if seconds else 0.0

    def choose(self, num_seqs: int) -> int:
        """Drafts per sequence for a step of `num_seqs` decoding sequences (0: do not speculate)."""
        b = self.bucket(num_seqs)
        n = self.steps[b] = self.steps.get(b, 0) + 1
        for k in range(self.k_max, -1, -1):  # each k measured a few times first, the widest first
            if self.samples.get((b, k), 0) < self.tries:
                return k
        best = max(range(self.k_max + 1), key=lambda k: self.rate(num_seqs, k))
        if n % self.explore_every == 0:  # now and then another k again: the workload may have changed
            # in turn the neighbour above, the one below, and plain steps (k = 0, the baseline every choice is
            # judged against, measured afresh even when the best is far from it)
            turn = (n // self.explore_every) % 3
            if best == 0 or (turn == 0 and best < self.k_max):
                other = best + 1
            else:
                other = best - 1 if turn == 1 else 0
            # one that measured far behind (a wide verification of a compute-bound batch) is tried 8x less often
            if (self.rate(num_seqs, other) >= self.far * self.rate(num_seqs, best)
                    or n % (8 * self.explore_every) == 0):
                return other
        return best


class DraftEngine:
    """A draft checkpoint run by an engine core of its own (its model plugin and KV cache) on the target's device
    and dtype: the engine's `load_draft_model` for speculators (nanoplug.api.DraftModel)."""

    def __init__(self, model: str, options: dict, target: EngineConfig, registry: Registry, vocab_size: int):
        from nanoplug.engine.engine_core import EngineCore  # (the engine core builds this module's Speculation)

        unknown = sorted(set(options) - {"num_kv_blocks", "attention"})
        if unknown:
            raise ValueError(f"a draft model takes the options num_kv_blocks and attention, not {', '.join(unknown)}")
        config = EngineConfig(model=model, device=target.device, dtype=target.dtype,
                              attention=options.get("attention", target.attention), max_model_len=target.max_model_len,
                              max_num_seqs=target.max_num_seqs, kv_block_size=16,
                              num_kv_blocks=int(options.get("num_kv_blocks", 2048)), seed=target.seed,
                              skip_tokenizer_init=True, **target.platform_options)
        self.core = EngineCore(config, registry)
        if self.core.facts.vocab_size != vocab_size:
            self.core.close()
            raise ValueError(f"the draft checkpoint {model!r} has a vocabulary of {self.core.facts.vocab_size} tokens, "
                             f"the target {vocab_size}; a draft model must share the target's tokenizer")
        self.requests = 0

    def greedy(self, token_ids: list[list[int]], num_tokens: list[int]) -> list[list[int]]:
        from nanoplug.config import SamplingParams

        core, out, ids = self.core, {}, []
        for tokens, n in zip(token_ids, num_tokens):
            self.requests += 1
            rid = f"draft-{self.requests}"
            ids.append(rid)
            out[rid] = []
            core.add_request(core.make_request(list(tokens), SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                                             rid))
        while core.has_unfinished():
            for update in core.step():
                out[update.request_id] += update.token_ids
        return [out[rid] for rid in ids]


class Speculation:
    """One engine's speculator, its adaptive k and its counters."""

    def __init__(self, resolution: Resolution, config: EngineConfig, load_draft_model=None, worker=None, facts=None):
        self.resolution = resolution
        # a worker in this process can keep its hidden states for a speculator that reads them (EAGLE)
        keep = getattr(worker, "keep_hidden_states", None)
        self.speculator = resolution.cls(SpeculatorSpec(config.num_speculative_tokens, dict(config.speculator_options),
                                                        load_draft_model, facts, keep))
        self.observes = isinstance(self.speculator, HiddenStateSpeculator)  # it is handed every step's rows
        self.worker = worker
        self.max_model_len = config.max_model_len
        self.policy = AdaptiveK(config.num_speculative_tokens)
        self.adaptive = config.adaptive_speculation
        self.stats = SpecStats()

    @staticmethod
    def check(registry: Registry, config: EngineConfig) -> None:
        """Refuse an unknown speculator or an option it does not take before anything is loaded."""
        if config.speculator is None:
            return
        cls = registry.get("speculator", config.speculator)
        unknown = sorted(set(config.speculator_options) - cls.options)
        if unknown:
            raise ValueError(f"speculator {config.speculator!r} takes no option {', '.join(map(repr, unknown))}; "
                             f"its options: {', '.join(sorted(cls.options)) or 'none'}")

    @classmethod
    def resolve(cls, registry: Registry, config: EngineConfig, target, vocab_size: int,
                worker=None) -> "Speculation | None":
        """The engine's speculator, resolved once at start-up (None: no speculation asked for)."""
        if config.speculator is None:
            return None
        def load_draft_model(model: str, options: dict) -> DraftEngine:
            return DraftEngine(model, options, config, registry, vocab_size)

        return cls(registry.resolve("speculator", config.speculator, target), config, load_draft_model, worker,
                   target.model)

    def describe(self) -> str:
        return self.resolution.describe()

    def num_drafts(self, scheduler: Scheduler) -> int:
        """Drafts per sequence the next step asks for: 0 while prompts wait (their step is a prefill) or where
        it does not pay."""
        if scheduler.waiting or not scheduler.running:
            return 0
        return self.policy.choose(len(scheduler.running)) if self.adaptive else self.policy.k_max

    def propose(self, batch: list[Scheduled], scheduler: Scheduler, k: int) -> None:
        """Give each decode item of `batch` that may speculate its drafts (up to k, fewer near its max_tokens or
        max_model_len, or where its lookahead slots find no free block)."""
        items, wanted = [], []
        for item in batch:
            seq, p = item.seq, item.seq.params
            if (item.num_tokens != 1 or not item.samples or item.forks or seq.num_pending or p.penalized
                    or p.structured_outputs is not None):
                continue  # penalties and grammars are applied one token at a time: such a sequence decodes plainly
            room = min(k, p.max_tokens - seq.num_completion_tokens - 1, self.max_model_len - len(seq) - 1)
            if room > 0:
                items.append(item)
                wanted.append(room)
        if not items:
            return
        if self.observes:
            proposals = self.speculator.propose_hidden([it.seq.seq_id for it in items], [len(it.seq) for it in items],
                                                       [it.seq.block_table for it in items], wanted)
        else:
            proposals = self.speculator.propose([it.seq.token_ids for it in items], wanted)
        for item, drafts in zip(items, proposals):
            if drafts:
                scheduler.reserve_drafts(item, list(drafts))

    def counters(self) -> dict[str, int]:
        """The counters as EngineStats names them."""
        s = self.stats
        return dict(spec_draft_tokens=s.draft_tokens, spec_accepted_tokens=s.accepted_tokens,
                    spec_verifications=s.verifications)

    def settled(self, settled: list[tuple[object, int, int]]) -> None:
        """A speculative step's outcome: (sequence, drafts accepted, drafts) per sample."""
        drafted = accepted = verified = 0
        for _, n, k in settled:
            if k:
                drafted, accepted, verified = drafted + k, accepted + n, verified + 1
        self.stats.draft_tokens += drafted
        self.stats.accepted_tokens += accepted
        self.stats.verifications += verified

    def observe(self, launched) -> None:
        """Hand a hidden-state speculator the rows of a step whose tokens were just applied (its hidden states
        stay on the device): per sequence its rows, how many have a known next token, and those tokens. Every row is
        handed, a finished sequence's too (its full blocks may serve later prompts from the prefix cache), and then
        the sequences that ended (at this step, or aborted while it ran) are released."""
        step = launched.step
        if not step.query_lens:
            return
        hidden, positions, slots = self.worker.hidden_states(step)
        next_ids, groups, tables = [], [], []
        entry = row = 0
        for item in launched.batch:
            seq, tokens = item.seq, item.seq.token_ids
            entries = 1 + len(item.drafts)  # a verification: one one-token entry per row
            start = step.starts[entry]
            count = sum(step.query_lens[entry:entry + entries])
            valid = 0
            for p in range(start + 1, start + count + 1):
                token = tokens[p] if p < len(tokens) else PENDING
                if token == PENDING or valid < p - start - 1:
                    next_ids.append(0)
                else:
                    next_ids.append(token)
                    valid += 1
            groups.append((seq.seq_id, start, row, count, valid))
            tables.append(step.block_tables[entry])
            entry, row = entry + entries, row + count
        self.speculator.observe(HiddenStep(hidden[:row], positions[:row], slots[:row], next_ids, groups, tables,
                                           step.block_copies))
        self.release([item.seq.seq_id for item in launched.batch if item.seq.status is Status.FINISHED])

    def release(self, seq_ids: list[int]) -> None:
        if self.observes and seq_ids:
            self.speculator.release(seq_ids)
