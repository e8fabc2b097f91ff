"""Scoring a batch with the reward functions, in Ray actors.

``reward.num_workers`` actors each import the functions once and score a
contiguous chunk of the batch, all functions over it, in parallel. Actors,
not plain tasks: a task would import the user's module (and math-verify's
sympy) again on every call, and its start-up would count against
``reward.timeout_s``; an actor is ready before the first batch, so the
timeout measures the function alone.

A function that raises, or does not return within ``reward.timeout_s`` per
sample, is run again sample by sample (a hung actor is killed and replaced
first) to find the samples at fault; the others keep their scores. Then
``reward.on_error=raise`` stops the run naming the function and the sample,
and ``zero`` scores those samples 0 for that function, counted in the
record's ``reward_errors``.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayspec.config import RewardConfig
from rayspec.reward.functions import RewardFunctionError, accepted_kwargs, resolve

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 300  # a worker's start (a fresh Python, the functions' imports) on a busy node


class RewardError(RuntimeError):
    """A reward function failed on a sample (raised, timed out) or returned
    something other than one number or None per sample; the message names
    the function and, where it is one sample's, the sample."""


@dataclass
class RewardResult:
    """One batch's scores.

    Attributes:
        rewards: [samples] the weighted sum of the functions' scores (None counts 0).
        values: {function name: [samples] its score, None where it does not apply}.
        errors: scores set to 0 by ``reward.on_error=zero``.
    """

    rewards: list[float]
    values: dict[str, list[float | None]]
    errors: int

    @property
    def per_function(self) -> dict[str, float | None]:
        """{function name: mean over the samples it applied to (not None)}; None where it applied to none."""
        means = {}
        for name, vals in self.values.items():
            got = [v for v in vals if v is not None]
            means[name] = sum(got) / len(got) if got else None
        return means

    @staticmethod
    def gather(parts: list[tuple["RewardResult", list[int]]], errors: int) -> "RewardResult":
        """The scores of samples ``idx`` of each (result, idx) in ``parts`` (non-empty), in order, with ``errors``."""
        return RewardResult([r.rewards[i] for r, idx in parts for i in idx],
                            {name: [r.values[name][i] for r, idx in parts for i in idx] for name in parts[0][0].values},
                            errors)


@ray.remote(num_cpus=0, max_restarts=0)
class RewardWorker:
    """Holds the imported reward functions; scores chunks of a batch.

    num_cpus=0: reward functions are light host work that runs between a
    step's rollout and its update, and the Train and rollout roles hold
    every CPU of the placement plan: a reserved core would never be free.
    """

    def __init__(self, functions: list[str], format_pattern: str | None, columns: list[str]):
        self.fns = [resolve(spec, f"reward.functions[{i}]", format_pattern) for i, spec in enumerate(functions)]
        self.accepted = [accepted_kwargs(fn, set(columns)) for fn in self.fns]

    def ready(self) -> bool:
        return True

    def score(self, which: list[int], kwargs: dict[str, list]) -> list[tuple[bool, Any]]:
        """[(ok, values or "ExceptionType: message")] of the functions ``which`` over the samples in ``kwargs``."""
        out = []
        for f in which:
            given = kwargs if self.accepted[f] is None else {k: v for k, v in kwargs.items() if k in self.accepted[f]}
            try:
                out.append((True, self.fns[f](**given)))
            except Exception as e:  # the user's function: any error is reported against it
                out.append((False, f"{type(e).__name__}: {e}"))
        return out


class RewardPool:
    """The reward functions of ``reward`` over the dataset's ``columns``, in
    ``reward.num_workers`` Ray actors (module docstring). ``environments``:
    the functions also get multi-turn rollouts' environment instances;
    ``environment_reward``: the name of an environment class with a
    ``get_reward()`` (TRL's: called once per trajectory, here on the
    instance as the trajectory left it, added with weight 1).

    Raises:
        RewardFunctionError: a worker cannot import a function (on its node).
    """

    def __init__(self, reward: RewardConfig, columns: set[str], environments: bool = False,
                 environment_reward: str | None = None):
        self.cfg, self.columns = reward, sorted(columns)
        self.environments = environments
        # TRL's rule: an environment class with get_reward() is a reward source of its own, weight 1, by its name
        self.environment_reward = environment_reward
        self.names = reward.names
        self.weights = list(reward.weights) if reward.weights is not None else [1.0] * len(self.names)
        self.workers = [self._start() for _ in range(reward.num_workers)]

    def _start(self):
        # on this process's node (rank 0's: it sees the reward functions' files, checked before the run), and
        # not in the Train group's bundles
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        worker = RewardWorker.options(scheduling_strategy=here).remote(
            list(self.cfg.functions), self.cfg.format_pattern,
            self.columns + (["environments"] if self.environments else []))  # TRL's keyword, passed as a column
        try:
            ray.get(worker.ready.remote(), timeout=READY_TIMEOUT_S)
        except ray.exceptions.RayActorError as e:
            raise RewardFunctionError(f"a reward worker could not load reward.functions: {e}") from None
        return worker

    def _replace(self, w: int) -> None:
        ray.kill(self.workers[w], no_restart=True)
        self.workers[w] = self._start()

    def close(self) -> None:
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        self.workers = []

    def score(self, problems: list, texts: list[str], completion_ids: list[list[int]],
              completions: list[list[dict]] | None = None, environments: list | None = None) -> RewardResult:
        """Score each sample: ``problems[i]`` answered by ``texts[i]`` (token
        ids ``completion_ids[i]``). A problem is read by its fields, as
        ``rayspec.data.Problem`` has them (the reward stage sits below the
        prompt sources, which normalise their answers with its
        ``normalise_number``): ``prompt`` and ``columns`` go to the
        functions, ``source``, ``index`` and ``text`` name a sample that
        failed. ``completions``: a multi-turn rollout's messages after the
        prompt (TRL's conversational completions; None: ``texts[i]`` as one
        assistant message, or as is for a string prompt). ``environments``: their environment instances, passed as
        ``environments`` (TRL's keyword).

        Raises:
            RewardError: see the module docstring and :class:`RewardError`.
        """
        n, nf = len(texts), len(self.names)
        kwargs = {"prompts": [p.prompt for p in problems],
                  "completions": completions or [t if isinstance(p.prompt, str) else
                                                 [{"role": "assistant", "content": t}]
                                                 for p, t in zip(problems, texts)],
                  **({"environments": environments} if environments is not None else {}),
                  "completion_ids": [list(c) for c in completion_ids],
                  **{c: [p.columns.get(c) for p in problems] for c in self.columns}}
        per = -(-n // len(self.workers))
        chunks = [list(range(s, min(n, s + per))) for s in range(0, n, per)]
        refs = [w.score.remote(list(range(nf)), _take(kwargs, c)) for w, c in zip(self.workers, chunks)]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.cfg.timeout_s * per * nf)
        values: list[list[Any]] = [[None] * n for _ in range(nf)]
        failed: dict[tuple[int, int], str] = {}  # (function, sample) -> why
        for w, (ref, chunk) in enumerate(zip(refs, chunks)):
            if ref not in ready:
                log.warning("reward functions timed out on samples %d-%d: scoring them one by one", chunk[0],
                            chunk[-1])
                self._replace(w)
                self._isolate(w, range(nf), chunk, kwargs, values, failed)
                continue
            for f, (ok, got) in enumerate(ray.get(ref)):
                if ok:
                    for s, v in zip(chunk, self._checked(f, got, len(chunk))):
                        values[f][s] = v
                else:
                    self._isolate(w, [f], chunk, kwargs, values, failed)
        errors = self._handle(failed, problems, texts)
        for f, s in failed:  # reward.on_error=zero: a failed score is a 0, in the function's mean too
            values[f][s] = 0.0
        names, weights = list(self.names), list(self.weights)
        if self.environment_reward and environments is not None:
            values.append(self._environment_rewards(environments))
            names.append(self.environment_reward)
            weights.append(1.0)
        rewards = [sum(wt * (values[f][s] or 0.0) for f, wt in enumerate(weights)) for s in range(n)]
        return RewardResult(rewards, dict(zip(names, values)), errors)

    def _environment_rewards(self, environments: list) -> list[float | None]:
        """Each environment's ``get_reward()`` (None where the instance did not pickle back).

        Raises:
            RewardError: a ``get_reward`` raised or returned no finite number (named).
        """
        out = []
        for i, env in enumerate(environments):
            if env is None:
                out.append(None)
                continue
            try:
                got = env.get_reward()
            except Exception as e:  # the user's environment: named with the sample
                raise RewardError(f"{self.environment_reward}.get_reward raised {type(e).__name__}: {e} on sample "
                                  f"{i} of the batch") from e
            if not (isinstance(got, numbers.Real) and math.isfinite(got)):
                raise RewardError(f"{self.environment_reward}.get_reward returned {got!r} on sample {i} of the "
                                  "batch: expected a finite float")
            out.append(float(got))
        return out

    def _isolate(self, w: int, fns, chunk: list[int], kwargs, values, failed) -> None:
        """Run functions ``fns`` on each sample of ``chunk`` alone, on worker
        ``w``: what fails is recorded in ``failed`` by (function, sample)."""
        for s in chunk:
            for f in fns:
                t0 = time.monotonic()
                ref = self.workers[w].score.remote([f], _take(kwargs, [s]))
                done, _ = ray.wait([ref], timeout=self.cfg.timeout_s)
                if not done:
                    failed[f, s] = f"timed out after {time.monotonic() - t0:.1f} s (reward.timeout_s)"
                    self._replace(w)
                    continue
                (ok, got), = ray.get(ref)
                if ok:
                    values[f][s] = self._checked(f, got, 1)[0]
                else:
                    failed[f, s] = f"raised {got}"
                if failed and self.cfg.on_error == "raise":
                    return

    def _checked(self, f: int, got: Any, n: int) -> list[float | None]:
        name = self.cfg.functions[f]
        try:
            got = list(got)
        except TypeError:
            raise RewardError(f"reward function {name} returned a {type(got).__name__}, not a list of "
                              f"{n} floats or None") from None
        if len(got) != n:
            raise RewardError(f"reward function {name} returned {len(got)} values for {n} samples")
        for i, v in enumerate(got):
            if v is not None and not (isinstance(v, numbers.Real) and math.isfinite(v)):
                raise RewardError(f"reward function {name} returned {v!r} ({type(v).__name__}) at position {i}: "
                                  "expected a finite float or None")
        return [None if v is None else float(v) for v in got]

    def _handle(self, failed: dict[tuple[int, int], str], problems: list, texts: list[str]) -> int:
        if not failed:
            return 0
        (f, s), why = next(iter(sorted(failed.items())))
        p = problems[s]
        where = (f"reward function {self.cfg.functions[f]} {why} on sample {s} of the batch (row {p.index} of "
                 f"{p.source}; prompt {p.text[:80]!r}; completion {texts[s][:80]!r})")
        if self.cfg.on_error == "raise":
            raise RewardError(f"{where}; reward.on_error=zero would score it 0 and go on")
        log.warning("%s: scored 0 (reward.on_error=zero)%s", where,
                    f", and {len(failed) - 1} more such scores this batch" if len(failed) > 1 else "")
        return len(failed)


def _take(kwargs: dict[str, list], idx: list[int]) -> dict[str, list]:
    return {k: [v[i] for i in idx] for k, v in kwargs.items()}
