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

With sampled drafts (vLLM's ``draft_sample_method: probabilistic``) a draft
token x ~ q is accepted with probability min(1, p(x) / q(x)), so a position
is accepted with sum_v min(p(v), q(v)) = 1 - TV(p, q) (Leviathan et al. 2023,
arXiv 2211.17192, Sec. 3). Cross-entropy only bounds TV (Pinsker), so
``tv_weight`` adds w * TV(p, q) per draft step: the divergence the decoding
uses, as DistillSpec (Zhou et al. 2023, arXiv 2310.08461) proposes. TV over
D with p not renormalised counts the mass outside D as never accepted, which
it is.
"""

from __future__ import annotations

import bisect
import collections
import math

import torch
import torch.nn.functional as F

from rayspec.batch import mask_runs
from rayspec.draft.eagle3 import Eagle3Head


def _shift(x: torch.Tensor, j: int, fill=0) -> torch.Tensor:
    """x[:, t + j] at index t (dim 1), padded with ``fill`` past the end."""
    if j == 0:
        return x
    pad = x.new_full((x.shape[0], j, *x.shape[2:]), fill)
    return torch.cat([x[:, j:], pad], dim=1)


def eagle3_loss(head: Eagle3Head, f: dict[str, torch.Tensor], embed_weight: torch.Tensor,
                out_weight: torch.Tensor, ttt_steps: int, targets: tuple | None = None,
                tv_weight: float = 0.0) -> tuple[torch.Tensor, list[float]]:
    """Soft cross-entropy of the unrolled head against the verifier, plus
    ``tv_weight`` times the total-variation distance (module docstring).

    Args:
        head: the draft head (fp32 parameters).
        f: features (``FEATURE_KEYS``): input_ids [B, L] int64 tokens of
            prompt + response, aux_hidden [B, L, 3H] the verifier's hidden
            states at the aux layers, final_hidden [B, L, H] its final
            (post-norm) ones, loss_mask [B, L-1] float (1 where token s+1 is
            a response token: s indexes the target position) and the
            ``verifier_normalizers`` of its whole vocabulary.
        embed_weight: [V, H] verifier input embedding (the head shares it).
        out_weight: [N, H] the verifier's output-layer rows of the head's
            draft vocabulary (``Eagle3Head.draft_rows``): the target
            distribution at position s is softmax(final_hidden[s] @ W.T) over
            all V tokens, whose normaliser ``f`` carries.
        ttt_steps: draft steps unrolled (1 = plain EAGLE training).
        targets: ``verifier_targets`` of these features at T = 1 where the
            caller has them already (None: computed here).
        tv_weight: >= 0, weight of 1 - sum_v min(p(v), q(v)) per step, the
            rejection probability of a sampled draft (0: cross-entropy only,
            EAGLE-3's objective).

    Returns:
        (scalar loss averaged over steps and masked positions, per-step top-1
        agreement of draft and verifier argmax, both as policy token ids, on
        masked positions).

    Raises:
        ValueError: ``f`` carries no normaliser at T = 1.
    """
    ids = head.draft_ids
    mask = target_mask(f["loss_mask"])
    position, target, target_top = targets or verifier_targets(f, out_weight, head.fc.weight.dtype)
    total, agree = 0.0, []
    for j, normed in unroll(head, f["input_ids"], f["aux_hidden"], embed_weight, ttt_steps):
        m = _shift(mask, 1 + j).bool()
        if not m.any():
            break
        rows = position >= 1 + j  # the targets of step j's chain starts t = position - 1 - j, in m's order
        logits = head.lm_head(normed[m])  # [n, N]
        logq = torch.log_softmax(logits, dim=-1)
        total = total + -(target[rows] * logq).sum(-1).mean()
        if tv_weight:
            total = total + tv_weight * (1 - torch.minimum(target[rows], logq.exp()).sum(-1).mean())
        drafted = logits.argmax(-1) if ids is None else ids[logits.argmax(-1)]
        agree.append((drafted == target_top[rows]).float().mean().item())
    return total / max(len(agree), 1), agree


def target_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] mask of the positions s whose next token s + 1 is a response
    token (``loss_mask`` [B, L-1] padded with a 0 at the end)."""
    return torch.cat([loss_mask, loss_mask.new_zeros(loss_mask.shape[0], 1)], 1)


# rows of the verifier's output layer cast to fp32 at a time (verifier_targets,
# verifier_normalizers): 8192 x 4096 fp32 is 128 MiB, where the whole layer of
# a 128k vocabulary would be 2 GiB on top of its bf16 copy
TARGET_ROWS = 8192

# the dtype features and the verifier's layers cross the object store in:
# the normalisers are taken of these roundings, the ones the DraftTrainer sees
SHIPPED_DTYPE = torch.bfloat16

# a feature chunk's tensors (policy_update, warmstart.features); "group" [B]
# int64 (GRPO group ids) is optional
FEATURE_KEYS = ("input_ids", "aux_hidden", "final_hidden", "loss_mask",
                "target_lse", "target_top", "target_temperatures")


@torch.no_grad()
def verifier_normalizers(final_hidden: torch.Tensor, loss_mask: torch.Tensor, lm_head_weight: torch.Tensor,
                         temperatures: tuple[float, ...] = (1.0,),
                         rows: int = TARGET_ROWS) -> dict[str, torch.Tensor]:
    """What the draft head's targets need of the verifier's whole
    vocabulary, computed where its whole output layer is (a Train rank, or
    warm start's policy): the log-normaliser and the argmax at every masked
    position. With them the DraftTrainer computes the verifier's
    probabilities of the draft vocabulary's tokens from those rows of the
    output layer alone (``verifier_targets``): at a 152k vocabulary and 32k
    draft tokens it holds a fifth of the layer and of the [n, V] fp32 logits.

    The logits are ``shipped_logits``: of the roundings the DraftTrainer
    gets (``SHIPPED_DTYPE``), as it computes them, so its probabilities over
    all V tokens sum to 1 up to fp32 rounding.

    Args:
        final_hidden: [B, L, H] the verifier's final hidden states (any
            float dtype, any device).
        loss_mask: [B, L-1] (``eagle3_loss``'s).
        lm_head_weight: [V, H] the verifier's whole output layer, on
            final_hidden's device.
        temperatures: each T > 0 the targets are wanted at (1 for the loss;
            the rollout's for sampled drafts, ``draft_overlap``).
        rows: rows of the output layer cast to fp32 at a time: the most
            memory this takes is [n, rows] fp32 with n masked positions.

    Returns:
        {"target_lse": [B, L, len(temperatures)] fp32, log sum_v exp(z_v / T)
        over all V at each masked position (0 elsewhere); "target_top":
        [B, L] int64, argmax_v z_v (the first of ties; 0 elsewhere);
        "target_temperatures": [len(temperatures)] fp32}, on final_hidden's
        device.
    """
    b, position = target_mask(loss_mask).bool().nonzero(as_tuple=True)
    x = final_hidden[b, position]  # [n, H]
    n, device = x.shape[0], x.device
    lse = torch.full((n, len(temperatures)), -math.inf, device=device)
    best = torch.full((n,), -math.inf, device=device)
    top = torch.zeros(n, dtype=torch.int64, device=device)
    for v in range(0, lm_head_weight.shape[0], rows):
        z = shipped_logits(x, lm_head_weight[v:v + rows])  # [n, rows] fp32
        for c, temperature in enumerate(temperatures):
            lse[:, c] = torch.logaddexp(lse[:, c], torch.logsumexp(z if temperature == 1 else z / temperature, -1))
        value, index = z.max(-1)
        better = value > best  # strict: an earlier block keeps a tie, as argmax does
        best, top = torch.where(better, value, best), torch.where(better, index + v, top)
    B, L = final_hidden.shape[:2]
    out_lse = torch.zeros(B, L, len(temperatures), device=device)
    out_top = torch.zeros(B, L, dtype=torch.int64, device=device)
    out_lse[b, position], out_top[b, position] = lse, top
    return {"target_lse": out_lse, "target_top": out_top,
            "target_temperatures": torch.tensor(temperatures, dtype=torch.float32, device=device)}


@torch.no_grad()
def verifier_targets(f: dict[str, torch.Tensor], out_weight: torch.Tensor, dtype: torch.dtype,
                     temperature: float = 1.0,
                     rows: int = TARGET_ROWS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The verifier's next-token distribution at every masked position, once
    for all draft steps: step j from chain start t targets position t + 1 + j,
    so the steps share these rows, and the [n, N] output layer, the largest
    cost of a training step, runs once instead of once per step.

    Args:
        f: features (``eagle3_loss``'s) with the ``verifier_normalizers``
            of the verifier's whole vocabulary at ``temperature``.
        out_weight: [N, H] the verifier's output-layer rows of the draft
            vocabulary (all V rows without one), bf16 as the DraftTrainer
            gets them (it keeps no fp32 copy).
        dtype: the probabilities' (the head's: fp32); ``rows`` rows of the
            output layer at a time go through ``shipped_logits``.
        temperature: > 0, divides the logits.

    Returns:
        (position s of each row [n] int64, in (b, s) order; the probabilities
        of the draft vocabulary's tokens [n, N] in ``dtype``, not
        renormalised over it; the argmax over all V tokens [n] int64).

    Raises:
        ValueError: ``f`` carries no normaliser at ``temperature``.
    """
    b, position = target_mask(f["loss_mask"]).bool().nonzero(as_tuple=True)
    x = f["final_hidden"][b, position]
    logits = torch.empty(x.shape[0], out_weight.shape[0], dtype=dtype, device=x.device)  # [n, N]
    for v in range(0, out_weight.shape[0], rows):
        logits[:, v:v + rows] = shipped_logits(x, out_weight[v:v + rows])
    lse = f["target_lse"][b, position, _temperature_column(f, temperature)].to(dtype)
    return position, (logits / temperature - lse[:, None]).exp(), f["target_top"][b, position]


def shipped_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[n, r] fp32 logits z = fp32(bf16(x)) @ fp32(bf16(w)).T of hidden
    states x [n, H] and output-layer rows w [r, H], as they ship
    (``SHIPPED_DTYPE``), the same on the Train ranks (the normalisers) and
    the DraftTrainer (the draft rows' logits).

    The products of two bf16 values are exact in fp32, so off the CPU this
    is cuBLAS's bf16 GEMM with fp32 accumulation and output
    (``torch.mm(..., out_dtype=torch.float32)``, torch >= 2.8 on CUDA and
    XPU; its meta kernel checks it in CI): the fp32 GEMM's values up to
    summation order, on tensor cores, where an fp32 GEMM without TF32 runs
    on the CUDA cores (an H100's 67 dense TFLOPS against 989). A CPU has no
    such kernel (torch 2.13): there it is the fp32 GEMM of the upcast values.
    """
    x, w = x.to(SHIPPED_DTYPE), w.to(SHIPPED_DTYPE)
    if x.device.type == "cpu":
        return x.float() @ w.float().T
    return torch.mm(x, w.T, out_dtype=torch.float32)


def _temperature_column(f: dict[str, torch.Tensor], temperature: float) -> int:
    """The column of ``f["target_lse"]`` taken at ``temperature``.

    Raises:
        ValueError: there is none.
    """
    have = f["target_temperatures"].tolist()
    for c, t in enumerate(have):
        if math.isclose(t, temperature, rel_tol=1e-6):
            return c
    raise ValueError(f"the features carry the verifier's normalisers at temperatures {have}, not at "
                     f"{temperature} (verifier_normalizers' temperatures)")


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


@torch.no_grad()
def draft_overlap(head: Eagle3Head, f: dict[str, torch.Tensor], embed_weight: torch.Tensor,
                  out_weight: torch.Tensor, steps: int, temperature: float = 1.0,
                  targets: tuple | None = None) -> torch.Tensor:
    """[B, L, steps] float32 (on the host): sum_v min(p(v), q(v)) for the
    head's step j from chain start t (the distributions of token t + 2 + j
    at ``temperature``; 0 where that token is not a response token).

    With ``draft_sample_method: probabilistic`` vLLM samples each draft from
    the head's q and accepts it with probability min(1, p/q), so a draft is
    accepted with probability sum_v min(p, q) = 1 - TV(p, q) (Leviathan et al.
    2023, Sec. 3.1, beta), which can exceed the greedy draft's p(argmax q).
    q is zero outside a reduced draft vocabulary (vLLM's eagle3
    ``compute_logits`` gives those tokens -inf); p is the verifier's
    distribution over all V tokens. Teacher forced (``unroll``): step j is
    fed the sequence's tokens, where a replica feeds the accepted drafts.

    Args:
        f: features (``eagle3_loss``'s) with the normalisers at
            ``temperature``; embed_weight: [V, H] the verifier's input
            embedding; out_weight: [N, H] its output-layer rows of the draft
            vocabulary (``Eagle3Head.draft_rows``).
        steps: draft steps; temperature: > 0, the rollout's (both p and q
            are taken at it, as vLLM's proposer and sampler do).
        targets: ``verifier_targets`` of these features at ``temperature``
            where the caller has them already (None: computed here).

    Raises:
        ValueError: ``f`` carries no normaliser at ``temperature``.
    """
    B, L = f["input_ids"].shape
    mask = target_mask(f["loss_mask"])
    position, p, _ = targets or verifier_targets(f, out_weight, head.fc.weight.dtype, temperature)
    out = torch.zeros(B, L, steps)
    for j, normed in unroll(head, f["input_ids"], f["aux_hidden"], embed_weight, steps):
        m = _shift(mask, 1 + j).bool()  # token t + 2 + j is a response token
        q = torch.softmax(head.lm_head(normed[m]) / temperature, -1)  # [n, N]
        out[..., j][m.cpu()] = torch.minimum(p[position >= 1 + j], q).sum(-1).float().cpu()
    return out


def greedy_hits(drafts: torch.Tensor, input_ids: torch.Tensor, k: int) -> torch.Tensor:
    """[B, L, k] bool: greedy draft j from chain start t (``draft_top1``)
    equals the sequence's token t + 2 + j, which is exactly when vLLM
    accepts it (see ``replay_drafting``)."""
    return drafts[:, :, :k] == torch.stack(
        [F.pad(input_ids[:, 2 + j:], (0, 2 + j), value=-1) for j in range(k)], -1)


def sampled_hits(overlap: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """[B, L, k] bool: each sampled draft accepted with its ``draft_overlap``
    probability, independently: one draw of what a replica drafting with
    ``draft_sample_method: probabilistic`` accepts on these responses."""
    return torch.rand(overlap.shape, generator=generator) < overlap


def replay_drafting(drafts: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, k: int,
                    max_new_tokens: int | None = None) -> tuple[int, list[int]]:
    """vLLM's speculative decoding replayed on sampled responses: how many
    drafts a replica drafting greedily with this head would have made on
    them, and how many it would have accepted at each position.

    With greedy drafts vLLM accepts draft d with the target's probability
    p(d) and otherwise samples from the residual, which excludes d
    (Leviathan et al. 2023, Sec. 2.3, with a one-hot draft distribution), so
    a draft is accepted exactly when the emitted token is the draft. On a
    response the policy sampled (same distribution as a speculative one:
    sampling is lossless) the replica's steps are therefore fixed: drafting
    starts after the prefill's token; from chain start t it drafts d_0..d_{k-1}
    (the head teacher forced on the sampled tokens, ``draft_top1``, which is
    the drafting path while the drafts match), accepts the n leading drafts
    that equal the sampled tokens, emits one more token and drafts again
    from t + n + 1. So these counts are a sample of what a replica measures
    (``spec_decode_num_drafts`` / ``..._accepted_tokens_per_pos``), at any
    temperature and top_p. Sampled drafts replay through ``replay_chains``
    with ``sampled_hits``.

    Args:
        drafts: [B, L, >= k] int64 policy token ids, ``draft_top1`` of the
            sequences (step j from chain start t predicts token t + 2 + j).
        input_ids: [B, L] int64 prompt + response (+ padding) tokens.
        loss_mask: [B, L-1] 1 where token s + 1 is a response token.
        k: drafts per step (num_speculative_tokens).
        max_new_tokens: response tokens after which drafting stops (None:
            the response's length). Drafts are checked against every
            response token of ``loss_mask``, also past this limit (vLLM
            verifies a last step's drafts beyond max_tokens).

    Returns:
        (drafts made, [accepted drafts at position 0..k-1]).
    """
    return drafting_counts(replay_chains(greedy_hits(drafts, input_ids, k), loss_mask, k, max_new_tokens), k)


def replay_chains(hits: torch.Tensor, loss_mask: torch.Tensor, k: int,
                  max_new_tokens: int | None = None) -> list[tuple[int, list[tuple[int, int]]]]:
    """``replay_drafting`` draft by draft.

    Args:
        hits: [B, L, >= k] bool, draft j from chain start t accepted if the
            ones before it were (``greedy_hits`` or ``sampled_hits``).
        loss_mask, k, max_new_tokens: as ``replay_drafting``'s.

    Returns:
        per sequence, (response tokens the policy sampled, [(tokens the
        sequence had generated when the draft was made, drafts of it
        accepted)], one entry per draft in order). A multi-turn sample's
        turns (runs of ``loss_mask``) replay one after another, each
        starting after its own first token.
    """
    out = []
    for b in range(loss_mask.shape[0]):
        resp = loss_mask[b].nonzero().flatten().tolist()
        chains: list[tuple[int, int]] = []
        hit = hits[b, :, :k].tolist() if len(resp) >= 2 else []
        before = 0  # the sample's tokens generated before this run
        # each run of the mask is a turn the replica decoded on its own (a multi-turn sample's tool tokens
        # between them were prefilled, ``rayspec.rollout.agent``): its first token is the prefill's
        for first, last in mask_runs([s + 1 for s in resp]):  # response token indices
            limit = min(max_new_tokens or last - first + 1, last - first + 1)
            t, generated = first - 1, 1
            while generated < limit:
                n, avail = 0, min(k, last - t - 1)
                while n < avail and hit[t][n]:
                    n += 1
                chains.append((before + generated, n))
                t, generated = t + n + 1, generated + n + 1
            before += last - first + 1
        out.append((len(resp), chains))
    return out



def drafting_counts(chains: list[tuple[int, list[tuple[int, int]]]], k: int) -> tuple[int, list[int]]:
    """(drafts made, [accepted drafts at position 0..k-1]) of ``replay_chains``' drafts."""
    made = [n for _, seq in chains for _, n in seq]
    return len(made), [sum(n > j for n in made) for j in range(k)]


def _cluster_totals(chains: list[tuple[int, list[tuple[int, int]]]],
                    clusters: list[int] | None) -> list[list[int]]:
    """[drafts, tokens (1 + accepted, summed)] of each cluster that drafted
    (``acceptance_length_se``'s arguments and errors)."""
    if clusters is None:
        clusters = list(range(len(chains)))
    if len(clusters) != len(chains):
        raise ValueError(f"clusters: {len(clusters)} ids for {len(chains)} sequences")
    sums: dict[int, list[int]] = {}
    for c, (_, seq) in zip(clusters, chains):
        if seq:
            acc = sums.setdefault(c, [0, 0])
            acc[0] += len(seq)
            acc[1] += sum(1 + n for _, n in seq)
    return list(sums.values())


def drafting_clusters(chains: list[tuple[int, list[tuple[int, int]]]],
                      clusters: list[int] | None = None) -> int:
    """Clusters with at least one draft: the units ``acceptance_length_se``
    estimates from (its degrees of freedom are one fewer). Arguments and
    errors as ``acceptance_length_se``'s."""
    return len(_cluster_totals(chains, clusters))


def acceptance_length_se(chains: list[tuple[int, list[tuple[int, int]]]],
                         clusters: list[int] | None = None) -> float:
    """Standard error of the replayed acceptance length (tokens per
    verification step: sum over drafts of 1 + accepted, over drafts made)
    with each cluster's drafts as one unit: a response's drafts are easy or
    hard together, and so are the responses to one prompt (a GRPO group),
    so the binomial error of independent drafts understates it. The ratio
    estimator's linearized variance (Cochran, Sampling Techniques, 3rd ed.,
    eq. 6.9, with the n / (n - 1) correction) over the clusters that
    drafted; 0.0 with fewer than two (unknown).

    Args:
        chains: ``replay_chains`` of a step's sequences.
        clusters: per sequence of ``chains``, its cluster (the GRPO group
            id); None: each sequence its own.

    Raises:
        ValueError: ``clusters`` is not one id per sequence.
    """
    per = _cluster_totals(chains, clusters)
    if len(per) < 2:
        return 0.0
    drafts = sum(d for d, _ in per)
    length = sum(t for _, t in per) / drafts
    var = len(per) / (len(per) - 1) * sum((t - length * d) ** 2 for d, t in per) / drafts ** 2
    return math.sqrt(var)


def acceptance_by_share(chains: list[tuple[int, list[tuple[int, int]]]], k: int,
                        min_drafts: int = 16) -> list[tuple[float, int, list[float]]]:
    """Replayed acceptance by how much of the rollout was still generating.

    A rollout's N sequences start together and leave at their lengths, so
    when a draft is made after p generated tokens, the sequences longer
    than p are in flight. Bucket j holds the drafts made while N / 2^(j+1)
    < in flight <= N / 2^j: the head's acceptance where a replica's batch
    has shrunk to that share of its rollout, e.g. the long tail, whose
    responses can be harder to draft than the rollout's average
    (``AdaptiveK.draft_estimated``).

    Args:
        chains: ``replay_chains`` of all N sequences of the rollout.
        k: draft positions (num_speculative_tokens).
        min_drafts: buckets with fewer drafts are left out (noise).

    Returns:
        [(share of the rollout in flight, at most 2^-j; drafts in the
        bucket; accepted / drafts at position 0..k-1)], j ascending.
    """
    lengths = sorted(length for length, _ in chains)
    buckets: dict[int, list[int]] = collections.defaultdict(list)
    for _, seq in chains:
        for p, n in seq:
            running = len(lengths) - bisect.bisect_right(lengths, p)  # >= 1: this sequence
            buckets[int(math.log2(len(lengths) / running))].append(n)
    return [(2.0 ** -j, len(ns), [sum(n > i for n in ns) / len(ns) for i in range(k)])
            for j, ns in sorted(buckets.items()) if len(ns) >= min_drafts]
