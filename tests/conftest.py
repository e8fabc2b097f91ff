"""Shared fixtures: the bundled model, a tiny random Llama, one Ray session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SHARED = Path(__file__).resolve().parents[2] / "shared"
CACHE_DIR = os.environ.get("RAYSPEC_CACHE_DIR", "~/.cache/rayspec")
# what every metrics.jsonl record holds (README "Running")
STEP_RECORD_KEYS = {"step", "reward_mean", "acceptance_length", "acceptance_rate_per_pos",
                    "rollout_tokens_per_s", "time_rollout_s", "time_policy_s", "time_draft_s",
                    "time_sync_s", "policy_version", "response_lens", "prompt_len_mean", "sample"}


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from rayspec.models import materialize_bundled_model

    return materialize_bundled_model(CACHE_DIR)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    """Random 8-layer Llama (hidden 128, head_dim 64) with SmolLM2's tokenizer."""
    from rayspec.models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", smollm2_dir)


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    d = SHARED / "data" / "gsm8k"
    assert (d / "train.jsonl").is_file(), f"GSM8K copy missing at {d} (shared/ must sit beside the repo)"
    return d


def engine_kwargs(**kw):
    base = {"enforce_eager": True, "max_model_len": 512, "max_num_seqs": 16, "seed": 0}
    base.update(kw)
    return base
