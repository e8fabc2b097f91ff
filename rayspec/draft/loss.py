"""EAGLE-3 training objective with training-time test (TTT).

Li et al. 2025 (arXiv 2503.01840), Sec. 3: the head is unrolled for several
draft steps during training, each step fed its own previous output instead
of the verifier's features, and every step is trained with a soft
cross-entropy to the verifier's next-token distribution.

Alignment (positions t of one sequence, T tokens, verifier features f_t):
  step 0 at t: hidden fc(f_t),             token x_{t+1}, target p(. | x_<=t+1)
  step j at t: hidden prenorm_{j-1}(t),    token x_{t+1+j}, target p(. | x_<=t+1+j)
which is what vLLM's EAGLE-3 proposer feeds at inference (the fed tokens are
the policy's own samples, so teacher forcing matches the accepted path).
Step j of the chain starting at t attends to step 0's entries at t' <= t and
to its own chain's earlier steps: the paper's training-time-test mask, and
what vLLM's drafter cache holds when it drafts from t (its entries past the
accepted tokens are overwritten by the next verification's step 0). So on
the accepted path the head's step-j top-1 here is vLLM's j-th draft token
(tests/test_draft.py checks this against a replica's acceptance counts).

With a reduced draft vocabulary D (``head.draft_ids``) the cross-entropy runs
over D against the verifier's probabilities of D's tokens, not renormalised:
-sum_{v in D} p(v) log q(v) = m * CE(p|D / m, q), with m = p(D). A position
whose likely next tokens lie outside D (small m) weighs less, as it should:
whatever the head proposes there is mostly rejected. (The reference code
renormalises and masks positions whose verifier argmax is outside D; the
weight by m is the smooth form of that mask.)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from rayspec.draft.eagle3 import Eagle3Head


def _shift(x: torch.Tensor, j: int, fill=0) -> torch.Tensor:
    """x[:, t + j] at index t (dim 1), padded with ``fill`` past the end."""
    if j == 0:
        return x
    pad = x.new_full((x.shape[0], j, *x.shape[2:]), fill)
    return torch.cat([x[:, j:], pad], dim=1)


class DraftLoss(NamedTuple):
    """What ``eagle3_loss`` measured on one batch.

    Attributes:
        loss: scalar, averaged over steps and masked positions (autograd).
        top1: per draft step, the share of masked positions where the head's
            top-1 (as a policy token id) is the verifier's.
        accepted / chains: per draft position i, the sum over chain starts of
            the estimator of "the first i + 1 drafts are accepted", and the
            number of chain starts it was taken over (``acceptance_rates``
            divides them); empty unless a temperature was given.
    """

    loss: torch.Tensor
    top1: list[float]
    accepted: list[float]
    chains: list[int]


def eagle3_loss(head: Eagle3Head, input_ids: torch.Tensor, aux_hidden: torch.Tensor,
                final_hidden: torch.Tensor, loss_mask: torch.Tensor,
                embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                ttt_steps: int, temperature: float | None = None) -> DraftLoss:
    """Soft cross-entropy of the unrolled head against the verifier.

    Args:
        head: the draft head (fp32 parameters).
        input_ids: [B, L] int64 tokens of prompt + response.
        aux_hidden: [B, L, 3H] verifier hidden states at the aux layers.
        final_hidden: [B, L, H] verifier's final (post-norm) hidden states;
            target distribution at position s is softmax(final_hidden[s] @ lm_head_weight.T).
        loss_mask: [B, L-1] float, 1 where token s+1 is a response token (s indexes
            the target position).
        embed_weight: [V, H] verifier input embedding (the head shares it).
        lm_head_weight: [V, H] verifier output layer (the whole vocabulary:
            the target distribution is the verifier's).
        ttt_steps: draft steps unrolled (1 = plain EAGLE training).
        temperature: the sampling temperature (> 0) the responses were drawn
            at: also estimate the acceptance of greedy drafts at it
            (``acceptance_rates``). None: no estimate.

    Returns:
        ``DraftLoss``.
    """
    B, L = input_ids.shape
    dtype = head.fc.weight.dtype
    mask = torch.cat([loss_mask, loss_mask.new_zeros(B, 1)], 1)  # [B, L]
    ids = head.draft_ids
    total, agree, accepted, chains = 0.0, [], [], []
    valid = torch.ones(B, L, dtype=torch.bool, device=input_ids.device)  # chains reaching step j
    on_path = torch.ones(B, L, device=input_ids.device)  # drafts before j were the sampled tokens
    for j, normed in unroll(head, input_ids, aux_hidden, embed_weight, ttt_steps):
        m = _shift(mask, 1 + j).bool()
        if not m.any():
            break
        tgt_h = _shift(final_hidden, 1 + j)[m].to(dtype)
        logits = head.lm_head(normed[m])  # [n, N]
        drafted = logits.argmax(-1) if ids is None else ids[logits.argmax(-1)]
        with torch.no_grad():
            tgt_logits = tgt_h @ lm_head_weight.to(dtype).T  # [n, V]
            target = torch.softmax(tgt_logits, dim=-1)
            if temperature == 1.0:  # RL's usual temperature: no second [n, V] tensor
                p_draft = target.gather(1, drafted[:, None])[:, 0]
            elif temperature is not None:
                p_draft = (tgt_logits.gather(1, drafted[:, None])[:, 0] / temperature
                           - torch.logsumexp(tgt_logits / temperature, dim=-1)).exp()
            del tgt_logits
        in_vocab = target if ids is None else target[:, ids]
        total = total + -(in_vocab * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
        agree.append((drafted == target.argmax(-1)).float().mean().item())
        if temperature is not None:
            with torch.no_grad():
                a, hit = torch.zeros_like(on_path), torch.zeros_like(on_path)
                a[m], hit[m] = p_draft.to(a.dtype), (drafted == _shift(input_ids, 2 + j)[m]).to(a.dtype)
                valid &= m
                accepted.append((on_path * a)[valid].sum().item())
                chains.append(int(valid.sum()))
                on_path = on_path * hit
    return DraftLoss(total / max(len(agree), 1), agree, accepted, chains)


def acceptance_rates(accepted: list[float], chains: list[int]) -> list[float]:
    """Per-position acceptance rates r_i = P(drafts 0..i all accepted) from
    ``DraftLoss.accepted`` / ``chains`` summed over batches (positions no
    chain reached are left out).

    The estimator (for greedy drafts d_j, which vLLM verifies by accepting
    d_j with the target's probability p_T(d_j), Leviathan et al. 2023,
    Sec. 2.3, with a one-hot draft distribution): over chain starts t of
    responses sampled from the policy at temperature T,
    r_i = E_t[prod_{j<i} 1(x_{t+2+j} = d_j(t)) * p_T(d_i(t) | x_<=t+1+i)],
    the head's steps teacher forced on the sampled tokens. Where the sampled
    tokens are the drafts the teacher-forced states are the drafting ones, and
    by the tower rule E[1(x = d_j) f(x)] = p_T(d_j) f(d_j), so the estimate
    is unbiased for the rate vLLM would measure on those prompts. It holds
    for top_p = 1 and greedy drafts only (``draft_sample_method:
    probabilistic`` accepts with min(1, p/q) over sampled drafts).
    """
    return [a / c for a, c in zip(accepted, chains) if c > 0]


def unroll(head: Eagle3Head, input_ids: torch.Tensor, aux_hidden: torch.Tensor,
           embed_weight: torch.Tensor, steps: int):
    """The head's draft steps over every chain start of a sequence, teacher
    forced (alignment in the module docstring).

    Args:
        input_ids: [B, L] int64 tokens; aux_hidden: [B, L, 3H] verifier
            features; embed_weight: [V, H] verifier input embedding.
        steps: draft steps.

    Yields:
        (j, normed [B, L, H]): step j's output at each chain start t, which
        ``lm_head`` turns into the prediction of token t + 2 + j.
    """
    B, L = input_ids.shape
    dtype = head.fc.weight.dtype
    pos = torch.arange(L, device=input_ids.device).expand(B, L)
    hidden = head.fc(aux_hidden.to(dtype))
    chain: list = []
    for j in range(steps):
        # chain start t, step j: fed token x_{t+1+j} at position t+1+j
        embeds = F.embedding(_shift(input_ids, 1 + j), embed_weight).to(dtype)
        normed, hidden, kv = head.step(embeds, hidden, _shift(pos, 1 + j, fill=L), chain)
        chain.append(kv)
        yield j, normed


@torch.no_grad()
def draft_top1(head: Eagle3Head, input_ids: torch.Tensor, aux_hidden: torch.Tensor,
               embed_weight: torch.Tensor, steps: int) -> torch.Tensor:
    """[B, L, steps] int64 policy token ids: the head's greedy draft j from
    chain start t, given that the tokens it drafted before were the
    sequence's own. On a greedy rollout this is what vLLM drafts from t, so
    replaying a sequence predicts a replica's acceptance counts exactly."""
    ids = head.draft_ids
    out = []
    for _, normed in unroll(head, input_ids, aux_hidden, embed_weight, steps):
        top = head.lm_head(normed).argmax(-1)
        out.append(top if ids is None else ids[top])
    return torch.stack(out, -1)
