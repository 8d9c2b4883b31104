"""Speculator `eagle`: an EAGLE-3 draft head over the target's hidden states, in the `speculators` package's format
(as vLLM reads it: `vllm/model_executor/models/llama_eagle3.py`, `vllm/v1/spec_decode/eagle.py`).

The head folder (`speculator_options={"model": DIR}`) holds `config.json` (`speculators_model_type: "eagle3"`, its
`transformer_layer_config` (a Llama or Qwen3 decoder layer), `draft_vocab_size`, `eagle_aux_hidden_state_layer_ids`,
`norm_before_residual`, ...; `speculators_config.verifier` names the target it was trained for) and safetensors:
`fc` (the auxiliary hidden states, concatenated, to one hidden), `layers.0.*` (a decoder layer whose q/k/v take
[norm(embedding), hidden_norm(hidden)], 2 x hidden wide), `norm`, `lm_head` (over the draft vocabulary), `d2t`
(draft id -> target id offsets) and `embed_tokens` (absent: the target's embedding is shared).

The computation (vLLM's): the target keeps the residual stream entering layers [2, L/2, L-3] (or the config's ids).
Row q of a step pairs the embedding of token q+1 with fc(those hidden states at q), at position q; the head's K/V of
every such row goes to its own cache, which mirrors the target's paged one (the same block tables and slots, one
layer: about 1/L more memory), so blocks freed, preempted or shared by prefix caching are so for the head too. The
last known row of a sequence gives the first draft (the draft vocabulary's argmax, mapped through d2t); each further
draft feeds the head's own output (before its final norm; after it with `norm_output`) and the embedding of the draft
before, one position on, its K/V kept aside for the proposal only.

EAGLE-1 and HASS heads (`speculators_model_type: "eagle"`) are refused: this version of the speculators package
(0.9) writes EAGLE-3 only.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from nanoplug.api import (HiddenStateSource, HiddenStateSpeculator, HiddenStep, SpeculatorSpec, Target, rms_norm,
                          rope_inv_freq)


class _LayerConfig:
    """The head's transformer_layer_config as attributes (rope_inv_freq reads a config object)."""

    def __init__(self, values: dict[str, Any]):
        self.__dict__.update(values)


def read_head_config(folder: str) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"speculator 'eagle' needs a head folder with config.json (the speculators format); "
                         f"{str(path)!r} does not exist")
    config = json.loads(path.read_text())
    kind = config.get("speculators_model_type")
    if kind == "eagle":
        raise ValueError("this is an EAGLE-1/HASS head (speculators_model_type 'eagle'); speculator 'eagle' serves "
                         "EAGLE-3 heads (speculators_model_type 'eagle3'): use an EAGLE-3 head for this target")
    if kind != "eagle3":
        raise ValueError(f"{str(path)!r} is not an EAGLE-3 head in the speculators format "
                         f"(speculators_model_type {kind!r}, expected 'eagle3')")
    return config


def aux_layer_ids(config: dict[str, Any], num_layers: int) -> list[int]:
    """The target layers whose hidden states the head reads: the config's, else [2, L // 2, L - 3] (vLLM's and the
    speculators package's default)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids") or [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) > num_layers:
        raise ValueError(f"the EAGLE-3 head reads target layers {ids}, which a target of {num_layers} layers does not "
                         "have: serve the head with the target it was trained for, or set "
                         "eagle_aux_hidden_state_layer_ids in its config.json")
    return list(ids)


class EagleSpeculator(HiddenStateSpeculator):
    description = "an EAGLE-3 head drafts from the target's hidden states (speculators format; K/V in the target's blocks)"
    priority = 20
    options = frozenset({"model"})
    kv_layers = 1  # its one layer's K/V mirror the target's blocks

    @classmethod
    def unavailable(cls, target: Target) -> list[str]:
        if target.tensor_parallel_size > 1:
            return ["it reads the target's hidden states in the worker's process: tensor_parallel_size must be 1"]
        return []

    def __init__(self, spec: SpeculatorSpec):
        super().__init__(spec)
        if "model" not in spec.options:
            raise ValueError("speculator 'eagle' needs the head: speculator_options={'model': DIR} (an EAGLE-3 head "
                             "in the speculators format, trained for this target)")
        if spec.hidden_states is None:
            raise ValueError("speculator 'eagle' reads the target's hidden states in the worker's process: "
                             "use parallel='single' (no tensor parallelism)")
        folder = str(spec.options["model"])
        config = read_head_config(folder)
        self.hidden_size = int(config["transformer_layer_config"]["hidden_size"])
        if spec.facts is None:
            raise ValueError("speculator 'eagle' needs the target's facts (SpeculatorSpec.facts) for its layer ids")
        self.layer_ids = aux_layer_ids(config, spec.facts.num_layers)
        self.source = spec.hidden_states(self.layer_ids)
        self._load(folder, config, self.source)

    # ---------------------------------------------------------------------------------------- loading
    def _load(self, folder: str, config: dict[str, Any], src: HiddenStateSource) -> None:
        from safetensors.torch import load_file

        tl = config["transformer_layer_config"]
        verifier = (config.get("speculators_config") or {}).get("verifier") or {}
        trained_for = verifier.get("name_or_path") or "its verifier"
        fix = (f"serve this head with the target it was trained for ({trained_for}), or use a head trained for this "
               "target")
        n_aux = len(self.layer_ids)
        target_hidden = int(config.get("target_hidden_size") or self.hidden_size)
        if target_hidden != src.hidden_size:
            raise ValueError(f"the EAGLE-3 head reads hidden states of size {target_hidden}, this target's are "
                             f"{src.hidden_size}: {fix}")
        if int(tl.get("vocab_size", src.vocab_size)) != src.vocab_size:
            raise ValueError(f"the EAGLE-3 head's verifier vocabulary is {tl.get('vocab_size')} tokens, this target's "
                             f"{src.vocab_size}: {fix}")
        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise ValueError(f"the EAGLE-3 head folder {folder!r} has no .safetensors weights")
        w: dict[str, torch.Tensor] = {}
        for f in files:
            w.update(load_file(str(f)))
        w = {k.removeprefix("model."): v for k, v in w.items()}
        need = ["fc.weight", "norm.weight", "lm_head.weight", "layers.0.hidden_norm.weight",
                "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight",
                *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
                *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))]
        missing = [k for k in need if k not in w]
        if missing:
            raise ValueError(f"the EAGLE-3 head in {folder!r} lacks {', '.join(missing)}")
        if int(tl.get("num_hidden_layers", 1)) != 1 or any(k.startswith("layers.1.") for k in w):
            raise ValueError("speculator 'eagle' serves EAGLE-3 heads of one decoder layer (as vLLM's llama_eagle3)")
        if tuple(w["fc.weight"].shape) != (self.hidden_size, n_aux * target_hidden):
            raise ValueError(f"the EAGLE-3 head's fc takes {w['fc.weight'].shape[1]} values, "
                             f"{n_aux} hidden states of this target give {n_aux * src.hidden_size}: {fix}")
        dev, dt = src.device, src.dtype
        self.w = {k: v.to(dev, dt) for k, v in w.items() if k not in ("d2t", "t2d")}
        self.embed_w = self.w.get("embed_tokens.weight")
        if self.embed_w is None and self.hidden_size != src.hidden_size:
            raise ValueError(f"the EAGLE-3 head has no embed_tokens and its hidden size {self.hidden_size} is not the "
                             f"target's {src.hidden_size}: {fix}")
        draft_vocab = self.w["lm_head.weight"].shape[0]
        d2t = w.get("d2t")
        self.d2t = (d2t.to(dev, torch.int64) + torch.arange(draft_vocab, device=dev)) if d2t is not None else None
        if self.d2t is not None and int(self.d2t.max()) >= src.vocab_size:
            raise ValueError(f"the EAGLE-3 head's d2t maps to tokens past this target's vocabulary: {fix}")
        self.eps = float(tl.get("rms_norm_eps", 1e-6))
        self.heads = int(tl["num_attention_heads"])
        self.kv_heads = int(tl.get("num_key_value_heads") or self.heads)
        self.head_dim = int(tl.get("head_dim") or self.hidden_size // self.heads)
        self.qk_norm = "layers.0.self_attn.q_norm.weight" in self.w  # Qwen3 layers
        self.norm_before_residual = bool(config.get("norm_before_residual", False))
        self.norm_output = bool(config.get("norm_output", False))
        if config.get("norm_before_fc") or config.get("fc_norm"):
            self.fc_norms = [self.w[k] for k in sorted(self.w) if k.startswith(("input_norm.", "fc_norm."))]
        else:
            self.fc_norms = []
        inv_freq, scaling = rope_inv_freq(_LayerConfig(tl), self.head_dim)
        freqs = torch.outer(torch.arange(src.max_model_len + 64, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = (emb.cos() * scaling).to(dev), (emb.sin() * scaling).to(dev)
        # the head's paged KV: the target's geometry (block tables, slots), one layer
        self.kv = torch.zeros(2, src.num_blocks * src.block_size, self.kv_heads, self.head_dim, device=dev, dtype=dt)
        self.block_size = src.block_size
        self.state: dict[int, tuple[int, torch.Tensor, int, torch.Tensor]] = {}  # seq_id -> (position, g, row, draft)

    # ------------------------------------------------------------------------------------ computing
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_w is not None:
            return F.embedding(ids, self.embed_w)
        return self.source.embed(ids).to(self.source.dtype)

    def _fc(self, hidden: torch.Tensor) -> torch.Tensor:
        if len(self.fc_norms) == 1:  # norm_before_fc: one norm over the concatenation
            hidden = rms_norm(hidden, self.fc_norms[0], self.eps)
        elif self.fc_norms:  # fc_norm: one norm per auxiliary hidden state
            parts = hidden.chunk(len(self.fc_norms), dim=-1)
            hidden = torch.cat([rms_norm(p, n, self.eps) for p, n in zip(parts, self.fc_norms)], dim=-1)
        return F.linear(hidden, self.w["fc.weight"])

    def _qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """The first layer up to attention: (q, k, v, residual) of rows whose input is [embeds, hidden]."""
        w, eps, p = self.w, self.eps, "layers.0."
        normed = rms_norm(hidden, w[p + "hidden_norm.weight"], eps)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([rms_norm(embeds, w[p + "input_layernorm.weight"], eps), normed], dim=-1)
        n = x.shape[0]
        q = F.linear(x, w[p + "self_attn.q_proj.weight"], w.get(p + "self_attn.q_proj.bias")).view(n, self.heads, -1)
        k = F.linear(x, w[p + "self_attn.k_proj.weight"], w.get(p + "self_attn.k_proj.bias")).view(n, self.kv_heads, -1)
        v = F.linear(x, w[p + "self_attn.v_proj.weight"], w.get(p + "self_attn.v_proj.bias")).view(n, self.kv_heads, -1)
        if self.qk_norm:
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v, residual

    def _finish(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """After attention: (g, the draft tokens in the target's vocabulary), g the hidden state fed back."""
        w, eps, p = self.w, self.eps, "layers.0."
        h = residual + F.linear(attn.reshape(attn.shape[0], -1), w[p + "self_attn.o_proj.weight"])
        x = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        x = F.linear(F.silu(F.linear(x, w[p + "mlp.gate_proj.weight"])) * F.linear(x, w[p + "mlp.up_proj.weight"]),
                     w[p + "mlp.down_proj.weight"])
        h = h + x
        normed = rms_norm(h, w["norm.weight"], eps)
        tokens = F.linear(normed, w["lm_head.weight"]).argmax(dim=-1)
        if self.d2t is not None:
            tokens = self.d2t[tokens]
        return (normed if self.norm_output else h), tokens

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, T, H, D] over k, v [B, S, KV, D] where mask [B, T, S] -> [B, T, H, D]."""
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask.unsqueeze(1), scale=self.head_dim ** -0.5, enable_gqa=True)
        return out.transpose(1, 2)

    def _gather(self, tables: list[list[int]], lengths: list[int], extra: int = 0):
        """The head's cached K and V of each sequence's first `lengths[i]` positions: [B, S + extra, KV, D] each, S the
        longest rounded up to a block, the `extra` columns after them free for a proposal's drafts; and the key
        positions [S]."""
        bs, dev = self.block_size, self.source.device
        nblk = max(1, max(-(-n // bs) for n in lengths))
        scratch = self.kv.shape[1] // bs - 1
        padded = [list(t[:nblk]) + [scratch] * (nblk - len(t[:nblk])) for t in tables]
        slots = (torch.tensor(padded, device=dev)[:, :, None] * bs + torch.arange(bs, device=dev)).view(len(tables), -1)
        if extra:
            slots = torch.cat([slots, slots.new_full((len(tables), extra), scratch * bs)], dim=1)
        return self.kv[0][slots], self.kv[1][slots], torch.arange(nblk * bs, device=dev)

    @torch.inference_mode()
    def observe(self, step: HiddenStep) -> None:
        dev = self.source.device
        rows = step.hidden.shape[0]
        if rows == 0:
            return
        ids = torch.tensor(step.next_ids, device=dev)
        q, k, v, residual = self._qkv(self._embed(ids), self._fc(step.hidden), step.positions)
        self.kv[0].index_copy_(0, step.slots, k)
        self.kv[1].index_copy_(0, step.slots, v)
        if step.block_copies:  # a prompt's partly filled last block, copied for its other samples (n > 1)
            src, dst = (torch.tensor(x, device=dev) for x in zip(*step.block_copies))
            blocks = self.kv.view(2, -1, self.block_size, self.kv_heads, self.head_dim)
            blocks[:, dst] = blocks[:, src]
        # per sequence, its rows padded to the longest: each attends to its cache up to its own position
        groups = step.groups
        width = max(n for _, _, _, n, _ in groups)
        index = torch.tensor([[first + min(t, n - 1) for t in range(width)] for _, _, first, n, _ in groups],
                             device=dev)
        real = torch.tensor([[t < n for t in range(width)] for _, _, _, n, _ in groups], device=dev)
        pos = step.positions[index]  # [B, T]
        keys, values, key_pos = self._gather(step.block_tables, [start + n for _, start, _, n, _ in groups])
        mask = key_pos[None, None, :] <= pos[:, :, None]
        attn = self._attend(q[index], keys, values, mask)[real]  # [rows, H, D] in row order (groups are in order)
        # only the last known row of each sequence is carried on: the first draft and the hidden state fed back
        last = [(seq_id, start + valid - 1, first + valid - 1) for seq_id, start, first, _, valid in groups if valid]
        if not last:
            return
        at = torch.tensor([row for _, _, row in last], device=dev)
        g, tokens = self._finish(attn.index_select(0, at), residual.index_select(0, at))
        for j, (seq_id, position, _) in enumerate(last):
            self.state[seq_id] = (position, g, j, tokens)

    @torch.inference_mode()
    def propose_hidden(self, seq_ids: list[int], lengths: list[int], block_tables: list[list[int]],
                       num_drafts: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in seq_ids]
        ready = [i for i, (s, n, k) in enumerate(zip(seq_ids, lengths, num_drafts))
                 if k > 0 and s in self.state and self.state[s][0] == n - 2]  # it saw every token before the last
        if not ready:
            return out
        dev = self.source.device
        states = [self.state[seq_ids[i]] for i in ready]
        g = torch.stack([s[1][s[2]] for s in states])
        drafts = [torch.stack([s[3][s[2]] for s in states])]
        k_max = max(num_drafts[i] for i in ready)
        if k_max > 1:
            base = torch.tensor([s[0] for s in states], device=dev)  # the last row the head computed
            keys, values, key_pos = self._gather([block_tables[i] for i in ready], [s[0] + 1 for s in states],
                                                 k_max - 1)
            width = key_pos.shape[0]
            drafted = base.new_zeros(len(ready), k_max - 1, dtype=torch.bool)  # each draft's column once written
            mask = torch.cat([key_pos[None, :] <= base[:, None], drafted], dim=1)  # [B, S + k - 1]
            for j in range(1, k_max):
                q, k, v, residual = self._qkv(self._embed(drafts[-1]), g, base + j)
                keys[:, width + j - 1], values[:, width + j - 1] = k, v
                mask[:, width + j - 1] = True
                attn = self._attend(q[:, None], keys[:, :width + j], values[:, :width + j],
                                    mask[:, None, :width + j])[:, 0]
                g, tokens = self._finish(attn, residual)
                drafts.append(tokens)
        proposed = torch.stack(drafts, dim=1).tolist()  # one copy to the host
        for i, row in zip(ready, proposed):
            out[i] = row[:num_drafts[i]]
        return out

    def release(self, seq_ids: list[int]) -> None:
        for s in seq_ids:
            self.state.pop(s, None)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).to(dtype)
