"""GRPO math and the batch layout the trainer consumes."""

from __future__ import annotations

import math
import re

import pytest
import torch

from rayspec.batch import RolloutBatch
from rayspec.train.grpo import (group_advantages, grpo_loss, kl_estimate, overlong_penalty, token_logprobs,
                                token_mult_prob_error)


def test_group_advantages_normalise_within_groups():
    adv = group_advantages([1.0, 0.0, 1.0, 1.0, 0.0, 0.0], [0, 0, 0, 1, 1, 1])
    assert adv[0] == pytest.approx(adv[2]) and adv[0] > 0 > adv[1]
    assert sum(adv[:3]) == pytest.approx(0.0, abs=1e-6)
    assert adv[3] > 0 > adv[4] and adv[4] == pytest.approx(adv[5])
    # a group where every sample got the same reward carries no signal
    assert group_advantages([1.0, 1.0], [7, 7]) == [0.0, 0.0]


def test_grpo_loss_on_policy_is_minus_mean_advantage_and_clips():
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.5, 0.5, 0.5]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -1.0])
    loss, m = grpo_loss(lp, lp, adv, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(0.0, abs=1e-6)  # ratio 1: -(1 + -1)/2
    assert m["ratio_mean"] == pytest.approx(1.0) and m["clip_frac"] == 0.0
    # a large ratio on a positive advantage is clipped at 1 + eps
    loss_c, m_c = grpo_loss(lp + 1.0, lp, torch.tensor([1.0, 1.0]), mask, clip_eps=0.2)
    assert loss_c.item() == pytest.approx(-1.2, abs=1e-5)
    assert m_c["clip_frac"] == 1.0


def test_grpo_gradient_raises_logprob_of_advantaged_tokens():
    logits = torch.zeros(1, 4, 5, requires_grad=True)
    ids = torch.tensor([[0, 1, 2, 3]])
    lp = token_logprobs(logits, ids)
    loss, _ = grpo_loss(lp, lp.detach(), torch.tensor([1.0]), torch.ones(1, 3), 0.2)
    loss.backward()
    # descending the loss must increase the sampled tokens' logits
    assert (logits.grad[0, torch.arange(3), ids[0, 1:]] < 0).all()


def test_kl_term_is_zero_at_reference_and_positive_away():
    lp = torch.log(torch.tensor([[0.5, 0.5]]))
    mask = torch.ones(1, 2)
    _, m0 = grpo_loss(lp, lp, torch.zeros(1), mask, 0.2, ref_logprobs=lp, kl_coef=0.1)
    _, m1 = grpo_loss(lp, lp, torch.zeros(1), mask, 0.2, ref_logprobs=lp - 0.5, kl_coef=0.1)
    assert m0["kl"] == pytest.approx(0.0) and m1["kl"] > 0
    _, off = grpo_loss(lp, lp, torch.zeros(1), mask, 0.2, ref_logprobs=lp - 0.5, kl_coef=0.0)
    assert "kl" not in off  # unmeasured, not 0


def test_token_mult_prob_error():
    a = torch.log(torch.tensor([[0.5, 0.2]]))
    assert token_mult_prob_error(a, a, torch.ones(1, 2)) == pytest.approx(0.0)
    assert token_mult_prob_error(a, a - torch.log(torch.tensor(2.0)), torch.ones(1, 2)) == pytest.approx(1.0)


def test_padded_batch_aligns_response_tokens_with_logits():
    b = RolloutBatch(prompt_ids=[[5, 6, 7], [5, 6]], response_ids=[[8, 9], [10]],
                     rollout_logprobs=[[-0.1, -0.2], [-0.3]], group=[0, 1], advantages=[1.0, -1.0])
    t = b.to_padded(pad_id=0)
    assert t["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 6, 10, 0, 0]]
    assert t["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    # logits at position s predict token s+1: the response starts at s = len(prompt) - 1
    assert t["response_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    assert t["rollout_logprobs"][0, 2:].tolist() == pytest.approx([-0.1, -0.2])
    assert t["rollout_logprobs"][1, 1].item() == pytest.approx(-0.3)


def test_batch_shard_and_concat_roundtrip():
    b = RolloutBatch([[1]] * 4, [[2], [3], [4], [5]], [[0.0]] * 4, [0, 0, 1, 1],
                     policy_version=3, rewards=[1, 0, 1, 0], advantages=[1, -1, 1, -1], texts=list("abcd"),
                     weight_versions=[[(3, 0, 1)], [(3, 0, 1)], [(4, 0, 1)], [(3, 0, 0), (4, 0, 1)]])
    parts = [b.shard(r, 2) for r in range(2)]
    assert parts[1].response_ids == [[4], [5]] and parts[1].rewards == [1, 0]
    assert parts[1].weight_versions == [[(4, 0, 1)], [(3, 0, 0), (4, 0, 1)]]
    assert RolloutBatch.gather([(b, [3])]).weight_versions == [[(3, 0, 0), (4, 0, 1)]]
    assert RolloutBatch.concat(parts) == b
    # a shard retried on a replica with newer weights: the batch counts as its oldest part
    newer = RolloutBatch([[1]], [[6]], [[0.0]], [0], policy_version=4)
    assert RolloutBatch.concat([newer, parts[0]]).policy_version == 3
    with pytest.raises(ValueError, match="no rollouts"):
        RolloutBatch.concat([])


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", -7 / 5),                        # all 5 response tokens weigh the same
    ("seq-mean-token-mean", -(2 + 1) / 2),         # each response's mean, then their mean
    ("seq-mean-token-sum-norm", -(4 / 4 + 3 / 4) / 2),  # token sums over max_response_tokens=4
])
def test_loss_aggregation_modes_by_hand(mode, expected):
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.5, 0.5, 0.5]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # on policy (ratio 1): the per-token loss is -advantage
    loss, _ = grpo_loss(lp, lp, torch.tensor([2.0, 1.0]), mask, 0.2, loss_agg_mode=mode, max_response_tokens=4)
    assert loss.item() == pytest.approx(expected)
    with pytest.raises(ValueError, match="loss_agg_mode 'seq-sum'"):
        grpo_loss(lp, lp, torch.tensor([2.0, 1.0]), mask, 0.2, loss_agg_mode="seq-sum")


def test_clip_higher_widens_only_the_upper_bound():
    """DAPO's clip-higher: a ratio of e^0.25 = 1.284 on a positive advantage
    is clipped at 1.2 symmetrically and at 1.28 with clip_ratio_high=0.28; a
    ratio of e^-0.5 = 0.607 on a negative advantage at 1 - low."""
    mask = torch.ones(1, 1)
    up = torch.tensor([[0.25]])
    zero = torch.zeros(1, 1)
    assert grpo_loss(up, zero, torch.tensor([1.0]), mask, 0.2)[0].item() == pytest.approx(-1.2)
    loss, m = grpo_loss(up, zero, torch.tensor([1.0]), mask, (0.2, 0.28))
    assert loss.item() == pytest.approx(-1.28) and m["clip_frac"] == 1.0
    loss, m = grpo_loss(up, zero, torch.tensor([1.0]), mask, (0.2, 0.3))
    assert loss.item() == pytest.approx(-math.exp(0.25)) and m["clip_frac"] == 0.0
    down = torch.tensor([[-0.5]])
    assert grpo_loss(down, zero, torch.tensor([-1.0]), mask, (0.2, 0.28))[0].item() == pytest.approx(0.8)
    assert grpo_loss(down, zero, torch.tensor([-1.0]), mask, (0.1, 0.28))[0].item() == pytest.approx(0.9)


def test_advantages_without_std_are_dr_grpo_s():
    rewards, group = [1.0, 0.0, 0.0, 0.0, 3.0, 1.0], [0, 0, 0, 0, 1, 1]
    assert group_advantages(rewards, group, norm_by_std=False) == pytest.approx([0.75, -0.25, -0.25, -0.25, 1.0, -1.0])
    # with the std (0.433 and 1.0): 0.75 / 0.433 = sqrt(3)
    assert group_advantages(rewards, group)[0] == pytest.approx(math.sqrt(3), rel=1e-5)
    assert group_advantages(rewards, group)[4:] == pytest.approx([1.0, -1.0], rel=1e-5)


@pytest.mark.parametrize("kl_type, expected", [
    ("k1", math.log(2)),                    # log p - log p_ref, p = 0.5, p_ref = 0.25
    ("k2", 0.5 * math.log(2) ** 2),
    ("k3", 0.5 - 1 + math.log(2)),          # r - 1 - log r, r = p_ref / p = 0.5
])
def test_kl_estimators_by_hand(kl_type, expected):
    lp, ref = torch.log(torch.tensor([[0.5, 0.5]])), torch.log(torch.tensor([[0.25, 0.25]]))
    mask = torch.tensor([[1.0, 0.0]])  # the second token is padding: no KL there
    assert kl_estimate(lp, ref, kl_type)[0, 0].item() == pytest.approx(expected)
    loss, m = grpo_loss(lp, lp, torch.zeros(1), mask, 0.2, ref_logprobs=ref, kl_coef=0.1, kl_type=kl_type)
    assert m["kl"] == pytest.approx(expected) and loss.item() == pytest.approx(0.1 * expected)


@pytest.mark.parametrize("override, message", [
    ("grpo.loss_agg_mode=seq-sum", "grpo.loss_agg_mode='seq-sum': expected one of"),
    ("grpo.kl_type=k4", "grpo.kl_type='k4': expected one of"),
    ("grpo.clip_ratio_low=1.5", "grpo.clip_ratio_low=1.5: must be < 1"),
    ("grpo.clip_ratio_high=-0.1", "grpo.clip_ratio_high=-0.1: must be > 0"),
])
def test_grpo_variant_keys_are_checked(override, message):
    from rayspec.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


def test_clip_range_defaults_to_clip_eps():
    from rayspec.config import load_config

    assert load_config(None, ["grpo.clip_eps=0.1"]).grpo.clip_range == (0.1, 0.1)
    assert load_config(None, ["grpo.clip_ratio_high=0.28"]).grpo.clip_range == (0.2, 0.28)


def test_overlong_penalty_by_hand():
    """DAPO Eq. 13 with L_max = 10, L_cache = 4: free up to 6 tokens, then
    -1/4 per token down to -1 at the cap (scaled by the factor)."""
    assert overlong_penalty([5, 6, 7, 8, 10], 10, 4, 1.0) == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty([8, 10], 10, 4, 0.5) == [-0.25, -0.5]


@pytest.mark.parametrize("overrides, message", [
    (["grpo.overlong_buffer.enabled=true"],
     "grpo.overlong_buffer.len=0: must be an integer in (0, grpo.max_new_tokens=128)"),
    (["grpo.overlong_buffer.enabled=true", "grpo.overlong_buffer.len=128"], "grpo.overlong_buffer.len=128"),
    (["grpo.overlong_buffer.enabled=true", "grpo.overlong_buffer.len=16", "grpo.overlong_buffer.penalty_factor=-1"],
     "grpo.overlong_buffer.penalty_factor=-1"),
])
def test_overlong_buffer_keys_are_checked(overrides, message):
    from rayspec.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)
    assert load_config(None, overrides[1:]).grpo.overlong_buffer.enabled is False  # off: not checked


def test_gather_keeps_chosen_groups_renumbered_and_sequential_rounds_add_their_seconds():
    """What dynamic sampling builds a refilled batch from."""
    from rayspec.batch import RolloutBatch
    from rayspec.rollout.spec_stats import SpecStats

    a = RolloutBatch([[1]] * 4, [[10], [11], [12], [13]], [[-1.0]] * 4, [0, 0, 1, 1], policy_version=2,
                     texts=["a0", "a1", "a2", "a3"])
    b = RolloutBatch([[2]] * 2, [[20], [21]], [[-2.0]] * 2, [0, 0], policy_version=2, texts=["b0", "b1"])
    out = RolloutBatch.gather([(a, [2, 3]), (b, [0, 1])])
    assert out.response_ids == [[12], [13], [20], [21]] and out.group == [0, 0, 1, 1]
    assert out.texts == ["a2", "a3", "b0", "b1"] and out.policy_version == 2 and out.rewards == []
    # an async refill sampled by a newer policy: the batch counts as the oldest
    assert RolloutBatch.gather([(RolloutBatch([[1]], [[1]], [[0.0]], [0], policy_version=3), [0]),
                                (a, [0])]).policy_version == 2
    x = SpecStats(2, 6, 3, [2, 1, 0], 10, 1.5, {"r": SpecStats(2, 6, 3, [2, 1, 0], 10, 1.5)})
    y = SpecStats(1, 3, 1, [1, 0, 0], 4, 0.5, {"r": SpecStats(1, 3, 1, [1, 0, 0], 4, 0.5)})
    seq = x.then(y)
    assert (seq.num_drafts, seq.accepted_per_pos, seq.output_tokens, seq.wall_s) == (3, [3, 1, 0], 14, 2.0)
    assert seq.replicas["r"].wall_s == 2.0 and (x + y).wall_s == 1.5  # beside each other: the slower bounds it


@pytest.mark.parametrize("overrides, message", [
    (["grpo.max_sampling_rounds=0"], "grpo.max_sampling_rounds=0: must be an integer >= 1"),
])
def test_dynamic_sampling_keys_are_checked(overrides, message):
    from rayspec.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)
    assert load_config(None, ["grpo.dynamic_sampling=true"]).grpo.max_sampling_rounds == 3
