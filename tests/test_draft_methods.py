"""Draft paths chosen by one config key: ``method: mtp`` passes through to
vLLM for a model with native MTP layers (a tiny ERNIE-4.5, which vLLM's CPU
build loads), ``method: suffix`` drafts from Arctic Inference's suffix tree,
and decoding stays the policy's own."""

from __future__ import annotations

import pytest
import torch

from rayspec.config import load_config
from tests.conftest import engine_kwargs


@pytest.fixture(scope="module")
def tiny_ernie_mtp_dir(tmp_path_factory, smollm2_dir):
    from rayspec.models import make_tiny_ernie_mtp

    return make_tiny_ernie_mtp(tmp_path_factory.mktemp("ernie") / "model", smollm2_dir)


@pytest.mark.slow
def test_mtp_from_config_drafts_and_greedy_matches_the_policy(tiny_ernie_mtp_dir, in_process_engine_core):
    from rayspec.models import load_policy
    from rayspec.rollout.engine import SpecVLLMEngine, cpu_engine_env, speculative_config_for_vllm

    cfg = load_config(None, [f"model.path={tiny_ernie_mtp_dir}", "model.dtype=float32",
                             "rollout.speculative_config.method=mtp",
                             "rollout.speculative_config.num_speculative_tokens=1"])
    spec = speculative_config_for_vllm(vars(cfg.rollout.speculative_config))
    assert spec == {"method": "mtp", "num_speculative_tokens": 1}  # no draft directory: the model's own layer
    eng = SpecVLLMEngine(str(tiny_ernie_mtp_dir), spec, dtype=cfg.model.dtype,
                         engine_kwargs=engine_kwargs(max_num_seqs=4), env=cpu_engine_env(1, "all"))
    prompts = [[1, 504, 2118, 314, 216], [1, 9151, 28, 253, 1848, 30]]
    try:
        batch, stats = eng.generate(prompts, n=1, temperature=0.0, max_tokens=12)
    finally:
        eng.shutdown()
    assert stats.num_drafts > 0 and len(stats.acceptance_rate_per_pos) == 1  # the MTP layer drafted
    policy = load_policy(tiny_ernie_mtp_dir).eval()
    for p, got in zip(prompts, batch.response_ids):
        with torch.no_grad():
            want = policy.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                                   eos_token_id=None)[0, len(p):]
        assert got == want.tolist()


@pytest.mark.slow
def test_suffix_from_config_drafts_and_greedy_matches_the_policy(tiny_llama_dir, in_process_engine_core):
    """vLLM's ``suffix`` method needs arctic-inference (built by install_node.sh)."""
    from rayspec.models import load_policy
    from rayspec.rollout.engine import SpecVLLMEngine, cpu_engine_env, speculative_config_for_vllm

    cfg = load_config(None, [f"model.path={tiny_llama_dir}", "model.dtype=float32",
                             "rollout.speculative_config.method=suffix",
                             "rollout.speculative_config.num_speculative_tokens=4"])
    spec = speculative_config_for_vllm(vars(cfg.rollout.speculative_config))
    assert spec == {"method": "suffix", "num_speculative_tokens": 4}
    eng = SpecVLLMEngine(str(tiny_llama_dir), spec, dtype=cfg.model.dtype,
                         engine_kwargs=engine_kwargs(max_num_seqs=4), env=cpu_engine_env(1, "all"))
    prompts = [[1, 504, 2118, 314, 216] * 6, [1, 9151, 28, 253, 1848, 30] * 5]  # repeats the tree can match
    try:
        batch, stats = eng.generate(prompts, n=1, temperature=0.0, max_tokens=24)
    finally:
        eng.shutdown()
    assert stats.num_drafts > 0 and stats.acceptance_length > 1.0  # the suffix tree drafted, and some held
    policy = load_policy(tiny_llama_dir).eval()
    for p, got in zip(prompts, batch.response_ids):
        with torch.no_grad():
            want = policy.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                                   eos_token_id=None)[0, len(p):]
        assert got == want.tolist()
