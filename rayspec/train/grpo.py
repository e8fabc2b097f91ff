"""GRPO: group-relative advantages and the clipped policy-gradient loss
(Shao et al. 2024, DeepSeekMath, arXiv 2402.03300, Eq. 3)."""

from __future__ import annotations

import torch


def group_advantages(rewards: list[float], group: list[int], eps: float = 1e-6) -> list[float]:
    """A_i = (r_i - mean(r_group)) / (std(r_group) + eps), per sample.

    Args:
        rewards: per-sample scalar rewards.
        group: per-sample prompt index; samples of one prompt form a group.
        eps: guards groups whose rewards are all equal (advantage 0).

    Returns:
        Per-sample advantages (floats), same order as ``rewards``.
    """
    r = torch.tensor(rewards, dtype=torch.float64)
    g = torch.tensor(group)
    adv = torch.zeros_like(r)
    for gid in g.unique():
        sel = g == gid
        rs = r[sel]
        std = rs.std(unbiased=False) if rs.numel() > 1 else torch.tensor(0.0, dtype=r.dtype)
        adv[sel] = (rs - rs.mean()) / (std + eps)
    return adv.tolist()


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


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, clip_eps: float, ref_logprobs: torch.Tensor | None = None,
              kl_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate, token mean per sequence, then mean over sequences.

    The importance ratio is taken against the rollout engine's logprobs
    (the behaviour policy that actually sampled the tokens).

    Args:
        logprobs: [B, T] current policy logprobs of the sampled tokens.
        old_logprobs: [B, T] rollout (behaviour-policy) logprobs.
        advantages: [B] per-sequence advantages.
        mask: [B, T] 1.0 on response tokens.
        clip_eps: PPO clip epsilon.
        ref_logprobs: [B, T] reference-policy logprobs for the k3 KL
            estimator (Schulman 2020), used when kl_coef > 0.
        kl_coef: KL weight.

    Returns:
        (scalar loss, metrics: clip_frac, ratio_mean, and kl where the KL
        term is on).
    """
    log_ratio = (logprobs - old_logprobs) * mask
    ratio = log_ratio.exp()
    adv = advantages[:, None]
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    per_token = -surr
    kl = None  # not measured without the term: logging 0.0 would claim the policy sits at the reference
    if kl_coef > 0 and ref_logprobs is not None:
        d = (ref_logprobs - logprobs) * mask
        k3 = d.exp() - d - 1
        per_token = per_token + kl_coef * k3
        kl = masked_mean(k3, mask)
    loss = masked_mean(per_token, mask, dim=1).mean()
    with torch.no_grad():
        clipped = ((ratio - 1).abs() > clip_eps).float()
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
