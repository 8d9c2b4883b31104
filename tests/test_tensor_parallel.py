"""The `tensor` parallel plugin on CPU (gloo): same logits and tokens as one process and as transformers,
errors before any process starts, worker faults surfacing with their traceback in bounded time,
clean shutdown (close, Ctrl-C, a killed caller), two engines at once, and torchrun's ranks."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

import tensor_parallel_helpers as helpers
from _processes import gone
from nanoplug import LLM, EngineConfig
from nanoplug.bench.checkpoints import write_random_checkpoint
from nanoplug.errors import PluginUnavailableError
from nanoplug.api import ModelFacts, Target
from nanoplug.engine.registry import Registry
from nanoplug.plugins.parallel.tensor.pool import WorkerError

HERE = Path(__file__).resolve().parent
DEADLINE_S = 180  # a fault must surface well within this, on a busy 2-core machine
ARCHS = {"qwen3": ("Qwen3ForCausalLM", dict(tie_word_embeddings=True)),
         "llama": ("LlamaForCausalLM", dict(tie_word_embeddings=False, seed=1))}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_checkpoints")
    return {name: str(write_random_checkpoint(root / name, arch, **shape)) for name, (arch, shape) in ARCHS.items()}


@pytest.fixture(scope="module")
def tp_qwen3(ckpt):
    llm = LLM(ckpt["qwen3"], parallel="tensor", tensor_parallel_size=2, **helpers.ENGINE_OPTIONS)
    yield llm
    llm.close()


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max())


def _assert_same_outputs(reference_rounds, rounds, rtol=1e-5):
    for ref_outs, outs in zip(reference_rounds, rounds):
        for ref, out in zip(ref_outs, outs):
            assert out.token_ids == ref.token_ids
            assert len(out.logits) == len(ref.logits) == len(ref.token_ids)
            for a, b in zip(ref.logits, out.logits):
                assert _relative_error(a, b) <= rtol


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture(autouse=True)
def _workers_end_with_their_test():
    """Workers of an engine a test built and never closed (it failed first) are killed when the test ends.

    Engines of module-scoped fixtures are set up before this fixture (wider scopes first), so they live on."""
    before = _children()
    yield
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=10)


# ------------------------------------------------------------------------------ same outputs
def test_qwen3_tp2_matches_one_process_and_transformers(ckpt, tp_qwen3):
    single = LLM(ckpt["qwen3"], parallel="single", **helpers.ENGINE_OPTIONS)
    reference = helpers.generate_twice(single)
    rounds = helpers.generate_twice(tp_qwen3)
    _assert_same_outputs(reference, rounds)
    assert all(o.num_cached_tokens >= 32 for o in rounds[1][:2])  # the second round hit the prefix cache
    assert len(tp_qwen3.tokenizer.encode(helpers.PROMPTS[0])) > helpers.ENGINE_OPTIONS["max_num_batched_tokens"]
    _assert_matches_transformers(ckpt["qwen3"], rounds[0])


def test_the_worker_report_is_rank_0s_through_the_proxy(tp_qwen3):
    """Start-up's phases and the step statistics come back from rank 0 by the worker protocol (WorkerMethod.REPORT)."""
    from nanoplug import SamplingParams

    before = tp_qwen3.engine.worker.report()
    tp_qwen3.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    after = tp_qwen3.engine.worker.report()
    assert after.startup == before.startup and after.startup.total_s > 0
    assert after.graphs_error is None and after.graph_captures == 0  # `manual` decodes eager: by design
    grew = after.stats.eager_decode_steps_by_design - before.stats.eager_decode_steps_by_design
    assert (grew, after.stats.graph_replays, after.stats.eager_decode_steps) == (2, 0, 0)


def test_sampling_features_under_tp2_match_one_process(ckpt, tp_qwen3):
    """logprobs, chunked prompt logprobs (every rank computes the gathered logits), n (the forked block is
    copied on every rank) and penalties with a bias (rank 0's token counts) give one process's results."""
    from nanoplug import SamplingParams

    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1,
                            frequency_penalty=0.7, repetition_penalty=1.2, logit_bias={11: 3.0})
    single = LLM(ckpt["qwen3"], parallel="single", **helpers.ENGINE_OPTIONS)
    want = single.generate(helpers.PROMPTS, params, use_tqdm=False)
    got = tp_qwen3.generate(helpers.PROMPTS, params, use_tqdm=False)
    for a, b in zip(want, got):
        assert len(a.outputs) == len(b.outputs) == 2
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        for x, y in zip(a.outputs, b.outputs):
            assert [lp.top[0][0] for lp in x.logprobs] == [lp.top[0][0] for lp in y.logprobs]
            assert [lp.logprob for lp in x.logprobs] == pytest.approx([lp.logprob for lp in y.logprobs], abs=1e-4)
        assert [lp.logprob for lp in a.prompt_logprobs[1:]] == \
               pytest.approx([lp.logprob for lp in b.prompt_logprobs[1:]], abs=1e-4)


def test_llama_tp2_matches_one_process_and_transformers(ckpt):
    single = LLM(ckpt["llama"], parallel="single", **helpers.ENGINE_OPTIONS)
    reference = helpers.generate_twice(single)
    with LLM(ckpt["llama"], parallel="tensor", tensor_parallel_size=2, **helpers.ENGINE_OPTIONS) as tp:
        rounds = helpers.generate_twice(tp)
        pids = tp.engine.worker.worker_pids
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    assert gone(pids, within=1.0)  # leaving the block closed the engine and waited for its workers
    tp.close()  # a second close is harmless
    _assert_same_outputs(reference, rounds)
    _assert_matches_transformers(ckpt["llama"], rounds[0])


def _assert_matches_transformers(path: str, outputs) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for out in outputs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            greedy = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(out.token_ids),
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            logits = hf(greedy).logits[0, ids.shape[1] - 1:-1]
        assert greedy[0, ids.shape[1]:].tolist() == out.token_ids
        for i, row in enumerate(out.logits):
            assert _relative_error(logits[i], row) <= 1e-4


# --------------------------------------------------------------------------- layer sharding
class _ShardOnly:
    """A group that does no communication, so one process can build every rank's shard in turn."""

    def __init__(self, rank, world_size):
        self.rank, self.world_size, self.local_rank = rank, world_size, rank

    def all_reduce(self, x):
        return x

    def all_gather(self, x, dim=-1):
        return x

    def layers(self):
        from nanoplug.api import Layers

        return Layers(self)


@pytest.mark.parametrize("world_size", [2, 3])
def test_layers_shards_recombine_to_the_full_layer(world_size):
    """Column shards concatenate, row shards and vocabulary shards sum, to the unsharded result."""
    torch.manual_seed(0)
    hidden, head_dim, heads, kv_heads, inter, vocab = 12, 4, 12, 6, 12, 31  # vocab not divisible by 2 or 3
    x, h = torch.randn(5, hidden), torch.randn(5, inter)
    q, k, v = (torch.randn(n * head_dim, hidden) for n in (heads, kv_heads, kv_heads))
    qkv_bias = [torch.randn(n * head_dim) for n in (heads, kv_heads, kv_heads)]
    gate, up = torch.randn(inter, hidden), torch.randn(inter, hidden)
    down, down_bias = torch.randn(hidden, inter), torch.randn(hidden)
    emb = torch.randn(vocab, hidden)
    ids = torch.tensor([0, 5, 30, 17, 11, 29])
    parts = {"q": [], "k": [], "v": [], "gate": [], "up": [], "down": [], "emb": [], "head": []}
    per_rank = inter // world_size
    for rank in range(world_size):
        layers = _ShardOnly(rank, world_size).layers()
        qkv = layers.qkv(hidden, head_dim, heads, kv_heads, bias=True)
        for shard, w, b in zip("qkv", (q, k, v), qkv_bias):
            qkv.weight_loader(qkv.weight, w, shard)
            qkv.weight_loader(qkv.bias, b, shard)
        sizes = [qkv.num_heads * head_dim, qkv.num_kv_heads * head_dim, qkv.num_kv_heads * head_dim]
        for name, y in zip("qkv", qkv(x).split(sizes, dim=-1)):
            parts[name].append(y)
        gate_up = layers.merged_column(hidden, [inter, inter])
        gate_up.weight_loader(gate_up.weight, gate, 0)
        gate_up.weight_loader(gate_up.weight, up, 1)
        g, u = gate_up(x).chunk(2, dim=-1)
        parts["gate"].append(g)
        parts["up"].append(u)
        row = layers.row(inter, hidden, bias=True)
        row.weight_loader(row.weight, down)
        row.weight_loader(row.bias, down_bias)
        parts["down"].append(row(h.narrow(-1, rank * per_rank, per_rank)))
        embedding, head = layers.embedding(vocab, hidden), layers.lm_head(vocab, hidden)
        embedding.weight_loader(embedding.weight, emb)
        head.weight_loader(head.weight, emb)
        parts["emb"].append(embedding(ids))
        parts["head"].append(head(x))
    expected_qkv = {"q": x @ q.T + qkv_bias[0], "k": x @ k.T + qkv_bias[1], "v": x @ v.T + qkv_bias[2]}
    for name, want in expected_qkv.items():
        torch.testing.assert_close(torch.cat(parts[name], dim=-1), want)
    torch.testing.assert_close(torch.cat(parts["gate"], dim=-1), x @ gate.T)
    torch.testing.assert_close(torch.cat(parts["up"], dim=-1), x @ up.T)
    torch.testing.assert_close(sum(parts["down"]), h @ down.T + down_bias)
    torch.testing.assert_close(sum(parts["emb"]), emb[ids])
    torch.testing.assert_close(torch.cat(parts["head"], dim=-1)[:, :vocab], x @ emb.T)


def test_merged_column_rejects_parts_that_do_not_split():
    with pytest.raises(ValueError, match="each fused projection"):
        _ShardOnly(0, 2).layers().merged_column(8, [3, 5])  # the sum divides, the parts do not


# ------------------------------------------------------------------- choice and early errors
def _target(path: str, device: str = "cpu", tensor_parallel_size: int = 1) -> Target:
    from nanoplug.checkpoint.loader import load_hf_config

    return Target(device=torch.device(device), dtype=torch.float32, model=ModelFacts.from_hf_config(load_hf_config(path)),
                  tensor_parallel_size=tensor_parallel_size)


def test_auto_picks_tensor_for_two_ranks_and_single_for_one(ckpt):
    registry = Registry(load_entry_points=False)
    assert registry.resolve("parallel", "auto", _target(ckpt["qwen3"], tensor_parallel_size=2)).name == "tensor"
    assert registry.resolve("parallel", "auto", _target(ckpt["qwen3"])).name == "single"
    assert registry.resolve("parallel", "tensor", _target(ckpt["qwen3"])).name == "tensor"  # size 1 is fine


def test_sizes_that_do_not_divide_fail_before_any_process_starts(ckpt):
    before = _children()
    with pytest.raises(PluginUnavailableError, match=r"3 does not divide the 4 attention heads and the 2 KV heads.*"
                                                     r"sizes that do: 1, 2"):
        LLM(ckpt["qwen3"], parallel="tensor", tensor_parallel_size=3, **helpers.ENGINE_OPTIONS)
    with pytest.raises(PluginUnavailableError, match="4 does not divide the 2 KV heads"):
        LLM(ckpt["llama"], parallel="auto", tensor_parallel_size=4, **helpers.ENGINE_OPTIONS)
    assert _children() == before


def test_mlp_size_that_does_not_divide_is_reported(tmp_path):
    from transformers import Qwen3Config

    path = tmp_path / "odd_mlp"
    Qwen3Config(hidden_size=32, intermediate_size=66, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                num_hidden_layers=1, vocab_size=100, architectures=["Qwen3ForCausalLM"]).save_pretrained(path)
    target = _target(str(path), tensor_parallel_size=4)
    reasons = Registry(load_entry_points=False).reasons("parallel", "tensor", target)
    assert any("MLP intermediate size" in r and "sizes that do: 1, 2" in r for r in reasons), reasons


def test_more_gpus_than_present_is_reported(ckpt, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    reasons = Registry(load_entry_points=False).reasons(
        "parallel", "tensor", _target(ckpt["qwen3"], device="cuda", tensor_parallel_size=2))
    assert reasons == ["tensor_parallel_size=2 needs 2 GPUs but torch sees 1; lower tensor_parallel_size or make "
                       "more GPUs visible (CUDA_VISIBLE_DEVICES)"]


def test_launcher_world_size_must_match(ckpt, monkeypatch):
    for key, value in dict(RANK="0", WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(key, value)
    target = _target(ckpt["qwen3"], tensor_parallel_size=2)
    reasons = Registry(load_entry_points=False).reasons("parallel", "tensor", target)
    assert len(reasons) == 1 and "has 4 processes but tensor_parallel_size=2" in reasons[0]


# ------------------------------------------------------------------------------ worker faults
def _faulty_registry(cls) -> Registry:
    registry = Registry(load_entry_points=False)
    registry.add_plugin_module(helpers.ModelPlugin(cls), "tests")
    return registry


def test_fault_while_loading_surfaces_with_the_worker_traceback(ckpt):
    before = _children()
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        LLM(ckpt["qwen3"], registry=_faulty_registry(helpers.FailsToLoadOnRank1), parallel="tensor",
            tensor_parallel_size=2, **helpers.ENGINE_OPTIONS)
    assert time.monotonic() - start < DEADLINE_S
    message = str(info.value)
    assert "rank 1 failed during start-up" in message
    assert "Traceback" in message and "InjectedFault: injected fault while building the model on rank 1" in message
    assert "--- rank 0 ---" not in message  # the root cause, not the broken collective it causes
    assert gone(_children() - before)


def test_fault_in_a_step_surfaces_and_stops_the_engine(ckpt):
    before = _children()
    llm = LLM(ckpt["qwen3"], registry=_faulty_registry(helpers.FailsInStepOnRank1), parallel="tensor",
              tensor_parallel_size=2, **helpers.ENGINE_OPTIONS)
    pids = llm.engine.worker.worker_pids
    assert llm.generate([[1, 2, 3]], use_tqdm=False)[0].token_ids  # healthy until the fault
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"(?s)rank 1 failed during 'run'.*Traceback.*in forward.*"
                                          r"InjectedFault: injected fault in a step on rank 1"):
        llm.generate([[1, helpers.FAIL_TOKEN, 3]], use_tqdm=False)
    assert time.monotonic() - start < DEADLINE_S
    with pytest.raises(WorkerError, match="workers are stopped.*create a new LLM"):
        llm.generate([[1, 2, 3]], use_tqdm=False)
    assert gone(pids)
    llm.close()
    assert gone(_children() - before)


# ------------------------------------------------------------------- processes and shutdown
def test_two_engines_at_once_then_a_killed_worker_and_close(ckpt, tp_qwen3):
    first_pids = tp_qwen3.engine.worker.worker_pids
    second = LLM(ckpt["qwen3"], parallel="tensor", tensor_parallel_size=2, **helpers.ENGINE_OPTIONS)
    pids = second.engine.worker.worker_pids
    assert not set(pids) & set(first_pids)
    ref = helpers.generate_twice(tp_qwen3)
    _assert_same_outputs(ref, helpers.generate_twice(second))
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 .* exited with code -9"):
        second.generate(helpers.PROMPTS, use_tqdm=False)
    assert time.monotonic() - start < 30
    second.close()
    assert gone(pids)
    _assert_same_outputs(ref, helpers.generate_twice(tp_qwen3))  # the other engine is untouched


def _hold_engine(processes, ckpt_path: str):
    """A helper process generating on a tp=2 engine; the fixture kills it and its workers whatever happens."""
    proc = processes.popen([sys.executable, str(HERE / "tensor_parallel_helpers.py"), "hold", ckpt_path],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(HERE))
    line = proc.stdout.readline()
    assert line.startswith("PIDS"), line + proc.stderr.read()
    pids = [int(p) for p in line.split()[1:]]
    processes.adopt(pids)  # after the helper dies they are no longer its descendants
    time.sleep(1.0)  # let it get into a step
    return proc, pids


def test_ctrl_c_in_the_caller_stops_the_workers(ckpt, processes):
    """Holds when pytest itself runs with SIGINT ignored (a background job): the helper restores it."""
    proc, pids = _hold_engine(processes, ckpt["qwen3"])
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert "INTERRUPTED" in out and "KeyboardInterrupt" in err
    assert gone(pids)


def test_workers_exit_when_the_caller_is_killed(ckpt, processes):
    proc, pids = _hold_engine(processes, ckpt["qwen3"])
    proc.kill()
    proc.communicate(timeout=30)
    assert gone(pids, within=15.0)


# -------------------------------------------------------------------------------- torchrun
def test_torchrun_ranks_join_and_match_one_process(ckpt, tmp_path, processes):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(HERE / "tensor_parallel_helpers.py"), ckpt["qwen3"], str(tmp_path)]
    result = processes.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=str(HERE))
    assert result.returncode == 0, result.stderr[-4000:]
    single = LLM(ckpt["qwen3"], parallel="single", **helpers.ENGINE_OPTIONS)
    reference = helpers.generate_twice(single)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    runs = [saved[overlap] for saved in ranks for overlap in (False, True)]  # steps in turn, then overlapped
    assert [r["parallel"] for r in runs] == ["tensor"] * 4  # "auto" with size 2
    assert [r["overlap"] for r in runs] == [False, True] * 2
    for saved in runs:
        assert "scheduled a different step than rank 0" in saved["mismatch"]
    for saved in runs:  # every rank returns the same outputs
        for ref_outs, outs in zip(reference, saved["rounds"]):
            for ref, (tokens, logits, cached) in zip(ref_outs, outs):
                assert tokens == ref.token_ids
                assert cached == ref.num_cached_tokens or saved["overlap"]  # overlapped, blocks register a step later
                assert all(_relative_error(a, b) <= 1e-5 for a, b in zip(ref.logits, logits))
