"""GRPO: group-relative advantages and the clipped policy-gradient loss
(Shao et al. 2024, DeepSeekMath, arXiv 2402.03300, Eq. 3)."""

from __future__ import annotations

import torch

from rayspec.config import KL_TYPES, LOSS_AGG_MODES


def group_advantages(rewards: list[float], group: list[int], eps: float = 1e-6,
                     norm_by_std: bool = True) -> list[float]:
    """A_i = (r_i - mean(r_group)) / (std(r_group) + eps), per sample
    (GRPO, Shao et al. 2024, Eq. 3); without ``norm_by_std`` A_i = r_i -
    mean(r_group), as Dr. GRPO (Liu et al. 2025, arXiv 2503.20783, Sec. 3.2:
    dividing by the group's std weights questions by their difficulty).

    Args:
        rewards: per-sample scalar rewards.
        group: per-sample prompt index; samples of one prompt form a group.
        eps: guards groups whose rewards are all equal (advantage 0).
        norm_by_std: divide by the group's std (verl's ``norm_adv_by_std_in_grpo``).

    Returns:
        Per-sample advantages (floats), same order as ``rewards``.
    """
    r = torch.tensor(rewards, dtype=torch.float64)
    g = torch.tensor(group)
    adv = torch.zeros_like(r)
    for gid in g.unique():
        sel = g == gid
        rs = r[sel]
        adv[sel] = rs - rs.mean()
        if norm_by_std:
            std = rs.std(unbiased=False) if rs.numel() > 1 else torch.tensor(0.0, dtype=r.dtype)
            adv[sel] = adv[sel] / (std + eps)
    return adv.tolist()


def overlong_penalty(lengths: list[int], max_response_tokens: int, buffer_len: int,
                     penalty_factor: float) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476,
    Eq. 13), per response: 0 up to ``max_response_tokens - buffer_len``
    tokens, then falling linearly to ``-penalty_factor`` at
    ``max_response_tokens`` (and below it beyond, which a capped rollout
    does not reach).

    Args:
        lengths: response lengths (tokens).
        max_response_tokens: the length cap L_max (tokens).
        buffer_len: the buffer L_cache (tokens), 0 < buffer_len < L_max.
        penalty_factor: the penalty at L_max (reward units).

    Returns:
        Per-response penalties (<= 0), to add to the rewards.
    """
    expected = max_response_tokens - buffer_len
    return [min(0.0, (expected - n) / buffer_len * penalty_factor) for n in lengths]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(x_{t+1} | x_<=t) from logits [B, L, V] -> [B, L-1] (fp32)."""
    logits = logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens'
    logprobs (Schulman 2020, "Approximating KL Divergence"), with r =
    p_ref / p: ``k1`` = -log r, ``k2`` = (log r)^2 / 2, ``k3`` = r - 1 - log r
    (unbiased and non-negative; GRPO's, Shao et al. 2024, Eq. 4).

    Args:
        logprobs, ref_logprobs: [B, T] float32, same device.
        kl_type: ``k1``, ``k2`` or ``k3``.

    Raises:
        ValueError: an unknown ``kl_type``.
    """
    log_r = ref_logprobs - logprobs
    if kl_type == "k1":
        return -log_r
    if kl_type == "k2":
        return 0.5 * log_r.square()
    if kl_type == "k3":
        return log_r.exp() - log_r - 1
    raise ValueError(f"kl_type {kl_type!r}: expected one of {KL_TYPES}")


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, loss_agg_mode: str,
                   max_response_tokens: int | None = None) -> torch.Tensor:
    """A scalar loss from per-token losses, as verl's ``loss_agg_mode``:

    - ``token-mean``: over all response tokens of the batch (DAPO, Yu et
      al. 2025, arXiv 2503.14476, Eq. 8: long responses weigh more);
    - ``seq-mean-token-mean``: each response's token mean, then the mean
      over responses (GRPO, Shao et al. 2024, Eq. 3);
    - ``seq-mean-token-sum-norm``: each response's token sum divided by a
      constant, ``max_response_tokens``, then the mean over responses
      (Dr. GRPO, Liu et al. 2025, arXiv 2503.20783, Eq. 4: no length bias).

    Args:
        per_token: [B, T] float32 losses; mask: [B, T] 1.0 on response tokens.
        max_response_tokens: the constant of ``seq-mean-token-sum-norm``
            (tokens; rayspec passes ``grpo.max_new_tokens``); None: T.

    Raises:
        ValueError: an unknown ``loss_agg_mode``.
    """
    if loss_agg_mode == "token-mean":
        return masked_mean(per_token, mask)
    if loss_agg_mode == "seq-mean-token-mean":
        return masked_mean(per_token, mask, dim=1).mean()
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return ((per_token * mask).sum(dim=1) / (max_response_tokens or mask.shape[-1])).mean()
    raise ValueError(f"loss_agg_mode {loss_agg_mode!r}: expected one of {LOSS_AGG_MODES}")


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, clip_eps: float | tuple[float, float], ref_logprobs: torch.Tensor | None = None,
              kl_coef: float = 0.0, kl_type: str = "k3", loss_agg_mode: str = "seq-mean-token-mean",
              max_response_tokens: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate (PPO, Schulman et al. 2017, Eq. 7) with GRPO's KL
    term (Shao et al. 2024, Eq. 3), aggregated by ``aggregate_loss``.

    The importance ratio is taken against the rollout engine's logprobs
    (the behaviour policy that actually sampled the tokens).

    Args:
        logprobs: [B, T] current policy logprobs of the sampled tokens.
        old_logprobs: [B, T] rollout (behaviour-policy) logprobs.
        advantages: [B] per-sequence advantages.
        mask: [B, T] 1.0 on response tokens.
        clip_eps: the ratio's clip range, symmetric (eps: [1 - eps, 1 + eps])
            or (low, high): [1 - low, 1 + high], DAPO's clip-higher (Yu et
            al. 2025, arXiv 2503.14476, Eq. 10).
        ref_logprobs: [B, T] reference-policy logprobs for the KL term,
            used when kl_coef > 0.
        kl_coef: KL weight; kl_type: its estimator (``kl_estimate``).
        loss_agg_mode, max_response_tokens: see ``aggregate_loss``.

    Returns:
        (scalar loss, metrics: clip_frac, ratio_mean, and kl where the KL
        term is on).
    """
    low, high = clip_eps if isinstance(clip_eps, tuple) else (clip_eps, clip_eps)
    log_ratio = (logprobs - old_logprobs) * mask
    ratio = log_ratio.exp()
    adv = advantages[:, None]
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - low, 1 + high) * adv)
    per_token = -surr
    kl = None  # not measured without the term: logging 0.0 would claim the policy sits at the reference
    if kl_coef > 0 and ref_logprobs is not None:
        kl_tokens = kl_estimate(logprobs * mask, ref_logprobs * mask, kl_type)  # 0 off the response
        per_token = per_token + kl_coef * kl_tokens
        kl = masked_mean(kl_tokens, mask)
    loss = aggregate_loss(per_token, mask, loss_agg_mode, max_response_tokens)
    with torch.no_grad():
        clipped = ((ratio - 1 > high) | (1 - ratio > low)).float()
        metrics = {"clip_frac": masked_mean(clipped, mask).item(), "ratio_mean": masked_mean(ratio, mask).item()}
        if kl is not None:
            metrics["kl"] = kl.item()
    return loss, metrics


def token_mult_prob_error(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                          mask: torch.Tensor) -> float:
    """mean |exp(logp_train - logp_rollout) - 1| over response tokens: how far
    the trainer's and the rollout engine's probabilities of the same tokens
    disagree (NeMo-RL's token_mult_prob_error)."""
    return masked_mean(((logprobs - rollout_logprobs) * mask).exp().sub(1).abs(), mask).item()
