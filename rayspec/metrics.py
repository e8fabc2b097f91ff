"""Per-step metrics: phase timers, the step line, metrics.jsonl and the Ray
dashboard (``ray.util.metrics``). TensorBoard, W&B and MLflow follow
metrics.jsonl from the driver (``rayspec.tracking``)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from rayspec.files import write_text_atomic
from rayspec.rollout.adaptive import format_schedule

class PhaseTimer:
    """Wall-clock seconds per named phase: ``with timer("rollout"): ...``.

    Attributes:
        start: when the timer was made (epoch seconds): the step's start.
        seconds: {phase: total seconds}.
        intervals: {phase: [[start, end], ...]} in epoch seconds (a timeline,
            e.g. to read a device-memory trace by phase).
    """

    def __init__(self):
        self.start = time.time()
        self.seconds: dict[str, float] = {}
        self.intervals: dict[str, list[list[float]]] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0, start = time.perf_counter(), time.time()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            self.intervals.setdefault(name, []).append([start, time.time()])


def _overlap(intervals, t0: float, t1: float) -> float:
    """Seconds of ``intervals`` [(start, end)] inside [t0, t1]."""
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in intervals)


def step_record(step: int, cfg, rollout, train_metrics: dict[str, Any], draft, timer: PhaseTimer, end: float,
                replicas_busy: list[list[tuple[float, float]]], sync_stats: dict[str, Any]) -> dict[str, Any]:
    """One RL step's metrics.jsonl record (docs/configuration.md, "The step record": every key).

    Args:
        step: the RL step (1-based).
        cfg: the run's RunConfig.
        rollout: the step's ``rayspec.train.coordinator.Rollout`` (batch
            with rewards, the reward functions' scores, SpecStats, problems,
            policy lag, retried shards).
        train_metrics: the policy update's (``policy_update``: loss, clip
            fraction, KL, token_mult_prob_error, ...), merged in last.
        draft: the draft head's part of the step
            (``rayspec.draft.client.DraftStep``: the DraftTrainer's result,
            the head's version the replicas hold, the lifecycle keys, when
            the DraftTrainer trained).
        timer: the step's phase timer (its start, seconds and intervals per
            phase: ``rl_step``'s).
        end: the step's end (epoch seconds).
        replicas_busy: each replica's engine-work intervals over the step.
        sync_stats: the refits that landed (``WeightSender.take_stats``).
    """
    batch, stats, problems = rollout.batch, rollout.stats, rollout.problems
    start, result = timer.start, draft.result
    window = end - start
    seconds = timer.seconds
    rollout_busy = sum(_overlap(iv, start, end) for iv in replicas_busy) / max(1, len(replicas_busy))
    resp_lens = [len(r) for r in batch.response_ids]
    record = {
        "step": step,
        "reward_mean": sum(batch.rewards) / len(batch.rewards),
        "acceptance_length": stats.acceptance_length,
        "acceptance_rate_per_pos": stats.acceptance_rate_per_pos,
        "rollout_tokens_per_s": stats.tokens_per_s,
        "layout": cfg.scheduler.layout,
        "mode": cfg.scheduler.mode,
        "policy_lag": rollout.lag,
        "rollout_retries": rollout.retries,
        "rollout_regenerated": int(rollout.regenerated),
        "time_step_s": window,
        # what the trainer waited for the batch (all of its generation in sync mode)
        "time_rollout_s": seconds.get("rollout", 0.0),
        "rollout_generation_s": stats.wall_s,
        # scoring (with grpo.dynamic_sampling also the refill rounds, generated and scored)
        "time_reward_s": seconds.get("reward", 0.0),
        "time_advantages_s": seconds.get("advantages", 0.0),
        "time_policy_s": seconds.get("policy", 0.0),
        # the DraftTrainer's own seconds; the part the step waited for after the policy update:
        "time_draft_s": result.get("time_s", 0.0),
        "time_draft_exposed_s": seconds.get("draft", 0.0),
        "time_sync_s": seconds.get("sync", 0.0),
        "time_sync_gather_s": seconds.get("gather", 0.0),
        # weight_sync_transport, weight_sync_bytes, time_sync_transfer_s, time_sync_load_s
        **sync_stats,
        "phase_intervals": timer.intervals,  # {phase: [[start, end]]}, epoch seconds
        # seconds of the step each role was not working (replicas: mean over replicas)
        "idle_rollout_s": max(0.0, window - rollout_busy),
        "idle_train_s": max(0.0, window - seconds.get("policy", 0.0) - seconds.get("gather", 0.0)),
        "policy_version": batch.policy_version,
        "draft_version": draft.version,
        "draft_loss": result.get("draft_loss", float("nan")),
        # the verifier features this step's chunks carried to the DraftTrainer (object store)
        "draft_feature_bytes": result.get("draft_feature_bytes", 0),
        "draft_top1_per_step": result.get("draft_top1_per_step", []),
        "draft_acceptance_estimate": result.get("draft_acceptance_estimate", []),
        "draft_acceptance_se": result.get("draft_acceptance_se", 0.0),
        "draft_acceptance_clusters": result.get("draft_acceptance_clusters", 0),
        "draft_acceptance_by_share": result.get("draft_acceptance_by_share", []),
        "num_drafts": stats.num_drafts,
        "draft_stale_repairs": stats.draft_stale_repairs,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "rollout_tokens": stats.output_tokens,
        "drafted_share": stats.drafted_share,  # what the draft training cadence reads
        "response_len_mean": sum(resp_lens) / len(resp_lens),
        "response_lens": resp_lens,  # per sample: the performance model's concurrency decay
        # per sample, the policy versions that made its tokens: [[version, first, end), ...] (vLLM's spans)
        "weight_versions": [[list(span) for span in spans] for spans in batch.weight_versions],
        "prompt_len_mean": sum(len(p) for p in batch.prompt_ids) / len(batch.prompt_ids),
        "replicas": {rid: s.summary() for rid, s in sorted(stats.replicas.items())},
        # the problems trained on (index in the dataset): a resumed run's are checkable
        "problem_ids": [p.index for p in problems],
        # one rollout for people reading the log: the step's first sample
        "sample": {"prompt": problems[batch.group[0]].text, "response": batch.texts[0],
                   "reward": batch.rewards[0]},
        # reward.functions' means over the samples each applied to, by name; scores zeroed by on_error=zero
        "rewards": rollout.scores.per_function,
        "reward_errors": rollout.scores.errors,
        **train_metrics,
    }
    if rollout.sampling_rounds is not None:  # grpo.dynamic_sampling
        record["groups_dropped"], record["sampling_rounds"] = rollout.groups_dropped, rollout.sampling_rounds
    if rollout.overlong_penalty is not None:  # reward_mean includes it; the task's reward is the difference
        record["overlong_penalty_mean"] = sum(rollout.overlong_penalty) / len(rollout.overlong_penalty)
    record.update(draft.fields)
    if draft.busy is not None:  # a DraftTrainer was alive at the step's start
        record["idle_draft_s"] = max(0.0, window - _overlap(draft.busy, start, end))
    record.update(trajectory_fields(batch))
    return record


def trajectory_fields(batch) -> dict[str, Any]:
    """A multi-turn rollout's record (``RolloutBatch.tool_counts``; {} for
    single-turn): per-sample means of turns, the share of samples that
    called a tool, the counts of calls, errors, timeouts and malformed
    calls, the share of response tokens a tool wrote (masked out of the
    loss), and the acceptance length of first turns and of turns after a
    tool message (1 + accepted / drafts; None where nothing was drafted);
    with n-gram drafts, or suffix drafts over a trajectory's own text, at a
    fixed k, ``tool_copied_tokens``: the accepted draft tokens copied from
    the trajectories' own tool messages (``agent.drafted_copies``)."""
    counts = batch.tool_counts
    if not counts:
        return {}
    total = {k: sum(c[k] for c in counts) for k in counts[0]}
    tokens = sum(len(m) for m in batch.loss_mask)

    def accept_len(kind: str):
        drafts = total[f"drafts_{kind}"]
        return 1 + total[f"accepted_{kind}"] / drafts if drafts else None

    return {"turns_mean": total["turns"] / len(counts),
            "tool_call_rate": sum(c["tool_calls"] > 0 for c in counts) / len(counts),
            **{k: total[k] for k in ("tool_calls", "tool_errors", "tool_timeouts", "malformed_calls")},
            "tool_token_share": (tokens - sum(map(sum, batch.loss_mask))) / tokens if tokens else 0.0,
            "acceptance_length_first_turn": accept_len("first_turn"),
            "acceptance_length_after_tool": accept_len("after_tool"),
            **({"tool_copied_tokens": total["accepted_from_tool"]} if "accepted_from_tool" in total else {})}


def format_step_line(m: dict[str, Any]) -> str:
    """One human-readable line per RL step."""
    rates = ",".join(f"{r:.2f}" for r in m.get("acceptance_rate_per_pos", []))
    terms = m.get("rewards") or {}
    reward = f"reward {m['reward_mean']:.3f}"
    if len(terms) > 1:  # each function's mean beside the weighted sum
        reward += " (" + ", ".join(f"{k} {'n/a' if v is None else f'{v:.2f}'}" for k, v in terms.items()) + ")"
    if m.get("reward_errors"):
        reward += f" {m['reward_errors']} zeroed"
    if "sampling_rounds" in m:
        reward += f" | dropped {m['groups_dropped']} groups, {m['sampling_rounds']} rounds"
    line = (f"step {m['step']:>4} | {reward} | "
            f"accept_len {m['acceptance_length']:.2f} | accept/pos [{rates}] | ")
    if "turns_mean" in m:  # multi-turn rollouts
        line += (f"turns {m['turns_mean']:.2f} tool calls {m['tool_calls']} ({m['tool_call_rate']:.0%} of samples, "
                 f"{m['tool_errors']} errors, {m['malformed_calls']} malformed) | ")
    if m.get("draft_acceptance_length_estimate") is not None:  # the DraftTrainer's, carried while idle
        age = m["draft_estimate_age"]
        line += (f"draft est {m['draft_acceptance_length_estimate']:.2f}"
                 + (f" ({age} step{'s' * (age > 1)} old)" if age else "") + " | ")
    line += (f"rollout {m['rollout_tokens_per_s']:.0f} tok/s | "
             f"t rollout {m['time_rollout_s']:.1f}s reward {m.get('time_reward_s', 0.0):.1f}s "
             f"policy {m['time_policy_s']:.1f}s "
             + (f"draft {m['time_draft_s']:.1f}s " if m.get("draft_trained", 1) else "draft idle ")
             + f"sync {m['time_sync_s']:.1f}s")
    # adaptive speculation: k per batch-size range and why, each distinct schedule once
    schedules = {str(r["k_schedule"]): r for r in m.get("replicas", {}).values() if r.get("k_schedule")}
    if schedules:
        line += " | k " + " / ".join(format_schedule(r["k_schedule"])
                                     + (f" ({r['k_reason']})" if r.get("k_reason") else "")
                                     for r in schedules.values())
    if "layout" in m:
        idle = " ".join(f"{role} {m[f'idle_{role}_s']:.1f}s" for role in ("rollout", "train", "draft")
                        if f"idle_{role}_s" in m)
        line += (f" | step {m['time_step_s']:.1f}s {m['layout']}/{m['mode']} lag {m['policy_lag']}"
                 f" | idle {idle}")
    return line + f" | v{m['policy_version']}"


def format_eval_line(ev: dict[str, Any]) -> str:
    """One held-out evaluation (a record's ``evals`` item) as a line: the
    policy version, the problems, reward greedy and at the RL temperature,
    the fraction of greedy answers changed since the initial policy, the
    sampled pass's acceptance length and seconds."""
    changed = ev.get("greedy_changed")
    return (f"eval v{ev['policy_version']} ({ev.get('num_problems', '?')} held-out problems): reward greedy "
            f"{ev['reward_greedy']:.3f}, T={ev.get('temperature', '?')} {ev['reward_sampled']:.3f} | greedy changed "
            f"{'n/a' if changed is None else f'{changed:.2f}'} | accept_len {ev['acceptance_length']:.2f} | "
            f"{ev['time_s']:.1f}s")


class MetricsLog:
    """Appends one JSON object per step to ``<run_dir>/metrics.jsonl``, which
    the driver's trackers follow (``rayspec.tracking.RecordFollower``).

    Each JSON line is written and flushed whole, so a crash never leaves a
    partial record behind earlier steps. Non-finite floats are written as null.
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def discard_after(self, step: int) -> list[dict[str, Any]]:
        """Move the records of steps after ``step`` (an attempt that failed
        after the checkpoint being resumed) to ``metrics.discarded.jsonl``, so
        metrics.jsonl holds one record per step; returns the records moved.
        metrics.jsonl is replaced atomically (the trackers keep both)."""
        if not self.path.is_file():
            return []
        keep, drop = [], []
        for line in self.path.read_text().splitlines(keepends=True):
            (drop if json.loads(line)["step"] > step else keep).append(line)
        if drop:
            with open(self.run_dir / "metrics.discarded.jsonl", "a") as f:
                f.writelines(drop)
                f.flush()
                os.fsync(f.fileno())
            write_text_atomic(self.path, "".join(keep))
        return [json.loads(line) for line in drop]


# (record key, phase tag) of the step's seconds, as in the step line
PHASES = (("time_rollout_s", "rollout"), ("rollout_generation_s", "rollout_generation"),
          ("time_reward_s", "reward"), ("time_advantages_s", "advantages"),
          ("time_policy_s", "policy"), ("time_draft_s", "draft"),
          ("time_draft_exposed_s", "draft_exposed"), ("time_sync_s", "sync"),
          ("time_step_s", "step"))


class DashboardMetrics:
    """Exports each step's figures through ``ray.util.metrics``, so they
    appear in Prometheus (each node's ``--metrics-export-port``) and the Ray
    dashboard's metrics view, named ``ray_rayspec_*``.

    Gauges (last step's value) tagged ``run`` (the run directory's name),
    ``method`` (speculative method or ``none``) and ``replica`` (a Serve
    replica id, or ``all`` for the sum over replicas):

    - ``rayspec_rollout_tokens_per_s``: output tokens / generation second;
    - ``rayspec_acceptance_length``: tokens per verification step, 1 + accepted / drafts;
    - ``rayspec_acceptance_rate``: per draft position (tag ``position``, 1..k);

    and per run: ``rayspec_reward_mean``, ``rayspec_policy_version`` (the
    version that sampled the step), ``rayspec_step``, ``rayspec_phase_seconds``
    (tag ``phase``: rollout, rollout_generation, reward, advantages, policy,
    draft, draft_exposed, sync, step), ``rayspec_kl`` (the policy's drift: per-token KL to the
    initial policy on the step's samples, where ``grpo.kl_coef`` > 0) and
    ``rayspec_eval_reward`` (the last held-out evaluation's mean reward, tag
    ``mode``: greedy, sampled). The histogram ``rayspec_response_tokens``
    counts every sample's response length (tokens).

    Must be created inside a Ray worker or driver (``ray.init`` done). Ray
    exports a process's metrics while it lives (the rank-0 Train worker here).
    """

    def __init__(self, run: str, method: str | None, max_new_tokens: int):
        from ray.util.metrics import Gauge, Histogram

        self.run, self.method = run, method or "none"
        per_replica = ("run", "method", "replica")
        self.tokens_per_s = Gauge("rayspec_rollout_tokens_per_s",
                                  "rollout output tokens per second of generation", per_replica)
        self.acceptance_length = Gauge("rayspec_acceptance_length",
                                       "tokens per verification step (1 + accepted / drafts)",
                                       per_replica)
        self.acceptance_rate = Gauge("rayspec_acceptance_rate",
                                     "acceptance rate at draft position", per_replica + ("position",))
        self.reward = Gauge("rayspec_reward_mean", "mean reward of the step's samples", ("run",))
        self.policy_version = Gauge("rayspec_policy_version",
                                    "policy version that sampled the step's rollouts", ("run",))
        self.step = Gauge("rayspec_step", "RL steps done", ("run",))
        self.phase = Gauge("rayspec_phase_seconds", "seconds of the step's phase", ("run", "phase"))
        self.kl = Gauge("rayspec_kl", "per-token KL of the policy to the initial policy on the step's "
                        "samples", ("run",))
        self.eval_reward = Gauge("rayspec_eval_reward", "mean reward on the held-out prompts at the last "
                                 "evaluation", ("run", "mode"))
        # powers of two up to the response cap: a length histogram in tokens
        bounds = [2.0 ** i for i in range(max(1, math.ceil(math.log2(max(2, max_new_tokens)))) + 1)]
        self.response_tokens = Histogram("rayspec_response_tokens", "response length (tokens)",
                                         boundaries=bounds, tag_keys=("run",))

    def record(self, m: dict[str, Any]) -> None:
        """Set the gauges from one metrics.jsonl record (``rl_step``'s)."""
        run = {"run": self.run}
        per_replica = {"all": {"tokens_per_s": m["rollout_tokens_per_s"],
                               "acceptance_length": m["acceptance_length"],
                               "acceptance_rate_per_pos": m["acceptance_rate_per_pos"]}}
        per_replica.update(m.get("replicas", {}))
        for replica, s in per_replica.items():
            tags = {**run, "method": self.method, "replica": str(replica)}
            self.tokens_per_s.set(s["tokens_per_s"], tags)
            self.acceptance_length.set(s["acceptance_length"], tags)
            for i, r in enumerate(s["acceptance_rate_per_pos"], 1):
                self.acceptance_rate.set(r, {**tags, "position": str(i)})
        self.reward.set(m["reward_mean"], run)
        self.policy_version.set(m["policy_version"], run)
        self.step.set(m["step"], run)
        for key, phase in PHASES:
            if key in m:
                self.phase.set(m[key], {**run, "phase": phase})
        for n in m.get("response_lens", []):
            self.response_tokens.observe(n, run)
        if "kl" in m:
            self.kl.set(m["kl"], run)
        for e in m.get("evals", [])[-1:]:
            for mode in ("greedy", "sampled"):
                self.eval_reward.set(e[f"reward_{mode}"], {**run, "mode": mode})


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of ``<run_dir>/metrics.jsonl``, in step order.

    Raises:
        FileNotFoundError: no metrics.jsonl in ``run_dir``.
        ValueError: a line is not JSON (the message names file and line).
    """
    path = Path(run_dir) / "metrics.jsonl"
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not JSON: {e}") from None
    return out


def plot_run(run_dir: str | os.PathLike) -> Path:
    """Draw acceptance length (measured in the rollouts and held-out
    passes that drafted, and the DraftTrainer's estimate every step),
    rollout throughput, response length, reward (training samples,
    and the held-out evaluations where the run has them), policy drift and
    phase seconds per step into ``<run_dir>/curves.png``; returns its path.

    Drift: the per-token KL to the reference policy on the step's samples
    (``kl``, where ``grpo.kl_coef`` > 0) and the evaluations' fraction of
    held-out greedy answers changed since the initial policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    recs = read_metrics(run_dir)
    steps = [r["step"] for r in recs]
    evals = [e for r in recs for e in r.get("evals", [])]
    fig, ax = plt.subplots(2, 3, figsize=(15, 7), constrained_layout=True)
    drafted = [(s, r["acceptance_length"]) for s, r in zip(steps, recs) if r.get("num_drafts", 1) > 0]
    if drafted:  # a rollout that drafted nothing measured no acceptance
        ax[0, 0].plot(*zip(*drafted), "o-", label="measured (rollouts that drafted)")
    est = [(s, r["draft_acceptance_length_estimate"]) for s, r in zip(steps, recs)
           if r.get("draft_acceptance_length_estimate") is not None]
    if est:  # the DraftTrainer's replay, every step (carried where the head did not train)
        ax[0, 0].plot(*zip(*est), "^--", label="draft head, estimated")
    held = [(e["policy_version"], e["acceptance_length"]) for e in evals if e.get("num_drafts", 1) > 0]
    if held:  # the held-out sampled pass, where it drafted
        ax[0, 0].plot(*zip(*held), "s", label="held-out (sampled pass)")
    if drafted or est or held:
        ax[0, 0].legend()
    ax[0, 0].set(title="acceptance length (tokens / verify step)", xlabel="RL step")
    ax[0, 1].plot(steps, [r["rollout_tokens_per_s"] for r in recs], "o-")
    ax[0, 1].set(title="rollout output tokens/s", xlabel="RL step")
    ax[1, 0].plot(steps, [r["reward_mean"] for r in recs], "o-", label="training samples")
    if evals:
        versions = [e["policy_version"] for e in evals]
        ax[1, 0].plot(versions, [e["reward_greedy"] for e in evals], "s-", label="held-out, greedy")
        ax[1, 0].plot(versions, [e["reward_sampled"] for e in evals], "^-", label="held-out, sampled")
        ax[1, 0].legend()
    ax[1, 0].set(title="mean reward (held-out: after that many steps)", xlabel="RL step", ylim=(-0.02, 1.02))
    kl = [(s, r["kl"]) for s, r in zip(steps, recs) if r.get("kl") is not None]
    if kl:
        ax[0, 2].plot(*zip(*kl), "o-", label="KL(policy || initial) per token")
    changed = [(e["policy_version"], e["greedy_changed"]) for e in evals if "greedy_changed" in e]
    if changed:
        ax[0, 2].plot(*zip(*changed), "s-", label="held-out greedy answers changed")
    if kl or changed:
        ax[0, 2].legend()
    ax[0, 2].set(title="policy drift", xlabel="RL step")
    bottom = [0.0] * len(recs)
    # stacked wall time of the step: of the draft's training only what the step waited for after the update
    for label, key in (("rollout", "time_rollout_s"), ("reward", "time_reward_s"),
                       ("advantages", "time_advantages_s"), ("policy", "time_policy_s"),
                       ("draft (exposed)", "time_draft_exposed_s"), ("sync", "time_sync_s")):
        vals = [r.get(key, 0.0) for r in recs]
        ax[1, 1].bar(steps, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax[1, 1].set(title="seconds per step, by phase", xlabel="RL step")
    ax[1, 1].legend()
    ax[1, 2].plot(steps, [r.get("response_len_mean", float("nan")) for r in recs], "o-", label="training samples")
    if evals:
        ax[1, 2].plot(versions, [e.get("response_len_greedy", float("nan")) for e in evals], "s-",
                      label="held-out, greedy")
        ax[1, 2].plot(versions, [e.get("response_len_sampled", float("nan")) for e in evals], "^-",
                      label="held-out, sampled")
        ax[1, 2].legend()
    ax[1, 2].set(title="response length (tokens)", xlabel="RL step")
    for a in ax.flat:
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    out = Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
