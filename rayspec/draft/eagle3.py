"""EAGLE-3 draft head (Li et al. 2025, "EAGLE-3: Scaling up Inference
Acceleration of Large Language Models via Training-Time Test", arXiv 2503.01840)
in the checkpoint format vLLM's ``eagle3`` method loads
(``LlamaForCausalLMEagle3``: ``fc``, ``midlayer.*``, ``norm``, ``lm_head``).

The head reads three verifier hidden states (the inputs of the layers in
``eagle_aux_hidden_state_layer_ids``, concatenated: [*, 3H]), projects them
with ``fc`` to H, and runs one decoder layer whose attention takes
[norm(embed(next token)), norm(hidden)] (2H). Its output (pre-norm) is the
hidden state of the next draft step. The embedding is shared with the
policy: vLLM uses the verifier's ``embed_tokens`` when the checkpoint has none,
so the head follows policy refits for free.

The head proposes either in the policy's whole vocabulary or in a reduced
draft vocabulary of ``draft_vocab_size`` tokens (the paper's heads keep 32k of
Llama-3's 128k), mapped to policy token ids as the EAGLE-3 reference code,
SpecForge and vLLM's ``eagle3`` loader store it: ``d2t`` [N] int64 with
``target_id = draft_id + d2t[draft_id]`` (draft ids in increasing target-id
order) and ``t2d`` [V] bool marking the target ids in the draft vocabulary.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from rayspec.devices import to_host
from rayspec.files import write_dir_atomic

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """Low / middle / high verifier layers: 1, L/2-1, L-4 (vLLM's default
    (2, L/2, L-3) picks the same depths one layer later)."""
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    if len(set(ids)) != 3 or min(ids) < 0:
        raise ValueError(f"policy has {num_layers} layers; EAGLE-3 needs >= 6 for distinct aux layers")
    return ids


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half convention, as Llama). x [B, h, T, d], pos [B, T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = pos.float()[:, None, :, None] * inv  # [B, 1, T, d/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return (x.float() * cos + torch.cat([-x2, x1], -1).float() * sin).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, self.hd = cfg["hidden_size"], cfg["head_dim"]
        self.nh, self.nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.theta = cfg["rope_theta"]
        self.q_proj = nn.Linear(2 * h, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * h, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, chain: Optional[list] = None):
        """Attention of one draft step over the sequence's positions.

        Args:
            x: [B, T, 2H] this step's inputs, one per chain start t.
            pos: [B, T] int64 positions of the fed tokens.
            chain: None at draft step 0 (causal attention over the
                positions); at step j >= 1, the (k, v) pairs [B, nkv, T, d]
                that steps 0 .. j-1 returned. Step j of the chain starting at
                t then attends to step 0's entries at t' <= t and to its own
                chain's entries of steps 1 .. j, which is what vLLM's drafter
                cache holds when it drafts from t (the training-time-test
                attention of EAGLE-3, Li et al. 2025).

        Returns:
            (output [B, T, H], this step's (k, v)).
        """
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, k = _rope(q, pos, self.theta), _rope(k, pos, self.theta)
        if not chain:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.nh != self.nkv)
        else:
            rep = self.nh // self.nkv
            kvs = [(kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)) for kk, vv in [*chain, (k, v)]]
            scale = self.hd ** -0.5
            s0 = (q @ kvs[0][0].transpose(-1, -2)) * scale  # [B, nh, T, T]
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            s0 = s0.masked_fill(~causal, float("-inf"))
            own = [(q * kk).sum(-1, keepdim=True) * scale for kk, _ in kvs[1:]]  # [B, nh, T, 1] each
            p = torch.softmax(torch.cat([s0, *own], -1).float(), -1).to(q.dtype)
            o = p[..., :T] @ kvs[0][1]
            for i, (_, vv) in enumerate(kvs[1:]):
                o = o + p[..., T + i:T + i + 1] * vv
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1)), (k, v)


class _MLP(nn.Module):
    def __init__(self, h: int, i: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = _MLP(h, cfg["intermediate_size"])


class Eagle3Head(nn.Module):
    """EAGLE-3 head, parameter names as in vLLM's checkpoint format.

    Args:
        cfg: the head's config dict (``head_config`` builds it).
    """

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = cfg
        h = cfg["hidden_size"]
        self.fc = nn.Linear(3 * cfg.get("target_hidden_size", h), h, bias=False)
        self.midlayer = _MidLayer(cfg)
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.lm_head = nn.Linear(h, cfg["draft_vocab_size"], bias=False)
        if cfg["draft_vocab_size"] != cfg["vocab_size"]:
            self.register_buffer("d2t", torch.zeros(cfg["draft_vocab_size"], dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(cfg["vocab_size"], dtype=torch.bool))
        else:
            self.d2t = self.t2d = None

    @property
    def draft_ids(self) -> Optional[torch.Tensor]:
        """[N] int64 policy token id of each draft-vocabulary row of ``lm_head``
        (None: the draft vocabulary is the policy's)."""
        if self.d2t is None:
            return None
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Set the d2t / t2d maps from [N] distinct policy token ids (any order).

        Raises:
            ValueError: the head has the policy's whole vocabulary, or the ids
                are not N distinct ids in [0, V).
        """
        if self.d2t is None:
            raise ValueError("this head drafts in the policy's whole vocabulary (draft_vocab_size == vocab_size)")
        ids = torch.as_tensor(token_ids, dtype=torch.long).sort().values
        if ids.numel() != self.d2t.numel() or ids.unique().numel() != ids.numel():
            raise ValueError(f"draft vocabulary needs {self.d2t.numel()} distinct token ids, got {ids.numel()} "
                             f"({ids.unique().numel()} distinct)")
        if ids[0] < 0 or ids[-1] >= self.t2d.numel():
            raise ValueError(f"draft vocabulary token ids must lie in [0, {self.t2d.numel()})")
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(ids.numel()))
            self.t2d.zero_()
            self.t2d[ids] = True

    def draft_rows(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """The rows [N, H] of the verifier's output layer [V, H] that the
        draft vocabulary's tokens take (``draft_ids``, in draft order; the
        layer itself without a reduced vocabulary), on its device."""
        ids = self.draft_ids
        return lm_head_weight if ids is None else lm_head_weight[ids.to(lm_head_weight.device)]

    def set_output_rows(self, rows: torch.Tensor) -> None:
        """Copy the verifier's output-layer rows of the draft vocabulary
        [N, H] (``draft_rows``) into ``lm_head``."""
        with torch.no_grad():
            self.lm_head.weight.copy_(rows)

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor,
             chain: Optional[list] = None):
        """One draft step, mirroring vLLM's ``llama_eagle3.LlamaModel.forward``.

        Args:
            embeds: [B, T, H] embeddings of the tokens fed at this step.
            hidden: [B, T, H] ``fc`` output (step 0) or the previous step's
                pre-norm output.
            pos: [B, T] int64 positions of the fed tokens.
            chain: the attention (k, v) of the earlier steps (``_Attention``);
                None at step 0.

        Returns:
            (normed [B, T, H] for ``lm_head``, prenorm [B, T, H] for the next
            step, this step's attention (k, v) to append to ``chain``).
        """
        layer = self.midlayer
        residual = hidden
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], -1)
        x, kv = layer.self_attn(x, pos, chain)
        residual = x + residual
        x = layer.mlp(layer.post_attention_layernorm(residual))
        prenorm = x + residual
        return self.norm(prenorm), prenorm, kv


def head_config(policy_config: dict, aux_layer_ids: Optional[list[int]] = None,
                draft_vocab_size: Optional[int] = None) -> dict:
    """Config of an EAGLE-3 head for a Llama-family policy (HF config dict).

    Args:
        draft_vocab_size: tokens the head proposes from (None: the policy's
            ``vocab_size``).

    Raises:
        ValueError: the policy is not Llama-family or too shallow, or
            ``draft_vocab_size`` is not in [1, vocab_size].
    """
    if policy_config.get("model_type") not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ValueError(f"EAGLE-3 head needs a Llama-family policy, got model_type="
                         f"{policy_config.get('model_type')!r}")
    L = policy_config["num_hidden_layers"]
    ids = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(L)
    if any(not 0 <= i < L for i in ids) or len(ids) != 3:
        raise ValueError(f"draft.aux_hidden_state_layer_ids={ids}: need 3 ids in [0, {L})")
    V = policy_config["vocab_size"]
    if draft_vocab_size is not None and not 0 < draft_vocab_size <= V:
        raise ValueError(f"draft.draft_vocab_size={draft_vocab_size}: need 1 to the policy's vocab_size {V}")
    rope = policy_config.get("rope_parameters") or {}
    h = policy_config["hidden_size"]
    cfg = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": h,
        "target_hidden_size": h,
        "intermediate_size": policy_config["intermediate_size"],
        "num_attention_heads": policy_config["num_attention_heads"],
        "num_key_value_heads": policy_config.get("num_key_value_heads", policy_config["num_attention_heads"]),
        "head_dim": policy_config.get("head_dim") or h // policy_config["num_attention_heads"],
        "num_hidden_layers": 1,
        "rms_norm_eps": policy_config.get("rms_norm_eps", 1e-6),
        "rope_theta": rope.get("rope_theta", policy_config.get("rope_theta", 10000.0)),
        "rope_parameters": rope or {"rope_type": "default",
                                    "rope_theta": policy_config.get("rope_theta", 10000.0)},
        "max_position_embeddings": policy_config.get("max_position_embeddings", 4096),
        "vocab_size": V,
        "draft_vocab_size": draft_vocab_size or V,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }
    return with_aux_layer_ids(cfg, ids)


def head_init_tensors(num_layers: int) -> list[str]:
    """The policy tensors ``init_head`` reads (checkpoint names of a
    ``num_layers``-layer transformers Llama), for ``load_policy(only=...)``."""
    last = f"model.layers.{num_layers - 1}"
    mlp = [f"{last}.mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
    return ["lm_head.weight", "model.norm.weight", f"{last}.post_attention_layernorm.weight",
            f"{last}.self_attn.o_proj.weight", *mlp]


def init_head(policy, aux_layer_ids: Optional[list[int]] = None, seed: int = 0,
              draft_vocab: Optional[torch.Tensor] = None) -> Eagle3Head:
    """A new head for ``policy`` (a transformers Llama causal LM; only the
    tensors ``head_init_tensors`` names need be loaded).

    ``lm_head`` and ``norm`` start from the policy's (so step-0 drafts read
    the policy's own output space); the MLP and o_proj from its last layer;
    ``fc`` and q/k/v at random (std 0.02).

    Args:
        draft_vocab: [N] policy token ids of a reduced draft vocabulary
            (``rayspec.draft.vocab.select_draft_vocab``); None: all of them.
    """
    cfg = head_config(policy.config.to_dict(), aux_layer_ids,
                      None if draft_vocab is None else len(draft_vocab))
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    for p in head.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    if draft_vocab is not None and head.d2t is not None:
        head.set_draft_vocab(draft_vocab)
    last = policy.model.layers[-1]
    head.set_output_rows(head.draft_rows(policy.lm_head.weight))
    with torch.no_grad():
        head.norm.weight.copy_(policy.model.norm.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(head.midlayer.mlp, name).weight.copy_(getattr(last.mlp, name).weight)
        head.midlayer.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight)
        head.midlayer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
    return head


def vllm_state_dict(head: Eagle3Head, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The head's weights under vLLM's checkpoint names (host copies, floating
    point ones cast to ``dtype``), with ``d2t`` for a reduced draft
    vocabulary; ``t2d`` is left out (vLLM's loader skips it)."""
    return to_host({k: v for k, v in head.state_dict().items() if k != "t2d"}, dtype)


# Where vLLM 0.32 reads a head's auxiliary layer ids: V1's runner
# (GPUModelRunner._get_eagle3_aux_layers_from_config) reads the top level,
# then eagle_config["eagle_aux_hidden_state_layer_ids"]; V2's
# (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py,
# get_eagle3_aux_layers_from_config) the top level, then eagle_config["layer_ids"].
# A head whose ids only one runner finds is fed the other runner's default
# layers there, silently: rayspec writes all three.
AUX_LAYER_KEYS = ("eagle_aux_hidden_state_layer_ids", "eagle_config.eagle_aux_hidden_state_layer_ids",
                  "eagle_config.layer_ids")


def with_aux_layer_ids(head_cfg: dict, ids: list[int]) -> dict:
    """``head_cfg`` (an EAGLE-3 head's config dict) with ``ids`` under every
    key of ``AUX_LAYER_KEYS``, so vLLM's V1 and V2 model runners feed the
    head the verifier layers it was trained on."""
    ids = [int(i) for i in ids]
    return {**head_cfg, "eagle_aux_hidden_state_layer_ids": ids,
            "eagle_config": {**(head_cfg.get("eagle_config") or {}),
                             "eagle_aux_hidden_state_layer_ids": ids, "layer_ids": ids}}


def aux_layer_ids(head_cfg: dict, num_layers: Optional[int]) -> Optional[list[int]]:
    """The verifier layers whose inputs feed the head, as vLLM reads them from
    its config (the first of ``AUX_LAYER_KEYS`` set), else vLLM's default
    (2, L/2, L-3) for an L-layer verifier
    (``SupportsEagle3.get_eagle3_default_aux_hidden_state_layers``, vLLM
    0.32), which published heads without the keys were trained with (None
    where the config names none and ``num_layers`` is None)."""
    nested = head_cfg.get("eagle_config") or {}
    ids = (head_cfg.get("eagle_aux_hidden_state_layer_ids") or nested.get("eagle_aux_hidden_state_layer_ids")
           or nested.get("layer_ids"))
    if ids:
        return list(ids)
    return None if num_layers is None else [2, num_layers // 2, num_layers - 3]


def save_head(head: Eagle3Head, out_dir: str | os.PathLike) -> Path:
    """Write config.json + model.safetensors atomically (temp dir, then rename).

    A checkpoint already at ``out_dir`` is replaced only once the new one is
    complete.
    """
    out = Path(out_dir)
    with write_dir_atomic(out) as tmp:
        ids = aux_layer_ids(head.cfg, None)
        cfg = head.cfg if ids is None else with_aux_layer_ids(head.cfg, ids)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        save_file(to_host(head.state_dict(), torch.bfloat16), str(tmp / "model.safetensors"))
    return out


WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def load_head(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """Load a head written by ``save_head`` or a published EAGLE-3 checkpoint
    (the reference code's ``pytorch_model.bin``, SpecForge's
    ``model.safetensors``), with or without a reduced draft vocabulary.

    An ``embed_tokens.weight`` in the checkpoint is dropped: the head shares
    the verifier's embedding (as vLLM does for heads without one), which the
    published heads were trained with, frozen.

    Raises:
        FileNotFoundError: no config.json or weights file under ``path``.
        ValueError: not an EAGLE-3 Llama head; a reduced draft vocabulary
            without a valid ``d2t`` ([draft_vocab_size] offsets to distinct
            token ids below ``vocab_size``); weights that do not fit the config.
    """
    p = Path(path)
    weights = next((p / f for f in WEIGHT_FILES if (p / f).is_file()), None)
    if not (p / "config.json").is_file() or weights is None:
        raise FileNotFoundError(f"{p}: expected config.json and one of {', '.join(WEIGHT_FILES)}")
    cfg = json.loads((p / "config.json").read_text())
    if ARCHITECTURE not in cfg.get("architectures", []):
        raise ValueError(f"{p}/config.json: architectures={cfg.get('architectures')}, expected {ARCHITECTURE}")
    cfg.setdefault("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    cfg.setdefault("draft_vocab_size", cfg["vocab_size"])
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    cfg.setdefault("rms_norm_eps", 1e-6)
    if weights.suffix == ".bin":
        try:  # tensors only: a pickle that would run code is refused, not run
            sd = torch.load(weights, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise ValueError(f"{weights}: not a tensors-only checkpoint ({str(e).splitlines()[0]})") from None
    else:
        sd = load_file(str(weights))
    sd.pop("embed_tokens.weight", None)
    head = Eagle3Head(cfg)
    if head.d2t is not None:
        d2t = sd.pop("d2t", None)
        sd.pop("t2d", None)  # derived from d2t, so the two cannot disagree
        if d2t is None or d2t.shape != (cfg["draft_vocab_size"],):
            raise ValueError(f"{weights}: draft_vocab_size={cfg['draft_vocab_size']} != vocab_size="
                             f"{cfg['vocab_size']} needs a d2t tensor of shape [{cfg['draft_vocab_size']}], "
                             f"found {None if d2t is None else list(d2t.shape)}")
        try:
            head.set_draft_vocab(torch.arange(d2t.numel()) + d2t.long())
        except ValueError as e:
            raise ValueError(f"{weights}: d2t: {e}") from None
    else:
        sd = {k: v for k, v in sd.items() if k not in ("d2t", "t2d")}
    try:
        missing, unexpected = head.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    except RuntimeError as e:  # a shape differs from the config's
        raise ValueError(f"{weights}: weights do not fit {p}/config.json: {e}") from None
    missing = [k for k in missing if k not in ("d2t", "t2d")]
    if missing or unexpected:
        raise ValueError(f"{weights}: weights do not fit {p}/config.json: missing {missing}, "
                         f"unexpected {unexpected}")
    return head.to(dtype)
