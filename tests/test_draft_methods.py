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


def _greedy_from_config(model_dir, method: str, k: int, prompts: list[list[int]], max_tokens: int,
                        k_per_call: tuple = (None,)):
    """Decode ``prompts`` greedily through the replica's engine with the draft
    ``rollout.speculative_config`` names (config -> vLLM's speculative_config,
    nothing else set), once per entry of ``k_per_call`` (None: the engine's
    fixed k; an int: that k at every batch size, switched at run time on an
    adaptive engine, whose controller then folds in each call), assert every
    response equals the HF policy's greedy continuation, and return the
    engine's SpecStats per call and its controller (None when k is fixed)."""
    from rayspec.models import load_policy
    from rayspec.rollout.adaptive import uniform
    from rayspec.rollout.engine import SpecVLLMEngine, cpu_engine_env, speculative_config_for_vllm

    cfg = load_config(None, [f"model.path={model_dir}", "model.dtype=float32",
                             f"rollout.speculative_config.method={method}",
                             f"rollout.speculative_config.num_speculative_tokens={k}"])
    spec = speculative_config_for_vllm(vars(cfg.rollout.speculative_config))
    assert spec == {"method": method, "num_speculative_tokens": k}  # no draft directory
    adaptive = None if k_per_call == (None,) else {}  # an adaptive replica
    eng = SpecVLLMEngine(str(model_dir), spec, dtype=cfg.model.dtype, engine_kwargs=engine_kwargs(max_num_seqs=4),
                         env=cpu_engine_env(1, "all"), adaptive_k=adaptive)
    calls = []
    try:
        for kk in k_per_call:
            if kk is not None:
                eng.set_k_schedule(uniform(kk, 4))
            calls.append(eng.generate(prompts, n=1, temperature=0.0, max_tokens=max_tokens))
    finally:
        eng.shutdown()
    policy = load_policy(model_dir).eval()
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = policy.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                                   eos_token_id=None)[0, len(p):]
        for batch, _ in calls:
            assert batch.response_ids[i] == want.tolist()
    return [stats for _, stats in calls], eng.adaptive


@pytest.mark.slow
def test_mtp_from_config_drafts_and_greedy_matches_the_policy(tiny_ernie_mtp_dir, in_process_engine_core):
    (stats,), _ = _greedy_from_config(tiny_ernie_mtp_dir, "mtp", 1,  # the model's own MTP layer drafts
                                      [[1, 504, 2118, 314, 216], [1, 9151, 28, 253, 1848, 30]], max_tokens=12)
    assert stats.num_drafts > 0 and len(stats.acceptance_rate_per_pos) == 1


@pytest.mark.slow
def test_suffix_from_config_drafts_at_the_scheduled_k_and_greedy_matches_the_policy(tiny_llama_dir,
                                                                                    in_process_engine_core):
    """vLLM's ``suffix`` method needs arctic-inference (built by install_node.sh).
    Its proposer asserts its configured k; adaptive k passes it the scheduled
    one (``adaptive._suffix_at_scheduled_k``): k = 2 drafts at most 2 tokens,
    k = 0 none, and the response is the policy's at every k. The controller
    measures the share of sequence-steps that carried a draft (f)."""
    prompts = [[1, 504, 2118, 314, 216] * 6, [1, 9151, 28, 253, 1848, 30] * 5]  # repeats the tree can match
    (full, two, none), ctl = _greedy_from_config(tiny_llama_dir, "suffix", 4, prompts, max_tokens=24,
                                                 k_per_call=(4, 2, 0))
    assert full.num_drafts > 0 and full.acceptance_length > 1.0  # the suffix tree drafted, and some held
    assert full.num_draft_tokens > 2 * full.num_drafts  # drafts longer than 2 where k allows
    assert two.num_drafts > 0 and two.num_draft_tokens <= 2 * two.num_drafts and two.accepted_per_pos[2:] == [0, 0]
    assert none.num_drafts == 0
    # a sequence's first token comes from its prefill, without a draft: f < 1
    assert 0 < ctl.draft_fraction < 1
