"""The one batch type that crosses every boundary of the RL step."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch

from rayspec.devices import to_device

log = logging.getLogger(__name__)


@dataclass
class RolloutBatch:
    """Sampled sequences of one RL step (one row per sample).

    Attributes:
        prompt_ids: per sample, the prompt's token ids (chat template applied).
        response_ids: per sample, the generated token ids (length T_i tokens).
        rollout_logprobs: per sample, log p(token) under the rollout engine
            (float, length T_i), used as the behaviour policy in the ratio.
        group: per sample, index of its prompt (GRPO group id).
        policy_version: version of the policy weights that sampled the batch:
            the oldest in ``weight_versions``; of a batch joined from parts
            sampled by several versions, the oldest (``join_versions``).
        weight_versions: per sample, the policy versions that sampled its
            response, as vLLM reports them (``CompletionOutput.weight_versions``):
            [(version, start, end)], response tokens [start, end) sampled
            by that version's weights; more than one span where weights
            changed while the sample was generated. Empty where the engine
            reported none (a fake, a response of no tokens).
        rewards: per sample scalar reward (set by the reward stage).
        advantages: per sample GRPO advantage (set by ``group_advantages``).
        texts: decoded responses (for logs).
        loss_mask: per sample, per response token, 1 where the policy sampled
            it and 0 where a tool message put it (multi-turn rollouts,
            ``rayspec.rollout.agent``); empty: every response token is the policy's.
        completions: per sample, the assistant and tool messages after the
            prompt (a multi-turn rollout's; TRL's conversational
            ``completions``); empty for single-turn rollouts.
        tool_counts: per sample, a multi-turn rollout's counts (turns,
            tool_calls, tool_errors, tool_timeouts, malformed_calls, and the
            spec-decode drafts / accepted tokens of its first turn and of the
            turns after a tool message); empty for single-turn rollouts.
        environments: per sample, its environment instance after the
            trajectory (``rollout.environment``; None where it does not
            pickle); empty without one.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    rollout_logprobs: list[list[float]]
    group: list[int]
    policy_version: int = 0
    rewards: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    weight_versions: list[list[tuple[int, int, int]]] = field(default_factory=list)
    loss_mask: list[list[int]] = field(default_factory=list)
    completions: list[list[dict]] = field(default_factory=list)
    tool_counts: list[dict[str, int]] = field(default_factory=list)
    environments: list = field(default_factory=list)

    # the per-sample fields, in order (``group`` is renumbered by ``gather``)
    PER_SAMPLE = ("prompt_ids", "response_ids", "rollout_logprobs", "group", "rewards", "advantages", "texts",
                  "weight_versions", "loss_mask", "completions", "tool_counts", "environments")

    def __len__(self) -> int:
        return len(self.response_ids)

    def select(self, sl: slice) -> "RolloutBatch":
        """The samples of ``sl`` (an unset field stays empty)."""
        return replace(self, **{name: getattr(self, name)[sl] for name in self.PER_SAMPLE})

    def shard(self, rank: int, world_size: int) -> "RolloutBatch":
        """Contiguous slice ``rank`` of ``world_size`` (len must divide evenly)."""
        n = len(self) // world_size
        return self.select(slice(rank * n, (rank + 1) * n))

    @staticmethod
    def gather(parts: list[tuple["RolloutBatch", list[int]]]) -> "RolloutBatch":
        """The samples ``idx`` of each (batch, idx) in ``parts``, in order,
        each distinct (part, group) renumbered 0, 1, ... in order of first
        appearance; the version is ``join_versions``'."""
        out = RolloutBatch([], [], [], [], policy_version=join_versions([b for b, _ in parts]))
        ids: dict[tuple[int, int], int] = {}
        for n, (b, idx) in enumerate(parts):
            for i in idx:
                for name in RolloutBatch.PER_SAMPLE:
                    if name != "group" and getattr(b, name):
                        getattr(out, name).append(getattr(b, name)[i])
                out.group.append(ids.setdefault((n, b.group[i]), len(ids)))
        return out

    @staticmethod
    def concat(parts: list["RolloutBatch"]) -> "RolloutBatch":
        """Join shards (e.g. from several replicas) in order; the version is
        ``join_versions``'."""
        out = RolloutBatch([], [], [], [], policy_version=join_versions(parts))
        for p in parts:
            for name in RolloutBatch.PER_SAMPLE:
                getattr(out, name).extend(getattr(p, name))
        return out

    def to_padded(self, pad_id: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Right-padded tensors for one forward over prompt+response, on
        ``device`` (built on the host, then moved: one copy per tensor).

        Returns:
            input_ids [B, L] int64, attention_mask [B, L] int64,
            response_mask [B, L-1] float32 (1 where position t+1 is a response
            token the policy sampled, aligned with logits[:, :-1]: 0 on tool
            tokens, ``loss_mask``), rollout_logprobs [B, L-1]
            float32 (0 off the response), advantages [B] float32.
        """
        seqs = [p + r for p, r in zip(self.prompt_ids, self.response_ids)]
        L = max(len(s) for s in seqs)
        B = len(seqs)
        input_ids = torch.full((B, L), pad_id, dtype=torch.long)
        attn = torch.zeros((B, L), dtype=torch.long)
        resp_mask = torch.zeros((B, L - 1), dtype=torch.float32)
        old_lp = torch.zeros((B, L - 1), dtype=torch.float32)
        for i, (p, r, lp) in enumerate(zip(self.prompt_ids, self.response_ids, self.rollout_logprobs)):
            n = len(p) + len(r)
            input_ids[i, :n] = torch.tensor(p + r)
            attn[i, :n] = 1
            resp_mask[i, len(p) - 1 : n - 1] = torch.tensor(self.loss_mask[i], dtype=torch.float32) \
                if self.loss_mask else 1.0
            old_lp[i, len(p) - 1 : n - 1] = torch.tensor(lp, dtype=torch.float32)
        adv = torch.tensor(self.advantages or [0.0] * B, dtype=torch.float32)
        return to_device({"input_ids": input_ids, "attention_mask": attn, "response_mask": resp_mask,
                          "rollout_logprobs": old_lp, "advantages": adv}, device)


def mask_runs(idx: list[int]) -> list[tuple[int, int]]:
    """(first, last) of each run of consecutive integers in sorted ``idx``,
    e.g. the turns of a multi-turn sample: the runs of its ``loss_mask``'s ones."""
    runs: list[tuple[int, int]] = []
    for i in idx:
        if runs and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def join_versions(parts: list[RolloutBatch]) -> int:
    """The policy version of a batch joined from ``parts``: the oldest part's.

    In async mode the parts of one batch can be sampled by different
    versions: a shard retried on a replica that had already loaded a newer
    refit (a replica Serve started in place of a dead one catches up to the
    newest weights), or dynamic sampling's refills drawn from batches
    generated later. Each sample keeps its own behaviour logprobs, so the
    importance ratio stays exact; the batch counts as its oldest part, the
    largest policy lag among its samples, which is what ``max_policy_lag``
    bounds.

    Raises:
        ValueError: no parts.
    """
    if not parts:
        raise ValueError("no rollouts to join")
    versions = sorted({p.policy_version for p in parts})
    if len(versions) > 1:
        log.info("joining rollouts of policy versions %s: the batch counts as version %d", versions, versions[0])
    return versions[0]
