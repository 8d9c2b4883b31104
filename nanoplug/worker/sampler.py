"""Turns the last-token logits of each sequence into its next token.

Greedy at temperature 0; otherwise temperature, top-k, top-p and min-p filter the distribution and
one exponential-race draw picks the token, or, where the platform draws with one uniform number a row
(`Platform.inverse_cdf_sampler`: a CPU, whose generator is slow at a vocabulary's noise), the inverse of
the row's cumulative distribution. A request with a seed draws its noise from a generator seeded by
(seed, its token position), so it gets the same tokens whatever else is in the batch. A platform may draw
batches sampled at a temperature alone itself (`Platform.temperature_sampler`, one pass over the logits),
keyed by a seed the sampler gives it every step. On the host, top-p sorts only the largest logits where
they reach p (no device to wait for in that check).

Penalties and logit bias (nanoplug/worker/logits_processors.py) change the logits first, and logprobs
(nanoplug/worker/logprobs.py) are read from the raw logits; a batch with neither takes the plain path. Rows under a
grammar (structured outputs) have the tokens it forbids set to -inf first, from the step's bitmask; a platform may
mask and draw a temperature-only batch under grammars in one pass (`Platform.grammar_sampler`).
"""
from __future__ import annotations

import random

import torch

from nanoplug.api import DraftBatch, LogprobsTensors, SamplingBatch, to_device, unpack_bitmask
from nanoplug.worker import logprobs as logprobs_math
from nanoplug.worker.logits_processors import LogitsProcessors
from nanoplug.worker.rejection import rejection_sample
from nanoplug.worker.seeded import seeded_noise, seeded_uniform


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, greedy=None, temperature=None, masker=None,
                 grammar_draw=None, inverse_cdf=None):
        """greedy: a faster `logits.argmax(dim=-1)` for this device, if there is one (same ties: first max);
        temperature: a faster draw for batches sampled at a temperature alone (Platform.temperature_sampler);
        inverse_cdf: a draw with one uniform number a row (Platform.inverse_cdf_sampler), for the others;
        masker: a faster application of a grammar's bitmask (Platform.grammar_masker); grammar_draw: such a
        batch's draw under its grammars' bitmask in one pass (Platform.grammar_sampler)."""
        self.device = device
        self.masker = masker
        self.grammar_draw = grammar_draw
        self.inverse_cdf = inverse_cdf
        self.greedy = greedy or _argmax
        self.temperature = temperature
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.step_seeds = random.Random(seed)  # the temperature sampler's noise key, one per step
        self.processors = LogitsProcessors(device)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch, drafts: DraftBatch | None = None):
        """The next token of every row. `logits` itself is never changed. With `drafts` (a speculative step):
        (tokens, accepted) from the rejection sampler (nanoplug/worker/rejection.py)."""
        if batch.mask_rows:
            if (self.grammar_draw is not None and drafts is None and batch.processing is None
                    and batch.temperature_only):
                return self._draw_masked(logits, batch)
            logits = self.masked(logits, batch)
        if batch.processing is not None:
            logits = self.processors.apply(logits, batch.processing)
        if drafts is None:
            tokens = out = self._sample(logits, batch)
        else:
            out = rejection_sample(self, logits, batch, drafts)
            tokens = out[0]
        if batch.processing is not None:
            self.processors.record(tokens, batch.processing)
        return out

    def masked(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """A copy of `logits` with the tokens a row's grammar forbids at -inf (structured outputs): the bitmask
        is copied in asynchronously and unpacked on the device, so no host-device sync is added."""
        bitmask = to_device(batch.bitmask, torch.int32, logits.device)
        every_row = len(batch.mask_rows) == logits.shape[0]  # every row under a grammar (rows in order)
        if self.masker is not None:
            rows = None if every_row else to_device(batch.mask_rows, torch.int64, logits.device)
            return self.masker(logits, bitmask, rows)
        allowed = unpack_bitmask(bitmask, logits.shape[1])
        if every_row:  # one pass
            return torch.where(allowed, logits, float("-inf"))
        rows = to_device(batch.mask_rows, torch.int64, logits.device)
        out = logits.clone()
        out.index_copy_(0, rows, torch.where(allowed, out.index_select(0, rows), float("-inf")))
        return out

    def _draw_masked(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """A temperature-only batch under grammars (rows at temperature 0 greedy): masked and drawn in one pass."""
        dev = logits.device
        rows = None
        if len(batch.mask_rows) != logits.shape[0]:  # some rows free: each row's bitmask row, -1 for none
            of = [-1] * logits.shape[0]
            for i, row in enumerate(batch.mask_rows):
                of[row] = i
            rows = to_device(of, torch.int32, dev)
        return self.grammar_draw(logits, to_device(batch.temperatures, torch.float32, dev),
                                 self.step_seeds.getrandbits(31), to_device(batch.bitmask, torch.int32, dev), rows)

    @torch.no_grad()
    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch) -> LogprobsTensors:
        """Raw logprobs of the sampled `tokens` of the rows in `batch.logprob_rows` (call only when there are any)."""
        rows = to_device(batch.logprob_rows, torch.int64, logits.device)
        return logprobs_math.compute(logits.index_select(0, rows), tokens.index_select(0, rows),
                                     max(batch.num_top_logprobs))

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.all_greedy:
            return self.greedy(logits)
        dev = logits.device
        temps = to_device(batch.temperatures, torch.float32, dev)
        if self.temperature is not None and batch.temperature_only:
            sampled = self.temperature(logits, torch.where(temps > 0, temps, 1.0), self.step_seeds.getrandbits(31))
            return self._greedy_where_cold(logits, batch, temps, sampled)
        probs = self.probabilities(logits, batch, temps)
        return self._greedy_where_cold(logits, batch, temps, self.draw(probs, batch))

    def draw(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """One token per row of `probs` (changed in place; rows need not sum to 1), by the platform's inverse-CDF
        draw or an exponential race: seeded rows from their (seed, position) noise, the others from the
        sampler's generator."""
        if self.inverse_cdf is not None:
            uniforms = 1.0 - torch.rand(probs.shape[0], generator=self.generator, device=self.device)  # (0, 1]
            for row, seed in enumerate(batch.seeds):
                if seed is not None:
                    uniforms[row] = 1.0 - seeded_uniform(seed, batch.positions[row])
            return self.inverse_cdf(probs, uniforms.to(probs.device))
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, seed in enumerate(batch.seeds):
            if seed is not None:
                noise[row] = seeded_noise(seed, batch.positions[row], probs.shape[1], probs.device)
        return probs.div_(noise).argmax(dim=-1)

    def _greedy_where_cold(self, logits, batch: SamplingBatch, temps: torch.Tensor, sampled: torch.Tensor):
        """`sampled`, with the greedy token in rows at temperature 0."""
        if any(t == 0.0 for t in batch.temperatures):
            sampled = torch.where(temps == 0, self.greedy(logits), sampled)
        return sampled

    @classmethod
    def probabilities(cls, logits: torch.Tensor, batch: SamplingBatch, temps: torch.Tensor | None = None) -> torch.Tensor:
        """The distribution each row samples from: temperature, then top-k, top-p and min-p filtering.

        min-p keeps tokens with at least min_p times the top token's probability; applying it after
        top-k/top-p gives the same set as before them, since renormalising keeps the ratios."""
        dev = logits.device
        if temps is None:
            temps = to_device(batch.temperatures, torch.float32, dev)
        logits = logits.float() / torch.where(temps > 0, temps, 1.0).unsqueeze(1)
        if any(k > 0 for k in batch.top_ks):
            logits = cls._top_k(logits, batch.top_ks)
        if any(p < 1.0 for p in batch.top_ps):
            logits = cls._top_p(logits, to_device(batch.top_ps, torch.float32, dev))
        probs = torch.softmax(logits, dim=-1)
        if any(p > 0.0 for p in batch.min_ps):
            min_p = to_device(batch.min_ps, torch.float32, dev).unsqueeze(1)
            probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        return probs

    @staticmethod
    def _top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
        vocab = logits.shape[1]
        ks = [k if 0 < k < vocab else 0 for k in top_ks]  # 0: the row keeps every token
        if max(ks) == 0:
            return logits
        # only the largest k is sorted out, not the whole vocabulary, even when some rows keep all
        k = to_device(ks, torch.int64, logits.device).unsqueeze(1)
        kth = logits.topk(max(ks), dim=-1).values.gather(1, (k - 1).clamp(min=0))
        kth = kth.masked_fill(k == 0, float("-inf"))
        return logits.masked_fill(logits < kth, float("-inf"))

    @staticmethod
    def _top_p(logits: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
        if logits.device.type == "cpu":
            kept = _top_p_among_largest(logits, top_ps)
            if kept is not None:
                return kept
        return _top_p_sorted(logits, top_ps)


def _top_p_sorted(logits: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # drop a token when the tokens before it already reach top_p; the first always stays
    drop = (probs.cumsum(dim=-1) - probs) >= top_ps.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _top_p_among_largest(logits: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor | None:
    """`Sampler._top_p` from the k largest logits of each row where they reach every row's top_p (k = 256, then
    2048), else None: on a CPU, sorting the whole vocabulary is most of a filtered row's sampling time. The same
    tokens are kept: those after the k-th are dropped either way, the mass before them reaching p. A row at
    p >= 1 (unfiltered, beside filtered ones) keeps every token."""
    log_total = torch.logsumexp(logits, dim=-1, keepdim=True)
    whole = top_ps >= 1.0
    for k in (256, 2048):
        if k * 4 > logits.shape[1]:
            return None
        values, order = logits.topk(k, dim=-1)
        probs = torch.exp(values - log_total)
        before = probs.cumsum(dim=-1) - probs
        if not bool((whole | (before[:, -1] + probs[:, -1] >= top_ps)).all()):
            continue
        kept = values.masked_fill(before >= top_ps.unsqueeze(1), float("-inf"))
        out = torch.full_like(logits, float("-inf")).scatter_(1, order, kept)
        if bool(whole.any()):
            out[whole] = logits[whole]
        return out
    return None
