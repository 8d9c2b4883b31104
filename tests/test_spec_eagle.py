"""Speculator `eagle`: an EAGLE-3 head in the speculators package's format, written by that package's own classes
(random weights). Greedy output with it is the plain engine's token for token (mixed prompt lengths, prefix hits,
overlapped and adaptive steps); its proposals are the package's own head modules driven as vLLM drafts (the first
draft from the last known row, then each draft fed back with the head's hidden state), over two steps of one
sequence's rows and a batch of two; a head for another target is refused naming the fix; sampling with seeds is
reproducible; the acceptance counters are reported."""
from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace

import pytest
import torch

from _checkpoints import PROMPTS, checkpoint, scratch_dir
from _engine_checks import assert_idle
from nanoplug import LLM, SamplingParams
from nanoplug.api import HiddenStateSource, HiddenStep, SpeculatorSpec
from nanoplug.plugins.speculators.eagle import EagleSpeculator

OPTIONS = dict(kv_block_size=16, attention="sdpa", kv_cache="torch", num_kv_blocks=64, max_model_len=96)
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
TARGET_VOCAB = 151669  # the tiny qwen3 checkpoint's (the Qwen3 tokenizer's)


def write_head(folder, layer_type: str = "llama", hidden: int = 64, vocab: int = TARGET_VOCAB, draft_vocab: int = 997,
               layer_ids=(0, 1, 2), seed: int = 0, constant: int | None = None) -> str:
    """A randomly initialised EAGLE-3 head, saved by the speculators package (config.json and safetensors);
    `constant`: its LM head zero, so that it always drafts draft token 0, mapped to this target token."""
    from transformers import LlamaConfig, Qwen3Config
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    shape = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_attention_heads=4,
                 num_key_value_heads=2, num_hidden_layers=1, head_dim=16, rms_norm_eps=1e-6)
    layer = LlamaConfig(**shape) if layer_type == "llama" else Qwen3Config(**shape)
    layer._attn_implementation = "sdpa"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=draft_vocab, eagle_aux_hidden_state_layer_ids=list(layer_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=checkpoint(), architectures=["Qwen3ForCausalLM"])))
    torch.manual_seed(seed)
    model = Eagle3DraftModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.3 if p.dim() > 1 else 1.0)
        targets = torch.randperm(vocab)[:draft_vocab].sort().values  # the draft vocabulary: target ids
        model.d2t.copy_(targets - torch.arange(draft_vocab))
        if constant is not None:
            model.lm_head.weight.zero_()
            targets[0] = constant
            model.d2t.copy_(targets - torch.arange(draft_vocab))
        model.t2d.zero_()
        model.t2d[targets] = True
    model.save_pretrained(str(folder))
    return str(folder)


@lru_cache(maxsize=None)
def head(layer_type: str = "llama") -> str:
    return write_head(scratch_dir(f"eagle3-{layer_type}"), layer_type)


def eagle_engine(**options) -> LLM:
    return LLM(checkpoint(), speculator="eagle", speculator_options={"model": head("llama")}, num_speculative_tokens=3,
               **{"adaptive_speculation": False, **OPTIONS, **options})


@pytest.fixture(scope="module")
def plain():
    return LLM(checkpoint(), **OPTIONS)


def prompts(plain) -> list[list[int]]:
    ids = [plain.engine.make_request(p).prompt_token_ids for p in PROMPTS]
    return ids + [list(range(300, 341)), [7]]  # mixed lengths: 1 to 41 tokens


@pytest.mark.parametrize("options", [{}, {"overlap_steps": True, "adaptive_speculation": True}, {"num_kv_blocks": 8}],
                         ids=["fixed-k", "overlapped-adaptive", "preempting"])
def test_greedy_equals_plain(plain, options):
    batch = prompts(plain)
    want = plain.generate(batch, GREEDY, use_tqdm=False)
    llm = eagle_engine(**options)
    for _ in range(2):  # the second time from the prefix cache (the head's K/V live in the same blocks)
        got = llm.generate(batch, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    forked = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2)  # samples forked from one prompt
    assert ([o.token_ids for o in llm.generate(batch[1:3], forked, use_tqdm=False)[0].outputs]
            == [o.token_ids for o in plain.generate(batch[1:3], forked, use_tqdm=False)[0].outputs])
    stats = llm.engine.stats()
    assert stats.spec_draft_tokens > 0 and stats.spec_verifications > 0  # drafts proposed, verified and counted
    assert 0 <= stats.spec_accepted_tokens <= stats.spec_draft_tokens
    assert not llm.engine.speculation.speculator.state  # every finished sequence released
    assert (stats.num_preemptions > 0) == (options.get("num_kv_blocks") == 8)  # preempted ones recompute
    assert_idle(llm)


def test_accepted_drafts_keep_the_output(plain):
    """A head that always drafts one token, the one the target repeats in a row after prompt [7]: those drafts are
    accepted (their K/V kept, the head catching up over accepted rows), and the output is still the plain one's."""
    want = plain.generate([[7]], GREEDY, use_tqdm=False)[0].token_ids
    at = next(i for i in range(len(want) - 1) if want[i] == want[i + 1])
    repeated, run = want[at], 1
    while at + run < len(want) and want[at + run] == repeated:
        run += 1
    folder = write_head(scratch_dir("eagle3-constant"), constant=repeated)
    llm = LLM(checkpoint(), speculator="eagle", speculator_options={"model": folder}, num_speculative_tokens=3,
              adaptive_speculation=False, **OPTIONS)
    assert llm.generate([[7]], GREEDY, use_tqdm=False)[0].token_ids == want
    stats = llm.engine.stats()
    # the step whose last token comes before the run drafts it whole: all but the token after the run are kept
    assert stats.spec_accepted_tokens >= run - 1 >= 1 and stats.spec_draft_tokens > stats.spec_accepted_tokens
    assert_idle(llm)


def test_sampling_with_seeds_is_reproducible(plain):
    llm = eagle_engine()
    batch = prompts(plain)
    params = [SamplingParams(temperature=0.8, top_k=50, max_tokens=16, seed=i, ignore_eos=True)
              for i in range(len(batch))]
    first = [o.token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    again = [o.token_ids for o in llm.generate(batch[::-1], params[::-1], use_tqdm=False)][::-1]
    assert first == again and all(len(t) == 16 for t in first)
    assert llm.engine.stats().spec_verifications > 0


def test_a_head_for_another_target_is_refused():
    wide = write_head(scratch_dir("eagle3-wide"), hidden=32)
    with pytest.raises(Exception, match="serve this head with the target it was trained for"):
        LLM(checkpoint(), speculator="eagle", speculator_options={"model": wide}, **OPTIONS)
    deep = write_head(scratch_dir("eagle3-deep"), layer_ids=(2, 16, 29))
    with pytest.raises(Exception, match="eagle_aux_hidden_state_layer_ids"):
        LLM(checkpoint(), speculator="eagle", speculator_options={"model": deep}, **OPTIONS)
    with pytest.raises(Exception, match="speculator_options=\\{'model': DIR\\}"):
        LLM(checkpoint(), speculator="eagle", **OPTIONS)


# ------------------------------------------------------------------ proposals against the package's own head
def reference_drafts(model, hidden: torch.Tensor, next_ids: list[int], k: int) -> list[int]:
    """The speculators package's head modules driven as vLLM drafts: rows 0..n-1 (embedding of the next token,
    fc of the target's hidden states) at positions 0..n-1 in one causal pass, the first draft from the last row,
    then each draft at the next position with the layer's output fed back."""
    from transformers import DynamicCache

    n = hidden.shape[0]
    cache = DynamicCache()
    x = torch.cat([model.embed_tokens(torch.tensor([next_ids])), model.fc(hidden[None])], dim=-1)
    drafts = []
    for step in range(k):
        pos = torch.tensor([[n - 1 + step]]) if step else torch.arange(n)[None]
        out = model.layers[0](x, attention_mask=None, position_ids=pos, past_key_values=cache, use_cache=True,
                              cache_position=pos[0], position_embeddings=model.rotary_emb(x, pos))
        g = out[:, -1:]
        token = int(model.lm_head(model.norm(g)).argmax(-1))
        token += int(model.d2t[token])
        drafts.append(token)
        x = torch.cat([model.embed_tokens(torch.tensor([[token]])), g], dim=-1)
    return drafts


def slots_of(table: list[int], positions: range, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in positions]


@pytest.mark.parametrize("layer_type", ["llama", "qwen3"])
@torch.inference_mode()
def test_proposals_equal_the_speculators_head(layer_type):
    from speculators.models.eagle3.core import Eagle3DraftModel

    folder = head(layer_type)
    model = Eagle3DraftModel.from_pretrained(folder).eval()
    model.layers[0].self_attn.config._attn_implementation = "sdpa"  # (flex attention by default: for training)
    hs, bs, k = 64, 4, 4
    source = HiddenStateSource(torch.device("cpu"), torch.float32, num_layers=2, hidden_size=hs,
                               vocab_size=TARGET_VOCAB,
                               block_size=bs, num_blocks=12, max_model_len=64,
                               embed=lambda ids: pytest.fail("the head has its own embedding"))
    spec = SpeculatorSpec(k, {"model": folder}, None, SimpleNamespace(num_layers=2), lambda ids: source)
    eagle = EagleSpeculator(spec)
    assert eagle.layer_ids == [0, 1, 2]
    gen = torch.Generator().manual_seed(1)
    a_tokens = torch.randint(0, TARGET_VOCAB, (14,), generator=gen).tolist()
    b_tokens = torch.randint(0, TARGET_VOCAB, (7,), generator=gen).tolist()
    a_hidden, b_hidden = torch.randn(13, 3 * hs, generator=gen), torch.randn(6, 3 * hs, generator=gen)
    a_table, b_table = [3, 1, 5, 7], [2, 6]

    def step(rows):  # rows: (seq_id, tokens, hidden, table, start, count, valid)
        hidden, positions, slots, next_ids, groups, tables, first = [], [], [], [], [], [], 0
        for seq_id, tokens, h, table, start, count, valid in rows:
            hidden.append(h[start:start + count])
            positions += range(start, start + count)
            slots += slots_of(table, range(start, start + count), bs)
            next_ids += tokens[start + 1:start + 1 + valid] + [0] * (count - valid)
            groups.append((seq_id, start, first, count, valid))
            tables.append(table)
            first += count
        return HiddenStep(torch.cat(hidden), torch.tensor(positions), torch.tensor(slots), next_ids, groups, tables)

    # a prefill step: 10 rows of A (positions 0..9) and 6 of B (0..5)
    eagle.observe(step([(1, a_tokens, a_hidden, a_table, 0, 10, 10), (2, b_tokens, b_hidden, b_table, 0, 6, 6)]))
    got = eagle.propose_hidden([1, 2], [11, 7], [a_table, b_table], [k, 2])
    assert got == [reference_drafts(model, a_hidden[:10], a_tokens[1:11], k),
                   reference_drafts(model, b_hidden[:6], b_tokens[1:7], 2)]
    # a verification of A: rows at positions 10..12, the last one's draft rejected (its row is not known)
    rejected = a_hidden.clone()
    rejected[12] = 100.0  # whatever the rejected row held must not matter
    eagle.observe(step([(1, a_tokens, rejected, a_table, 10, 3, 2)]))
    want = reference_drafts(model, a_hidden[:12], a_tokens[1:13], k)
    assert eagle.propose_hidden([1], [13], [a_table], [k]) == [want]
    # a sequence whose tokens the head has not all seen proposes nothing; a released one neither
    assert eagle.propose_hidden([1, 2], [14, 7], [a_table, b_table], [k, k])[0] == []
    eagle.release([2])
    assert eagle.propose_hidden([2], [7], [b_table], [k]) == [[]]


@torch.inference_mode()
@pytest.mark.parametrize("blocks", [64, 8], ids=["one-at-a-time-then-cached", "batched-preempting"])
def test_engine_drafts_equal_the_head_over_transformers_hidden_states(plain, blocks):
    """End to end: every proposal the engine's eagle made (from the hidden states its worker kept, the K/V the head
    mirrored into the target's blocks, over prefill, accepted and rejected rows; prefix-cache hits whose rows it never
    saw this time; a batch of mixed lengths where sequences are preempted and recomputed) equals the package's head
    driven over transformers' hidden states of the same tokens (layers 0 and 1: what transformers returns unnormed)."""
    from speculators.models.eagle3.core import Eagle3DraftModel

    from _checkpoints import hf_model

    folder = write_head(scratch_dir(f"eagle3-layers01-{blocks}"), layer_ids=(0, 1), seed=3)
    model = Eagle3DraftModel.from_pretrained(folder).eval()
    model.layers[0].self_attn.config._attn_implementation = "sdpa"
    hf = hf_model("qwen3")
    llm = LLM(checkpoint(), speculator="eagle", speculator_options={"model": folder}, num_speculative_tokens=3,
              adaptive_speculation=False, **{**OPTIONS, "num_kv_blocks": blocks})
    eagle = llm.engine.speculation.speculator
    real, calls = eagle.propose_hidden, []

    def recorded(seq_ids, lengths, tables, num_drafts):
        out = real(seq_ids, lengths, tables, num_drafts)
        running = {s.seq_id: s for s in llm.engine.scheduler.running}
        calls.extend((running[i].token_ids[:n], d) for i, n, d in zip(seq_ids, lengths, out) if d)
        return out

    eagle.propose_hidden = recorded
    batch, cached = prompts(plain)[:4], 0
    if blocks == 64:  # one at a time, then again from the prefix cache: the head reads its K/V in shared blocks
        for prompt in batch + batch:
            cached += llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens
        assert cached >= 16
    else:
        llm.generate(prompts(plain), GREEDY, use_tqdm=False)
        assert llm.engine.stats().num_preemptions > 0
    for tokens, drafts in calls:
        states = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        aux = torch.cat([states[0][0], states[1][0]], dim=-1)
        assert drafts == reference_drafts(model, aux, tokens[1:], len(drafts)), len(tokens)
    assert len(calls) >= 20


def test_the_cache_is_sized_for_the_heads_layer_too():
    """The head's one layer of K/V mirrors the target's blocks: the platform's sizing leaves room for it, so a cache
    sized to the memory allowed still fits with the head's (L target layers: L / (L + 1) of the blocks)."""
    sized = {**OPTIONS, "num_kv_blocks": None, "cpu": {"kv_cache_gb": 0.002}}
    with LLM(checkpoint(), **sized) as alone, eagle_engine(**sized) as drafting:
        layers = alone.engine.facts.num_layers
        want = alone.engine.num_kv_blocks * layers // (layers + 1)
        assert abs(drafting.engine.num_kv_blocks - want) <= 1, (drafting.engine.num_kv_blocks, want)
