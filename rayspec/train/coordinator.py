"""Rank 0's side of the RL step: the prompts, the rollout replicas (through
a ``RolloutClient``), rewards (through a ``RewardPool``), weight refits (through a ``WeightSender``),
held-out evaluations and the step record. The other ranks hold a
``Follower`` with the same methods, which does nothing, so the step reads
the same on every rank.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rayspec.batch import RolloutBatch
from rayspec.config import RunConfig
from rayspec.data import PromptSource, prompt_ids, train_and_heldout
from rayspec.draft.client import DraftStep, HeadWeights
from rayspec.reward.pool import RewardPool, RewardResult
from rayspec.metrics import (DashboardMetrics, MetricsLog, PhaseTimer, format_eval_line, format_step_line,
                             step_record)
from rayspec.rollout.client import RolloutClient
from rayspec.rollout.engine import derive_seed
from rayspec.rollout.spec_stats import AcceptanceWatch, SpecStats
from rayspec.scheduler.pipeline import RolloutPipeline
from rayspec.scheduler.recovery import stop_reason, stopping_run, take_node_events
from rayspec.scheduler.placement import ClusterFitError, check_device_sharing
from rayspec.sync import WeightSender
from rayspec.train.evaluate import eval_due, read_baseline, score_eval, write_baseline
from rayspec.train.grpo import group_advantages, overlong_penalty

log = logging.getLogger(__name__)

EVAL_SEED_KEY = -1  # derive_seed key of the evaluations' sampling (rollout batches count from 1)


@dataclass
class Rollout:
    """A step's rollout on rank 0: the batch (rewards and advantages filled
    in by ``Coordinator.reward`` / ``advantages``), vLLM's spec-decode stats,
    the problems it answers (by group), and its policy lag in versions."""

    batch: RolloutBatch
    stats: SpecStats
    problems: list
    lag: int
    retries: int = 0  # shards retried after their replica died
    regenerated: bool = False  # drawn before by an attempt that failed (``Coordinator.restore``)
    scores: RewardResult | None = None  # the reward functions' (before the overlong penalty)
    groups_dropped: int | None = None  # grpo.dynamic_sampling: equal-reward groups left out
    sampling_rounds: int | None = None  # grpo.dynamic_sampling: rollout rounds drawn
    overlong_penalty: list[float] | None = None  # per sample, where grpo.overlong_buffer is on


class Coordinator:
    """Rank 0's side of the step (see the module docstring).

    Args:
        cfg: the run's config.
        tokenizer: the policy's tokenizer (chat prompts).
        rollouts: the rollout replicas.
        sender: the weight transport's sending side (``rayspec.sync.make_sender``).
        draft_acceptance: the draft's latest estimate for the replicas
            (a callable returning ``DraftClient.acceptance``).
        metrics_log / dashboard: where records go (None: ``MetricsLog`` in
            ``trainer.run_dir``; no dashboard).
        rewards: the reward functions' pool (None: a ``RewardPool`` of
            ``cfg.reward`` over the dataset's columns).
    """

    def __init__(self, cfg: RunConfig, tokenizer, rollouts: RolloutClient, sender: WeightSender,
                 draft_acceptance=lambda: None, metrics_log: MetricsLog | None = None,
                 dashboard: DashboardMetrics | None = None, rewards: RewardPool | None = None):
        self.cfg, self.tokenizer, self.rollouts, self.sender = cfg, tokenizer, rollouts, sender
        self._draft_acceptance = draft_acceptance
        problems, self.eval_problems = train_and_heldout(
            cfg.data, cfg.data.eval_num_problems if cfg.trainer.eval_every else 0)
        self._render, env_reward = None, None  # multi-turn: the prompt with the tools (rayspec.rollout.agent)
        if cfg.rollout.multi_turn:
            from rayspec.rollout.agent import Toolset, prompt_renderer

            toolset = Toolset.load(cfg.rollout.tools, cfg.rollout.environment)
            self._render = prompt_renderer(toolset, tokenizer)
            env_reward = toolset.reward_name()
        self.rewards = rewards or RewardPool(cfg.reward, set(problems[0].columns),
                                             environments=cfg.rollout.environment is not None,
                                             environment_reward=env_reward)
        self.prompts = PromptSource(problems, cfg.data.prompts_per_step, cfg.data.seed)
        lag = cfg.scheduler.max_policy_lag if cfg.scheduler.mode == "async" else 0
        self.pipeline = RolloutPipeline(self._submit, lag, cfg.trainer.steps - 1)
        self.log = metrics_log or MetricsLog(cfg.trainer.run_dir)
        self.dashboard = dashboard
        # a resumed run's baseline (the initial policy's greedy answers) is on disk
        self.eval_prompts = [self._prompt_ids(p) for p in self.eval_problems]
        self.eval_baseline = read_baseline(cfg.trainer.run_dir, self.eval_problems)
        self.evals: list[dict[str, Any]] = []  # evaluations since the last step record
        self.sleep_reported = False
        self.batches = 0  # batches drawn: the RL step the last submitted batch trains at
        self.redrawn_until = 0  # after a restore: the last step whose batch a failed attempt had drawn
        self.acceptance_watch = AcceptanceWatch()
        self._carried_losses: list = []  # node losses of records discarded by a restore: the next record's
        self._draft_drafted_with = 0  # the draft version the replicas held during this step's rollout

    @classmethod
    def start(cls, cfg: RunConfig, tokenizer, device: torch.device, draft_acceptance) -> "Coordinator":
        """The production coordinator: the running Serve deployment's
        replicas, the configured weight transport, metrics.jsonl (which
        the driver's trackers follow) and the Ray dashboard."""
        from rayspec.rollout.serve import rollout_client
        from rayspec.sync import make_sender

        rollouts = rollout_client(cfg.rollout, stopped=stop_reason)  # a rollout gives up when the driver stops the run
        # the newest weights sent are kept by the sender: every rollout carries
        # their versions so a replica Serve restarted catches up first
        sender = make_sender(cfg.rollout.weight_sync, rollouts, trainer_has_gpu=device.type == "cuda",
                             replicas_have_gpu=cfg.rollout.num_gpus_per_replica > 0,
                             shared_gpus=cfg.scheduler.layout == "colocate", device=device,
                             lora=cfg.train.lora.enabled)
        dashboard = DashboardMetrics(Path(cfg.trainer.run_dir).name, cfg.rollout.speculative_config.method,
                                     cfg.grpo.max_new_tokens)
        return cls(cfg, tokenizer, rollouts, sender, draft_acceptance, dashboard=dashboard)

    # -- the step's phases --

    def next_rollout(self, version: int) -> Rollout:
        """The batch policy ``version`` trains on: generated now (sync), or
        taken from those generating ahead (async), which are topped up."""
        with stopping_run():
            batch, stats, (problems, _), lag = self.pipeline.next(version)
        return Rollout(batch, stats, problems, lag, self.pipeline.last_retries,
                       regenerated=version + 1 <= self.redrawn_until)

    def reward(self, rollout: Rollout) -> None:
        """Each sample's reward (the weighted sum of ``reward.functions``),
        plus DAPO's overlong penalty where ``grpo.overlong_buffer`` is on (as
        verl adds it), in place."""
        rollout.scores = self.score(rollout.batch, rollout.problems)
        if self.cfg.grpo.dynamic_sampling:
            self.drop_and_refill(rollout)
        rewards = rollout.scores.rewards
        buffer = self.cfg.grpo.overlong_buffer
        if buffer.enabled:
            rollout.overlong_penalty = overlong_penalty([len(r) for r in rollout.batch.response_ids],
                                                        self.cfg.grpo.max_new_tokens, buffer.len,
                                                        buffer.penalty_factor)
            rewards = [r + p for r, p in zip(rewards, rollout.overlong_penalty)]
        rollout.batch.rewards = rewards

    def drop_and_refill(self, rollout: Rollout) -> None:
        """DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, Sec. 3.2,
        the constraint 0 < |{o_i correct}| < G of its objective): a group whose rewards are all equal
        has zero GRPO advantage and adds no policy gradient, so it is
        dropped, and new prompts are rolled out and scored until
        ``data.prompts_per_step`` groups with unequal rewards are in hand,
        at most ``grpo.max_sampling_rounds`` rounds (verl's
        ``filter_groups``; equality is on the reward functions' sum, before
        the overlong penalty). Groups beyond the batch are not trained on.
        Short after the last round, dropped groups fill the batch (they add
        no policy gradient, as without dynamic sampling), with a warning.
        The rollout is replaced in place: batch, problems, scores, summed
        spec-decode counters (rounds run one after another) and the counts."""
        target = self.cfg.data.prompts_per_step
        version = rollout.batch.policy_version + rollout.lag
        kept: list = []  # (batch, scores, problem, sample indices) per group
        dropped: list = []
        batch, scores, problems, rounds, errors = rollout.batch, rollout.scores, rollout.problems, 1, 0
        while True:
            errors += scores.errors
            for g, problem in enumerate(problems):
                idx = [i for i, x in enumerate(batch.group) if x == g]
                values = [scores.rewards[i] for i in idx]
                (kept if max(values) > min(values) else dropped).append((batch, scores, problem, idx))
            if len(kept) >= target or rounds == self.cfg.grpo.max_sampling_rounds:
                break
            batch, stats, (problems, _), _ = self.pipeline.next(version)
            scores = self.score(batch, problems)
            rollout.stats, rounds = rollout.stats.then(stats), rounds + 1
            rollout.retries += self.pipeline.last_retries
        if len(kept) < target:
            log.warning("grpo.dynamic_sampling: %d of %d groups with unequal rewards after %d rounds "
                        "(grpo.max_sampling_rounds): %d equal-reward groups fill the batch", len(kept), target,
                        rounds, target - len(kept))
        chosen = (kept + dropped)[:target]
        rollout.batch = RolloutBatch.gather([(b, idx) for b, _, _, idx in chosen])
        rollout.scores = RewardResult.gather([(s, idx) for _, s, _, idx in chosen], errors)
        rollout.problems = [p for _, _, p, _ in chosen]
        rollout.groups_dropped = len(dropped) - max(0, target - len(kept))
        rollout.sampling_rounds = rounds

    def score(self, batch: RolloutBatch, problems: list) -> RewardResult:
        """The reward functions' scores of ``batch``, whose group ``g``
        answers ``problems[g]`` (a multi-turn sample's ``completions`` are
        its messages, with its environment, as TRL passes them)."""
        return self.rewards.score([problems[g] for g in batch.group], batch.texts, batch.response_ids,
                                  batch.completions or None, batch.environments or None)

    def _prompt_ids(self, problem) -> list[int]:
        """A problem's prompt tokens (with the tools, for multi-turn rollouts)."""
        return self._render(problem.prompt) if self._render else prompt_ids(self.tokenizer, problem)

    def _rows(self, problems: list) -> dict[str, Any]:
        """``generate``'s ``rows`` (multi-turn rollouts: the environments' ``reset`` arguments), else {}."""
        return {"rows": [{"prompt": p.prompt, **p.columns} for p in problems]} if self._render else {}

    def advantages(self, rollout: Rollout) -> None:
        """GRPO advantages over each prompt's group, in place."""
        rollout.batch.advantages = group_advantages(rollout.batch.rewards, rollout.batch.group,
                                                    norm_by_std=self.cfg.grpo.norm_adv_by_std)

    def release_replicas(self, refit_next: bool = True) -> None:
        """Colocated: replicas free their memory while the policy trains, at
        ``rollout.sleep_level`` where a policy refit ends the sleep
        (``refit_next``), else at level 1 (the weights kept)."""
        if self.cfg.scheduler.layout != "colocate":
            return
        slept = self.rollouts.sleep(self.cfg.rollout.sleep_level if refit_next else 1)
        if not self.sleep_reported:
            self.sleep_reported = True
            log.info("colocate: %s", "replicas sleep (vLLM sleep mode) while the policy trains"
                     if all(slept) else "vLLM has no sleep mode on this platform; rollout, "
                     "training and draft time-slice the same cores")

    def refit(self, version: int, weights=None, head: HeadWeights | None = None) -> None:
        """Send the policy's ``weights`` (``PolicyWorker.refit_weights``) as
        ``version``, then the draft ``head``, each where given, to every
        replica through the weight transport; sync mode waits for each to
        land, async leaves them queued behind the rollouts in flight."""
        if weights is not None:
            self._send("policy", weights, version)
        if head is not None:
            self._send("draft", head.weights, head.version)

    def _send(self, target: str, weights, version: int) -> None:
        self.pipeline.refit(self.sender.send(target, weights, version))
        if self.cfg.scheduler.mode == "sync":
            self.pipeline.wait_refits()

    def record(self, step: int, rollout: Rollout, train_metrics: dict[str, Any], draft: DraftStep,
               timer: PhaseTimer) -> dict[str, Any]:
        """The step's record (``metrics.step_record``), over the step's
        window (the timer's start to now), with each replica's engine work
        over it and the refits that landed, ``acceptance_collapse`` where
        a replica's acceptance collapsed (``AcceptanceWatch``; logged,
        naming the replica), and ``node_failures``: the nodes lost since the
        last record kept, as the driver posted them (``NodeEvents``)."""
        end = time.time()
        record = step_record(step, self.cfg, rollout, train_metrics, draft, timer, end,
                             self.rollouts.busy_intervals(timer.start), self.sender.take_stats())
        # the head the replicas held as this step's rollouts drafted: the last step's (in async
        # mode a batch generated ahead may have drafted with an older one)
        used, self._draft_drafted_with = self._draft_drafted_with, draft.version
        collapsed = self.acceptance_watch.observe(rollout.stats, used)
        for c in collapsed:
            log.warning("step %d: replica %s's acceptance collapsed: position-1 rate %.3f against a median of "
                        "%.3f, %d steps in a row with draft head version %d unchanged (draft weights lost on "
                        "that replica?)", step, c["replica"], c["rate"], c["median"], c["steps"], used)
        if collapsed:
            record["acceptance_collapse"] = collapsed
        lost, self._carried_losses = self._carried_losses + take_node_events(), []
        if lost:
            record["node_failures"] = lost
        return record

    def check_devices(self, train: list, draft) -> str | None:
        """The devices of every role checked against the layout
        (``check_device_sharing``): the replicas', the Train ranks' ``train``
        [(node id, GPU id or None)] and ``draft.node_and_gpu()``; the device
        table is logged. Returns the ClusterFitError's message, or None."""
        occupants = {"rollout": self.rollouts.node_and_gpu(), "train": train, "draft": draft.node_and_gpu()}
        try:
            table = check_device_sharing(self.cfg.scheduler.layout, {k: v for k, v in occupants.items() if v})
        except ClusterFitError as e:
            return str(e)
        if table:
            log.info("GPUs (%s):\n%s", self.cfg.scheduler.layout, table)
        return None

    def finish_step(self, version: int, record: dict[str, Any]) -> None:
        """After the step that made ``version``: evaluate it if due, then
        write, export and print the record.

        Raises:
            ClusterFitError: the driver stopped the run during the
                evaluation (``stopping_run``), raised after the record is
                written (the step is done: the checkpoint saved on stopping
                holds it).
        """
        stopping = None
        try:
            self.evaluate(version)
        except ClusterFitError as e:
            stopping = e
        if self.evals:
            record["evals"], self.evals = self.evals, []
        self.log.write(record)
        if self.dashboard is not None:
            self.dashboard.record(record)
        log.info(format_step_line(record))
        _warn_on_policy_mismatch(record, self.cfg)
        if stopping is not None:
            raise stopping

    # -- around the steps --

    def _submit(self):
        """Start the next prompts' rollouts on the replicas; returns
        (pending, (problems, the prompt cursor before them))."""
        cfg = self.cfg
        cursor = self.prompts.state_dict()
        problems = self.prompts.next_batch()
        self.batches += 1
        pending = self.rollouts.submit(
            [self._prompt_ids(p) for p in problems], **self._rows(problems),
            seed=derive_seed(cfg.trainer.seed, self.batches), refits=self.sender.rollout_refits(),
            catch_up=self.sender.catch_up, draft_acceptance=self._draft_acceptance(),
            n=cfg.grpo.group_size, temperature=cfg.grpo.temperature, top_p=cfg.grpo.top_p,
            max_tokens=cfg.grpo.max_new_tokens)
        return pending, (problems, cursor)

    def evaluate(self, version: int) -> None:
        """Score policy ``version`` on the held-out problems if it is due
        (``eval_due``), once every refit sent has landed; the result waits in
        ``self.evals`` for the next step record. Version 0's greedy responses
        become the baseline of ``greedy_changed``."""
        cfg = self.cfg
        if not eval_due(version, cfg.trainer.eval_every, cfg.trainer.steps):
            return
        prompts = self.eval_prompts
        with stopping_run():
            self.pipeline.wait_refits()
            t0 = time.perf_counter()
            common = {"refits": self.sender.rollout_refits(), "catch_up": self.sender.catch_up,
                      "max_tokens": cfg.grpo.max_new_tokens, **self._rows(self.eval_problems)}
            greedy, _ = self.rollouts.generate(prompts, n=1, temperature=0.0, **common)
            # the same seed at every evaluation: common random numbers across versions
            sampled, stats = self.rollouts.generate(prompts, seed=derive_seed(cfg.trainer.seed, EVAL_SEED_KEY),
                                                    n=cfg.trainer.eval_samples, temperature=cfg.grpo.temperature,
                                                    top_p=cfg.grpo.top_p, **common)
        if version == 0:  # the initial policy's answers are the baseline, whatever a file says
            write_baseline(cfg.trainer.run_dir, self.eval_problems, greedy)
            self.eval_baseline = greedy.response_ids
        rewards = [self.score(b, self.eval_problems).rewards for b in (greedy, sampled)]
        rec = {**score_eval(self.eval_problems, greedy, sampled, stats, self.eval_baseline, *rewards),
               "num_problems": len(prompts), "temperature": cfg.grpo.temperature, "time_s": time.perf_counter() - t0}
        self.evals.append(rec)
        log.info(format_eval_line(rec))

    def trainer_state(self, step: int, version: int, draft_state: dict[str, Any]) -> dict[str, Any]:
        """What a checkpoint after ``step`` resumes from. Batches generated
        ahead (async) are not kept: the cursor is the one before them."""
        ahead = self.pipeline.ahead()
        return {"step": step, "steps": self.cfg.trainer.steps, "policy_version": version, **draft_state,
                "prompts": ahead[0][1] if ahead else self.prompts.state_dict()}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue after ``state``'s step: its prompt cursor and batch count;
        metrics.jsonl records of later steps (a failed attempt) move to
        metrics.discarded.jsonl.

        The failed attempt had drawn the batches of the steps it recorded,
        of the step it was in, and of the ``max_policy_lag`` steps after it
        (async: generated ahead), up to its ``trainer.steps``; their samples
        died with it. This attempt draws the same prompts again (the cursor
        is the one before them) and its records of those steps say so
        (``rollout_regenerated``). It is an upper bound: an attempt that died
        waiting for a step's batch had not yet drawn the last one."""
        step = state["step"]
        self.prompts.load_state_dict(state["prompts"])
        self.batches = step
        discarded = self.discard_after(step)
        last = state.get("steps")  # the failed attempt drew no batch past its trainer.steps (older checkpoints: ?)
        if last is None or step < last:  # a run's last checkpoint: it drew nothing past it
            drawn = step + discarded + 1 + self.pipeline.max_policy_lag
            self.redrawn_until = drawn if last is None else min(drawn, last)

    def discard_after(self, step: int) -> int:
        """Move the records of steps after ``step`` aside
        (``MetricsLog.discard_after``); the node losses they held go into
        the next record. Returns how many moved."""
        moved = self.log.discard_after(step)
        self._carried_losses += [e for r in moved for e in r.get("node_failures", [])]
        return len(moved)

    def replica_versions(self) -> list[dict[str, int]]:
        return self.rollouts.versions()

    def wait_refits(self) -> None:
        self.pipeline.wait_refits()

    def close(self) -> None:
        """End of run: drop the batches generated ahead, stop the sender and
        the reward workers."""
        self.pipeline.close()
        self.sender.close()
        self.rewards.close()


class Follower:
    """A Train rank other than 0: the coordinator's calls do nothing here
    (and give None where the coordinator returns something)."""

    def next_rollout(self, version: int) -> None:
        return None

    def reward(self, rollout) -> None:
        pass

    def advantages(self, rollout) -> None:
        pass

    def release_replicas(self, refit_next: bool = True) -> None:
        pass

    def refit(self, version: int, weights=None, head=None) -> None:
        pass

    def wait_refits(self) -> None:
        pass

    def record(self, step: int, rollout, train_metrics, draft, timer) -> None:
        return None

    def check_devices(self, train: list, draft) -> None:
        return None

    def finish_step(self, version: int, record) -> None:
        pass

    def evaluate(self, version: int) -> None:
        pass

    def trainer_state(self, step: int, version: int, draft_state) -> None:
        return None

    def restore(self, state) -> None:
        pass

    def close(self) -> None:
        pass


def _warn_on_policy_mismatch(record: dict[str, Any], cfg: RunConfig) -> None:
    err = record.get("token_mult_prob_error", 0.0)
    if err > cfg.logging.warn_token_mult_prob_error:
        log.warning(
            "step %d: token_mult_prob_error %.3f > %.3f: the rollout engine's probabilities of the "
            "sampled tokens differ from the trainer's. With model.dtype=%s, weight updates smaller "
            "than its rounding step never reach the replicas; model.dtype=float32 serves the "
            "trained weights exactly (slower on CPU). The importance ratio uses the rollout "
            "logprobs, so the gradient stays unbiased, but the rollouts are off-policy.",
            record["step"], err, cfg.logging.warn_token_mult_prob_error, cfg.model.dtype)
