"""The Triton slot-mapping KV store against the plain `torch` store, on CPU through the Triton
interpreter (TRITON_INTERPRET=1 must be set before the kernel is defined, so the store module is
reloaded after setting it, whatever another test imported first)."""
from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from nanoplug.api import KVLayer, ModelFacts, Target  # noqa: E402
from nanoplug.plugins.kv_cache.torch import TorchStore  # noqa: E402

import nanoplug.plugins.kv_cache.triton as triton_store  # noqa: E402

triton_store = importlib.reload(triton_store)


def _caches(num_blocks=6, block_size=4, heads=2, dim=16):
    k = torch.randn(num_blocks, block_size, heads, dim)
    return k, torch.randn_like(k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_matches_torch_store(dtype):
    torch.manual_seed(0)
    n, heads, dim = 9, 2, 16
    qkv = torch.randn(n, (4 + 2 * heads) * dim, dtype=dtype)  # k, v as strided views, as the model makes them
    _, k, v = qkv.split([4 * dim, heads * dim, heads * dim], dim=-1)
    k, v = k.view(n, heads, dim), v.view(n, heads, dim)
    slots = torch.tensor([0, 5, 6, 7, -1, 12, 13, 23, 3], dtype=torch.int64)
    kc, vc = (t.to(dtype) for t in _caches())
    ref_k, ref_v = kc.clone(), vc.clone()
    keep = slots >= 0
    TorchStore().store(k[keep], v[keep], ref_k, ref_v, slots[keep], KVLayer(0))
    triton_store.TritonStore().store(k, v, kc, vc, slots, KVLayer(0))
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)  # a copy: bit-exact, slot -1 untouched


def _target(device: str) -> Target:
    facts = ModelFacts("Qwen3ForCausalLM", 2, 4, 2, 16, 64, 100)
    return Target(device=torch.device(device), dtype=torch.float32, model=facts)


def test_unavailable_names_the_fix(monkeypatch):
    assert triton_store.TritonStore.unavailable(_target("cpu")) == []  # interpreter on
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reasons = triton_store.TritonStore.unavailable(_target("cpu"))
    assert reasons and "needs CUDA" in reasons[0] and "TRITON_INTERPRET=1" in reasons[0]


def test_a_cpu_only_torch_imports_no_triton_unasked():
    """On a CPU-only torch build a start imports no triton (its import and the plugins' hundred kernel definitions
    were a quarter second of `nanoplug generate`'s first token) unless TRITON_INTERPRET=1 asks for the interpreter; the
    plugins then say they need CUDA, not that triton is missing."""
    import subprocess
    import sys

    if torch.version.cuda is not None or torch.version.hip is not None:
        pytest.skip("a CUDA or ROCm build of torch imports triton for its GPU")
    code = ("import sys, torch; from nanoplug.api import ModelFacts, Target; "
            "import nanoplug.plugins.kv_cache.triton as t; "
            "facts = ModelFacts('Qwen3ForCausalLM', 2, 4, 2, 16, 64, 100); "
            "print('triton' in sys.modules, t.triton is None, "
            "t.TritonStore.unavailable(Target(device=torch.device('cpu'), dtype=torch.float32, model=facts)))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    imported, missing, reasons = out.split(" ", 2)
    assert (imported, missing) == ("False", "True") and "needs CUDA" in reasons and "pip install" not in reasons
    out = subprocess.run([sys.executable, "-c", code], env={**env, "TRITON_INTERPRET": "1"}, capture_output=True,
                         text=True, check=True).stdout
    assert out.split(" ", 2)[:2] == ["True", "False"] and out.split(" ", 2)[2].strip() == "[]"
