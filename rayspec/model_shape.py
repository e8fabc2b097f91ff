"""Model shapes for the memory plan (``rayspec.memory_plan``) and the
performance model (``rayspec.perfmodel``): what one forward pass reads and
computes, from a Hugging Face config.

Counts follow the usual transformer accounting (Kaplan et al. 2020, Table 1;
Narayanan et al. 2021, Sec. 5.1): a matmul with an (m x n) weight costs 2mn
FLOPs per token; attention over a context of c tokens costs 4 * c * q_dim
FLOPs per layer per query token (QK^T and AV); the KV cache holds
2 * layers * kv_heads * head_dim values per token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

# Public config.json fields of models used in the validation and the memory
# plan (Hugging Face Hub: Qwen/Qwen3-8B, Qwen/Qwen3-32B, Qwen/Qwen3-235B-A22B,
# meta-llama/Llama-3.1-8B, HuggingFaceTB/SmolLM2-135M-Instruct).
PRESETS: dict[str, dict] = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                         tie_word_embeddings=True),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                     tie_word_embeddings=False),
    "qwen3-32b": dict(model_type="qwen3", hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, head_dim=128, intermediate_size=25600, vocab_size=151936,
                      tie_word_embeddings=False),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
                         tie_word_embeddings=False),
    "qwen3-235b-a22b": dict(model_type="qwen3_moe", hidden_size=4096, num_hidden_layers=94,
                            num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                            intermediate_size=12288, moe_intermediate_size=1536, num_experts=128,
                            num_experts_per_tok=8, vocab_size=151936, tie_word_embeddings=False),
}


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only transformer that set its cost.

    Attributes:
        name: a label.
        layers: decoder layers.
        hidden_size: model width h.
        num_attention_heads / num_key_value_heads / head_dim: attention shape
            (q_dim = heads * head_dim; GQA when kv heads < heads).
        intermediate_size: dense MLP width (gated: 3 matrices h x i).
        vocab_size: output vocabulary (the LM head is h x vocab).
        num_experts / num_experts_per_tok / moe_intermediate_size: MoE MLP
            (0 experts: dense).
        extra_params: parameters outside the layers that every token uses
            (an EAGLE-3 head's fc projecting 3h -> h).
        qkv_in: input width of the q/k/v projections (h, or 2h for an
            EAGLE-3 layer that reads [embedding, hidden]).
        tied_embeddings: the LM head is the embedding table.
        qk_norm: RMSNorm over each head's q and k (Qwen3).
        checkpoint_dtype_bytes: bytes a weight takes in the checkpoint
            (config.json's ``dtype``; 2 where it names none).
    """

    name: str
    layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    extra_params: int = 0
    qkv_in: int = 0
    tied_embeddings: bool = False
    qk_norm: bool = False
    checkpoint_dtype_bytes: int = 2

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    def _attn_params(self) -> int:
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        return (self.qkv_in or h) * (self.q_dim + 2 * kv) + self.q_dim * h

    def _expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    def _dense_layer_params(self) -> int:
        """Parameters of one layer every token reads (attention, router, or a dense MLP)."""
        if self.num_experts:
            return self._attn_params() + self.hidden_size * self.num_experts
        return self._attn_params() + 3 * self.hidden_size * self.intermediate_size

    @property
    def params(self) -> int:
        """All matmul parameters (layers, LM head, extras; the embedding
        table is a lookup and is left out)."""
        experts = self.num_experts * self._expert_params()
        return self.layers * (self._dense_layer_params() + experts) + self.lm_head_params + self.extra_params

    def lora_params(self, r: int, target_modules="all-linear") -> int:
        """Parameters of a rank-``r`` LoRA adapter (A [r, in] and B [out, r])
        on the decoder layers' linear projections that ``target_modules``
        names (peft's: ``all-linear``, a list of q_proj, k_proj, v_proj,
        o_proj, gate_proj, up_proj, down_proj, or a regex, counted as
        all-linear: an upper bound). MoE layers: the dense MLP's width."""
        h, kv, i = self.hidden_size, self.num_key_value_heads * self.head_dim, self.intermediate_size
        q_in = self.qkv_in or h
        widths = {"q_proj": q_in + self.q_dim, "k_proj": q_in + kv, "v_proj": q_in + kv, "o_proj": self.q_dim + h,
                  "gate_proj": h + i, "up_proj": h + i, "down_proj": i + h}
        names = widths if isinstance(target_modules, str) else \
            [m for m in target_modules if m in widths] or widths
        return self.layers * r * sum(widths[m] for m in names)

    @property
    def lm_head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    @property
    def total_params(self) -> int:
        """Every parameter the checkpoint holds, counted once (what
        DeepSpeed's ``model_to_params`` counts): :attr:`params`, the
        embedding table unless tied, and the RMSNorm weights."""
        h = self.hidden_size
        norms = self.layers * (2 * h + (2 * self.head_dim if self.qk_norm else 0)) + h
        return self.params + (0 if self.tied_embeddings else self.vocab_size * h) + norms

    @property
    def largest_module_params(self) -> int:
        """Parameters of the largest single module (an nn.Module's own,
        not its children's): what ZeRO-3 gathers at once at most, as
        DeepSpeed's estimators count it."""
        h = self.hidden_size
        kv = self.num_key_value_heads * self.head_dim
        return max(self.vocab_size * h, (self.qkv_in or h) * max(self.q_dim, kv), self.q_dim * h,
                   h * max(self.intermediate_size, self.moe_intermediate_size), self.extra_params)

    @property
    def active_params(self) -> int:
        """Matmul parameters one token goes through (MoE: its top-k experts)."""
        experts = self.num_experts_per_tok * self._expert_params()
        return self.layers * (self._dense_layer_params() + experts) + self.lm_head_params + self.extra_params

    def flops(self, tokens: float, attended: float, logit_tokens: float | None = None) -> float:
        """FLOPs of a forward over ``tokens`` query tokens that attend to
        ``attended`` (query, key) pairs in all (sum over query tokens of its
        context length); the LM head runs over ``logit_tokens`` of them
        (default all; a prefill computes logits for each prompt's last
        token only, as vLLM does)."""
        logit_tokens = tokens if logit_tokens is None else logit_tokens
        return (2.0 * ((self.active_params - self.lm_head_params) * tokens + self.lm_head_params * logit_tokens)
                + 4.0 * self.layers * self.q_dim * attended)

    def weight_bytes(self, tokens: float, dtype_bytes: float) -> float:
        """Bytes of weights one forward over ``tokens`` tokens reads: all of a
        dense model; for an MoE the experts the tokens route to, with uniform
        routing (E[distinct experts] = E * (1 - (1 - k/E)^tokens) per layer)."""
        if not self.num_experts:
            return self.params * dtype_bytes
        touched = self.num_experts * (1.0 - (1.0 - self.num_experts_per_tok / self.num_experts) ** tokens)
        layer = self._dense_layer_params() + touched * self._expert_params()
        return (self.layers * layer + self.lm_head_params + self.extra_params) * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        """KV-cache bytes per token of context (all layers, K and V)."""
        return 2.0 * self.layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    def truncated(self, layers: int) -> ModelShape:
        """A draft model made of the first ``layers`` layers (same tokenizer,
        same LM head): ``draft_model`` speculation."""
        return replace(self, name=f"{self.name}[:{layers}]", layers=layers)

    def eagle3_head(self, draft_vocab_size: int | None = None) -> ModelShape:
        """The EAGLE-3 draft head for this model (Li et al. 2025, Sec. 3):
        fc 3h -> h over three verifier layers' features, one decoder layer
        whose q/k/v read [embedding, hidden] (2h), an LM head over the draft
        vocabulary (default: the full vocabulary, as rayspec trains it)."""
        return replace(self, name=f"{self.name}:eagle3", layers=1, num_experts=0, num_experts_per_tok=0,
                       intermediate_size=self.intermediate_size or self.moe_intermediate_size,
                       vocab_size=draft_vocab_size or self.vocab_size,
                       extra_params=3 * self.hidden_size * self.hidden_size, qkv_in=2 * self.hidden_size)

    def mtp_head(self) -> ModelShape:
        """A native multi-token-prediction module (DeepSeek-V3, Sec. 2.2):
        one decoder layer of the model itself plus a 2h -> h projection,
        sharing the model's LM head."""
        return replace(self, name=f"{self.name}:mtp", layers=1,
                       extra_params=2 * self.hidden_size * self.hidden_size)

    @classmethod
    def from_hf_config(cls, source: str | Path | dict) -> ModelShape:
        """Read a shape from a Hugging Face config.

        Args:
            source: a model directory or a config.json path (read with
                ``transformers.AutoConfig``), a preset name (``PRESETS``), or
                a dict of config.json fields with ``model_type``.

        Raises:
            ValueError: ``source`` is neither a preset, a path, nor a dict
                with ``model_type``; or the config lacks a field the model
                needs (named in the message).
        """
        from transformers import AutoConfig

        name = str(source)
        if isinstance(source, dict):
            fields = dict(source)
            if "model_type" not in fields:
                raise ValueError("model config dict: missing 'model_type'")
            cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
        elif str(source).lower() in PRESETS:
            name = str(source).lower()
            fields = dict(PRESETS[name])
            cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
        else:
            path = Path(source)
            if not path.exists():
                raise ValueError(f"--model {source}: not a preset ({', '.join(PRESETS)}) and no such path")
            cfg = AutoConfig.from_pretrained(path.parent if path.is_file() else path)
            name = path.name if path.is_dir() else path.parent.name
        cfg = getattr(cfg, "text_config", None) or cfg
        try:
            heads = cfg.num_attention_heads
            return cls(
                name=name, layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                num_attention_heads=heads,
                num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                intermediate_size=getattr(cfg, "intermediate_size", 0) or 0,
                vocab_size=cfg.vocab_size,
                num_experts=getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None) or 0,
                num_experts_per_tok=getattr(cfg, "num_experts_per_tok", None) or 0,
                moe_intermediate_size=getattr(cfg, "moe_intermediate_size", None) or 0,
                tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
                qk_norm=cfg.model_type in ("qwen3", "qwen3_moe"),
                checkpoint_dtype_bytes=4 if str(getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
                                               ).removeprefix("torch.") == "float32" else 2)
        except AttributeError as e:
            raise ValueError(f"{name}: config lacks a field the performance model needs ({e})") from None
