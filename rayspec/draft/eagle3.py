"""EAGLE-3 draft head (Li et al. 2025, "EAGLE-3: Scaling up Inference
Acceleration of Large Language Models via Training-Time Test", arXiv 2503.01840)
in the checkpoint format vLLM's ``eagle3`` method loads
(``LlamaForCausalLMEagle3``: ``fc``, ``midlayer.*``, ``norm``, ``lm_head``).

The head reads three verifier hidden states (the inputs of the layers in
``eagle_aux_hidden_state_layer_ids``, concatenated: [*, 3H]), projects them
with ``fc`` to H, and runs one decoder layer whose attention takes
[norm(embed(next token)), norm(hidden)] (2H). Its output (pre-norm) is the
hidden state of the next draft step. The draft vocabulary is the policy's
(no d2t/t2d maps), and the embedding is shared with the policy: vLLM uses the
verifier's ``embed_tokens`` when the checkpoint has none, so the head follows
policy refits for free.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from rayspec.devices import to_host

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

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, k = _rope(q, pos, self.theta), _rope(k, pos, self.theta)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.nh != self.nkv)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


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

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor):
        """One draft step, mirroring vLLM's ``llama_eagle3.LlamaModel.forward``.

        Args:
            embeds: [B, T, H] embeddings of the tokens fed at this step.
            hidden: [B, T, H] ``fc`` output (step 0) or the previous step's
                pre-norm output.
            pos: [B, T] int64 positions of the fed tokens.

        Returns:
            (normed [B, T, H] for ``lm_head``, prenorm [B, T, H] for the next step).
        """
        layer = self.midlayer
        residual = hidden
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], -1)
        x = layer.self_attn(x, pos)
        residual = x + residual
        x = layer.mlp(layer.post_attention_layernorm(residual))
        prenorm = x + residual
        return self.norm(prenorm), prenorm


def head_config(policy_config: dict, aux_layer_ids: Optional[list[int]] = None) -> dict:
    """Config of an EAGLE-3 head for a Llama-family policy (HF config dict).

    Raises:
        ValueError: the policy is not Llama-family or too shallow.
    """
    if policy_config.get("model_type") not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ValueError(f"EAGLE-3 head needs a Llama-family policy, got model_type="
                         f"{policy_config.get('model_type')!r}")
    L = policy_config["num_hidden_layers"]
    ids = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(L)
    if any(not 0 <= i < L for i in ids) or len(ids) != 3:
        raise ValueError(f"draft.aux_hidden_state_layer_ids={ids}: need 3 ids in [0, {L})")
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
        "vocab_size": policy_config["vocab_size"],
        "draft_vocab_size": policy_config["vocab_size"],
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids},
    }
    return cfg


def init_head(policy, aux_layer_ids: Optional[list[int]] = None, seed: int = 0) -> Eagle3Head:
    """A new head for ``policy`` (a transformers Llama causal LM).

    ``lm_head`` and ``norm`` start from the policy's (so step-0 drafts read
    the policy's own output space); the MLP and o_proj from its last layer;
    ``fc`` and q/k/v at random (std 0.02).
    """
    cfg = head_config(policy.config.to_dict(), aux_layer_ids)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    for p in head.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    last = policy.model.layers[-1]
    with torch.no_grad():
        head.lm_head.weight.copy_(policy.lm_head.weight)
        head.norm.weight.copy_(policy.model.norm.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(head.midlayer.mlp, name).weight.copy_(getattr(last.mlp, name).weight)
        head.midlayer.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight)
        head.midlayer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
    return head


def vllm_state_dict(head: Eagle3Head, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The head's weights under vLLM's checkpoint names (host copies)."""
    return to_host(head.state_dict(), dtype)


def save_head(head: Eagle3Head, out_dir: str | os.PathLike) -> Path:
    """Write config.json + model.safetensors atomically (temp dir, then rename).

    A checkpoint already at ``out_dir`` is replaced only once the new one is
    complete.
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        (tmp / "config.json").write_text(json.dumps(head.cfg, indent=2))
        save_file(vllm_state_dict(head), str(tmp / "model.safetensors"))
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}-old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_head(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """Load a head written by ``save_head`` (or any vLLM EAGLE-3 checkpoint
    without d2t maps).

    Raises:
        FileNotFoundError: no config.json / model.safetensors under ``path``.
        ValueError: not an EAGLE-3 Llama head, or a head with a reduced draft
            vocabulary (d2t/t2d maps), which this trainer does not handle yet.
    """
    p = Path(path)
    if not (p / "config.json").is_file() or not (p / "model.safetensors").is_file():
        raise FileNotFoundError(f"{p}: expected config.json and model.safetensors")
    cfg = json.loads((p / "config.json").read_text())
    if ARCHITECTURE not in cfg.get("architectures", []):
        raise ValueError(f"{p}/config.json: architectures={cfg.get('architectures')}, expected {ARCHITECTURE}")
    cfg.setdefault("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    cfg.setdefault("draft_vocab_size", cfg["vocab_size"])
    if cfg["draft_vocab_size"] != cfg["vocab_size"]:
        raise ValueError(f"{p}/config.json: draft_vocab_size={cfg['draft_vocab_size']} != "
                         f"vocab_size={cfg['vocab_size']}: reduced draft vocabularies are not supported yet")
    head = Eagle3Head(cfg)
    sd = load_file(str(p / "model.safetensors"))
    sd = {k: v for k, v in sd.items() if k not in ("d2t", "t2d")}
    head.load_state_dict(sd)
    return head.to(dtype)
