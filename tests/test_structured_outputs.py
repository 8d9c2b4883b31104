"""Structured outputs through the engine, on the embedded default model (SmolLM2-135M, its real tokenizer):
each constraint kind ends with "stop" in text that the constraint accepts; a batch mixes constrained and free
requests; a bad constraint is a RequestError before anything is queued; overlapped steps (the mask filled while
the forward runs, `Worker.sample`) give the tokens of plain steps; n > 1, seeds, stop strings, logprobs,
preemption and chunked prefill keep working; both backends give the same tokens at temperature 0; and the
sampler's mask equals the plain masked_fill it stands for."""
from __future__ import annotations

import json
import re
import sys

import jsonschema
import numpy as np
import pytest
import torch

from _engine_checks import assert_idle
from _triton_interpreter import interpreted
from nanoplug import LLM, SamplingParams
from nanoplug.api import SamplingBatch, bitmask_words, unpack_bitmask
from nanoplug.api.structured import _unpack_by_shifts
from nanoplug.errors import RequestError
from nanoplug.worker.sampler import Sampler

# no recorded decode steps: recording one per batch size is most of a start-up here, and the sampler (where the
# mask applies) runs outside them either way
OPTIONS = dict(num_kv_blocks=48, kv_block_size=64, max_model_len=1024, max_num_seqs=16, cpu={"graphs": False})
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def chat(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def model_dir():
    from nanoplug.checkpoint.default_model import default_model_path

    return str(default_model_path(progress=True))


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir, **OPTIONS, overlap_steps=False) as engine:
        yield engine


@pytest.fixture(scope="module")
def overlapped(model_dir):
    """Overlapped steps, the masks filled on the mask thread (the default where steps overlap)."""
    with LLM(model_dir, **OPTIONS, overlap_steps=True) as engine:
        assert engine.engine.overlap and engine.engine.defers_sampling and engine.engine.masks_beside
        yield engine


def constrained(max_tokens: int = 48, temperature: float = 0.0, **constraint) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, structured_outputs=constraint)


CASES = [
    (chat("Describe a person as JSON."), dict(json=PERSON), lambda t: jsonschema.validate(json.loads(t), PERSON)),
    (chat("Give me any JSON object."), dict(json_object=True), lambda t: isinstance(json.loads(t), dict) or 1 / 0),
    ("Phone number:", dict(regex=r"\(\d{3}\) \d{3}-\d{4}"), lambda t: re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", t) or 1 / 0),
    (chat("Is the sky blue?"), dict(choice=["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe") or 1 / 0),
    (chat("Count to three."), dict(grammar='root ::= "one" ", " "two" ", " ("three" | "3")'),
     lambda t: t in ("one, two, three", "one, two, 3") or 1 / 0),
    (chat("Pick a colour."), dict(grammar='start: COLOUR "!"\nCOLOUR: "red" | "green" | "blue"'),
     lambda t: re.fullmatch(r"(red|green|blue)!", t) or 1 / 0),
]


def test_each_kind_of_constraint_ends_with_stop_in_a_mixed_batch(llm):
    free = SamplingParams(temperature=0, max_tokens=12)
    prompts = [p for p, _, _ in CASES] + ["The capital of France is"]
    outs = llm.generate(prompts, [constrained(**c) for _, c, _ in CASES] + [free], use_tqdm=False)
    for (_, constraint, check), out in zip(CASES, outs):
        o = out.outputs[0]
        assert o.finish_reason == "stop", (constraint, o.text)
        check(o.text)
    # (the free row's own tokens depend on the batch here: the GGUF model's CPU kernels are not batch-invariant;
    # that masks leave unmasked rows alone is the sampler test's at the end)
    assert outs[-1].outputs[0].finish_reason == "length" and outs[-1].outputs[0].text.startswith(" Paris")
    assert_idle(llm)


def test_overlapped_steps_give_the_tokens_of_plain_steps(llm, overlapped):
    prompts = [p for p, _, _ in CASES[:4]] + ["Once upon a time"]
    params = [constrained(**c) for _, c, _ in CASES[:4]] + [SamplingParams(temperature=0, max_tokens=16)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in overlapped.generate(prompts, params, use_tqdm=False)] == want
    assert_idle(overlapped)
    structured = overlapped.engine.structured
    assert structured.pool is not None and structured.job is None  # filled on the mask thread, each fill taken
    overlapped.engine.masks_beside = False  # NANOPLUG_MASKS_BESIDE=0: filled in line, before the step is sampled
    try:
        assert [o.outputs[0].token_ids for o in overlapped.generate(prompts, params, use_tqdm=False)] == want
    finally:
        overlapped.engine.masks_beside = True


def test_a_fill_that_fails_on_the_mask_thread_fails_the_step(model_dir):
    def broken():
        raise RuntimeError("the grammar library failed")

    interval = sys.getswitchinterval()
    with LLM(model_dir, **OPTIONS, overlap_steps=True) as engine:
        structured = engine.engine.structured
        structured._backend().mask_filler = lambda matchers, bitmask, rows: broken  # the thread's part fails
        with pytest.raises(RuntimeError, match="grammar library failed"):
            engine.generate([chat("Describe a person as JSON.")] * 4, constrained(json_object=True), use_tqdm=False)
        assert structured.pool is not None and structured.job is None  # (4 rows: filled on the mask thread)
    assert sys.getswitchinterval() == interval  # the mask thread's shorter interval is given back


@pytest.mark.parametrize("bad, named", [(dict(regex="(unclosed"), "regex"),
                                        (dict(grammar='root ::= "a" | undefined_rule'), "grammar"),
                                        (dict(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
                                         "json")])
def test_a_bad_constraint_is_a_request_error_before_anything_is_queued(llm, bad, named):
    with pytest.raises(RequestError, match=f"prompt 1: xgrammar cannot compile this {named}") as info:
        llm.generate(["Hi", "Hello"], [SamplingParams(max_tokens=4), constrained(**bad)], use_tqdm=False)
    assert str(info.value).count("\n") == 0
    assert not llm.engine.has_unfinished()


def test_a_constraint_in_sampling_params_is_checked_when_built():
    with pytest.raises(ValueError, match="exactly one of json, json_object, regex, choice, grammar, structural_tag; found regex, choice"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})
    with pytest.raises(ValueError, match="json is not a JSON schema"):
        SamplingParams(structured_outputs={"json": "{not json"})


def test_n_samples_with_seeds_each_follow_the_grammar_and_repeat(overlapped):
    params = constrained(max_tokens=60, temperature=1.0, json=PERSON).model_copy(update={"n": 3, "seed": 5})
    first = overlapped.generate([chat("Describe a person as JSON.")], params, use_tqdm=False)[0]
    again = overlapped.generate([chat("Describe a person as JSON.")], params, use_tqdm=False)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    for o in first.outputs:
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), PERSON)
        else:  # a sampled name may run to max_tokens; what there is is a prefix the grammar allows
            assert o.finish_reason == "length" and o.text.startswith('{"name": "')
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1


def test_stop_strings_and_logprobs_work_under_a_grammar(llm):
    params = constrained(json=PERSON).model_copy(update={"stop": ['"age"'], "logprobs": 2})
    o = llm.generate([chat("Describe a person as JSON.")], params, use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "stop" and o.text.startswith('{"name": "') and '"age"' not in o.text
    assert len(o.logprobs) == len(o.token_ids) and all(len(lp.top) == 2 for lp in o.logprobs)


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_and_chunked_prefill_keep_the_grammar(model_dir, overlap):
    """A cache too small for all four and prefill chunks of 16 tokens: preempted sequences are recomputed with
    their grammar state kept, and every output still validates."""
    prompts = [chat(f"Describe person number {i} as JSON, with a long name.") for i in range(4)]
    params = constrained(max_tokens=40, json=PERSON)
    with LLM(model_dir, **dict(OPTIONS, num_kv_blocks=4, kv_block_size=32, max_model_len=96, max_num_seqs=4,
                               max_num_batched_tokens=16, overlap_steps=overlap)) as tight:
        outs = tight.generate(prompts, params, use_tqdm=False)
        assert tight.engine.scheduler.num_preemptions > 0
        assert_idle(tight)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)


def test_stream_and_chat_take_a_constraint(llm):
    params = constrained(max_tokens=30, choice=["yes", "no"])
    text = "".join(d.text for d in llm.stream(chat("Is water wet?"), params))
    assert text in ("yes", "no")
    out = llm.chat([{"role": "user", "content": "Describe a person as JSON."}], constrained(json=PERSON))[0]
    jsonschema.validate(json.loads(out.outputs[0].text), PERSON)


def test_both_backends_give_the_same_output_at_temperature_0(model_dir, llm):
    """The same text from both; the same tokens except where llguidance keeps to the canonical tokenization
    (it allows '{"' but not '{' then '"', where xgrammar allows both and the model prefers '{')."""
    prompts = [p for p, _, _ in CASES]
    params = [constrained(**c) for _, c, _ in CASES]
    assert llm.engine.structured.name == "xgrammar"
    want = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(model_dir, **OPTIONS, structured_output="llguidance") as other:
        assert other.engine.structured.name == "llguidance"
        got = [o.outputs[0] for o in other.generate(prompts, params, use_tqdm=False)]
    assert [(o.text, o.finish_reason) for o in got] == [(o.text, o.finish_reason) for o in want]
    assert [o.token_ids for o in got[2:]] == [o.token_ids for o in want[2:]]  # no '{"' in these


def _masking_case(width: int):
    """Logits [4, width], a bitmask over the first 100 ids for rows 1 and 3, and the masked logits wanted (ids past
    100, padding of the logits, are never allowed)."""
    torch.manual_seed(0)
    vocab, rows = 100, 4
    logits = torch.randn(rows, width)
    allowed = torch.rand(2, vocab) < 0.3
    bits = np.packbits(allowed.numpy(), axis=1, bitorder="little")
    bitmask = np.zeros((2, bitmask_words(vocab) * 4), dtype=np.uint8)
    bitmask[:, :bits.shape[1]] = bits
    bitmask = bitmask.view(np.int32)
    assert torch.equal(unpack_bitmask(torch.from_numpy(bitmask), vocab), allowed)  # numpy's unpacking here
    assert torch.equal(_unpack_by_shifts(torch.from_numpy(bitmask))[:, :vocab], allowed)  # a device's
    wider = unpack_bitmask(torch.from_numpy(bitmask), 200)  # ids past the words: never allowed
    assert torch.equal(wider[:, :vocab], allowed) and not wider[:, vocab:].any()
    allowed = torch.nn.functional.pad(allowed, (0, width - vocab), value=False)
    want = logits.clone()
    want[1] = want[1].masked_fill(~allowed[0], float("-inf"))
    want[3] = want[3].masked_fill(~allowed[1], float("-inf"))
    return logits, bitmask, allowed, want


def test_a_steps_bitmask_is_one_of_two_buffers_used_in_turn():
    """The engine writes each step's masks into one of two buffers (pinned on CUDA), in turn: a buffer is written
    again only two steps later, once the copy that read it has run; a bigger step gets a bigger buffer."""
    from nanoplug.engine.structured import StructuredOutputs

    so = StructuredOutputs(None, "no backend", None, 100, {0})
    a, b, c = so._bitmask(3), so._bitmask(20), so._bitmask(2)
    assert [m.shape for m in (a, b, c)] == [(3, 4), (20, 4), (2, 4)] and a.dtype == np.int32
    assert np.shares_memory(a, c) and not np.shares_memory(a, b)
    assert np.shares_memory(b, so._bitmask(20)) and c.flags.c_contiguous


@pytest.fixture(scope="module")
def bitmask_kernel():
    import nanoplug.kernels.cuda.bitmask as module

    with interpreted(module) as reloaded:
        yield reloaded.apply_bitmask


@pytest.mark.parametrize("fused", ["unpacked", "fused-kernel", "cpu-tables"])
def test_the_samplers_mask_is_masked_fill_of_the_unpacked_bits(fused, request):
    """The plain path (unpack, masked_fill), the CUDA platform's one-kernel masker (under the Triton interpreter)
    and the CPU's byte tables give the same logits, on some rows or every row, with logits wider than the
    bitmask."""
    from nanoplug.kernels.cpu import sampling

    masker = {"unpacked": None, "cpu-tables": sampling.mask}.get(fused) or (
        request.getfixturevalue("bitmask_kernel") if fused == "fused-kernel" else None)
    sampler = Sampler(torch.device("cpu"), masker=masker)
    for width in (100, 140):
        logits, bitmask, allowed, want = _masking_case(width)
        batch = SamplingBatch.greedy(4)
        batch.mask_rows, batch.bitmask = [1, 3], bitmask
        before = logits.clone()
        assert torch.equal(sampler.masked(logits, batch), want)
        assert torch.equal(logits, before)
        tokens = sampler(logits, batch)
        assert tokens.tolist() == want.argmax(dim=-1).tolist() and allowed[0, tokens[1]] and allowed[1, tokens[3]]
        every = SamplingBatch.greedy(2)  # every row under a grammar: the one-pass path
        every.mask_rows, every.bitmask = [0, 1], bitmask
        assert torch.equal(sampler.masked(logits[1::2], every), want[1::2])


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_steps_masks_filled_at_once_equal_the_masks_filled_row_by_row(llm, backend):
    """The backends' batch fill (several threads) against their one-row fill, on matchers in different states,
    written to rows out of order."""
    from nanoplug.api import Constraint
    from nanoplug.plugins.structured_output.llguidance import LLGuidanceBackend
    from nanoplug.plugins.structured_output.xgrammar import XGrammarBackend

    so = llm.engine.structured
    cls = {"xgrammar": XGrammarBackend, "llguidance": LLGuidanceBackend}[backend]
    b = cls(so.tokenizer, so.vocab_size, sorted(so.stop_token_ids))
    kinds = [("json", json.dumps(PERSON)), ("json_object", ""), ("regex", r"\(\d{3}\) \d{3}-\d{4}"),
             ("grammar", 'root ::= "one" ", " "two" ", " ("three" | "3")'), ("choice", json.dumps(["yes", "no"]))]
    matchers = []
    for i, (kind, text) in enumerate(kinds * 2):  # ten matchers, the i-th advanced by i tokens
        m = b.matcher(b.compile(Constraint(kind, text)))
        for _ in range(i):
            row = np.zeros((1, so.words), dtype=np.int32)
            m.fill_mask(row, 0)
            allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
            if m.terminated or not len(allowed):
                break
            assert m.accept(int(allowed[len(allowed) // 2]))
        matchers.append(m)
    matchers = [m for m in matchers if not m.terminated]  # (the engine writes an ended grammar's row itself)
    rows = list(range(len(matchers)))[::-1]
    want = np.zeros((len(matchers) + 1, so.words), dtype=np.int32)
    for m, row in zip(matchers, rows):
        m.fill_mask(want, row)
    got = np.zeros_like(want)
    b.fill_masks(matchers, got, rows)
    assert np.array_equal(got, want)
    later = np.zeros_like(want)  # the two halves the mask thread's fill is made of: made here, run later
    fill = b.mask_filler(matchers, later, rows)
    fill()
    assert np.array_equal(later, want)


def test_the_next_masks_are_begun_once_the_grammars_advanced_before_the_outputs(overlapped, monkeypatch):
    """The step loop's order (EngineCore._apply's `then`): a step's tokens advance their grammars, the next step's
    fill begins on the mask thread, and only then are the tokens handed out (stop checks, text)."""
    core, events = overlapped.engine, []
    accept, begin, finish_reason = core.structured.accept_many, core.structured.begin, core.outputs.finish_reason
    monkeypatch.setattr(core.structured, "accept_many",
                        lambda seqs, tokens: events.extend(["accept"] * len(seqs)) or accept(seqs, tokens))
    monkeypatch.setattr(core.structured, "begin", lambda seqs: events.append("begin") or begin(seqs))
    monkeypatch.setattr(core.outputs, "finish_reason",
                        lambda state, token: events.append("out") or finish_reason(state, token))
    overlapped.generate([chat("Give me any JSON object.")] * 4, constrained(json_object=True, max_tokens=6),
                        use_tqdm=False)
    steps = "".join({"accept": "a", "begin": "b", "out": "o"}[e] for e in events)
    assert re.fullmatch(r"b(aaaaboooo)+aaaaoooo", steps), steps  # (the prompts' step begins the first fill)


def test_an_ended_grammars_row_runs_ahead_all_allowed_and_no_ended_matcher_is_filled(overlapped, monkeypatch):
    """Overlapped, a sequence whose grammar ended at step N is still a row of step N+1 (launched before N was
    collected): the engine writes that row all-allowed itself and hands the backend live matchers only."""
    so = overlapped.engine.structured
    backend, filler, rows_of_ended, given = so._backend(), so._filler, [], []
    mask_filler = backend.mask_filler

    def checked_filler(seqs):
        bitmask, fill = filler(seqs)
        rows_of_ended.extend(bool((bitmask[row] == -1).all()) for row, seq in enumerate(seqs) if seq.grammar_ended)
        return bitmask, fill

    def checked_mask_filler(matchers, bitmask, rows):
        given.append(len(matchers))
        assert not any(m.terminated for m in matchers)
        return mask_filler(matchers, bitmask, rows)

    monkeypatch.setattr(so, "_filler", checked_filler)
    monkeypatch.setattr(backend, "mask_filler", checked_mask_filler)
    prompts = [chat("Is the sky blue?")] * 3 + [chat("Describe a person as JSON.")] * 3
    params = [constrained(choice=["yes", "no"])] * 3 + [constrained(json=PERSON)] * 3
    outs = overlapped.generate(prompts, params, use_tqdm=False)
    answer = outs[0].outputs[0].text
    assert [o.outputs[0].text for o in outs[:3]] == [answer] * 3 and answer in ("yes", "no")
    for o in outs[3:]:
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
    assert rows_of_ended and all(rows_of_ended) and max(given) >= 4, (rows_of_ended, given)
    assert_idle(overlapped)


def test_the_wait_for_the_masks_comes_after_the_next_steps_inputs_are_planned(overlapped, monkeypatch):
    """Overlapped: the worker is handed the wait for the masks (`StructuredOutputs.end`) and makes it once the next
    step's inputs are planned on the host, before that step's device work; the last step's, at its collect."""
    from nanoplug.worker import runner

    core, events = overlapped.engine, []
    end, plan, to_device, collect = core.structured.end, runner.plan_inputs, core.worker._to_device, core.worker.collect
    monkeypatch.setattr(core.structured, "end", lambda: events.append("e") or end())
    monkeypatch.setattr(runner, "plan_inputs", lambda *a, **k: events.append("p") or plan(*a, **k))
    monkeypatch.setattr(core.worker, "_to_device", lambda *a: events.append("d") or to_device(*a))
    monkeypatch.setattr(core.worker, "collect", lambda: events.append("c") or collect())
    outs = overlapped.generate([chat("Give me any JSON object.")] * 4, constrained(json_object=True, max_tokens=6),
                               use_tqdm=False)
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outs)
    steps = "".join(events)
    assert re.fullmatch(r"pd(pedc)+ce", steps), steps  # (the last step's wait inside its collect)
    assert_idle(overlapped)


def test_a_step_run_to_its_end_fills_its_masks_beside_its_forward(llm, monkeypatch):
    """Without overlapped steps (a CPU's), a constrained step's masks are begun on the mask thread before its forward
    is launched (on a CPU the forward runs inside the launch) and the step is sampled under them after it."""
    core, events = llm.engine, []
    worker, structured = core.worker, core.structured
    begin, launch, sample = structured.begin, worker.launch, worker.sample
    monkeypatch.setattr(structured, "begin", lambda seqs: events.append("b") or begin(seqs))
    monkeypatch.setattr(worker, "launch", lambda step: events.append("l") or launch(step))
    monkeypatch.setattr(worker, "sample", lambda bitmask: events.append("s") or sample(bitmask))
    out = llm.generate([chat("Is the sky blue?")], constrained(choice=["yes", "no"]), use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert re.fullmatch(r"(bls)+", "".join(events)), events
    assert_idle(llm)
