"""Preflight: what a run checks before it starts or writes anything, each
failure a ``ConfigError`` (or ``ClusterFitError``) that names the key or
file at fault: the policy, the draft and the dataset (``check_inputs``), a
multi-turn run's tools and template (``check_agent``), the reward
functions' signatures, the run directory, a resume, the memory plan on
the cluster's own devices (``check_memory_plan``), and on several nodes that
every node running a role sees what its roles read (``check_nodes_see_inputs``).
``rayspec.driver.run`` calls them in that order before it starts a role."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import tempfile
import uuid
from pathlib import Path
from typing import Optional

from rayspec.config import DEFAULT_DRAFT_SAMPLE_METHOD, ConfigError, RunConfig, draft_online
from rayspec.data import load_problems, train_and_heldout
from rayspec.draft.eagle3 import WEIGHT_FILES, aux_layer_ids
from rayspec.models import check_causal_lm_dir, resolve_model_path
from rayspec.models.acceptance import read_acceptance
from rayspec.files import content_digest
from rayspec.scheduler.placement import ClusterFitError, NodeInfo, PlacementPlan
from rayspec.train.checkpoint import TRAIN_NAME, TRAIN_STORAGE, checkpoints, train_storage
from rayspec.vllm import require_vllm

log = logging.getLogger(__name__)


def check_inputs(cfg: RunConfig) -> str:
    """Check the policy, the draft and the dataset before anything starts or
    is written; returns the policy's HF directory (the bundled model is
    materialised here).

    Raises:
        ConfigError: naming the key and file at fault (see
            ``resolve_model_path``, ``check_draft_matches_policy``; a
            missing, empty or malformed dataset file with its line number).
        VllmInternalsError: a vLLM internal rayspec relies on is missing from
            the installed release (``rayspec.vllm.require_vllm``).
    """
    require_vllm()
    model_dir = resolve_model_path(cfg.model.path, cfg.model.cache_dir)  # checks a local policy
    policy_cfg = json.loads((model_dir / "config.json").read_text())
    spec = cfg.rollout.speculative_config
    if spec.method == "mtp" and not _has_mtp_layers(policy_cfg):
        raise ConfigError(
            f"rollout.speculative_config.method='mtp': the policy (model.path={cfg.model.path}, model_type "
            f"{policy_cfg.get('model_type')!r}) has no multi-token-prediction layers (its config.json sets no "
            "num_nextn_predict_layers); mtp drafts with a model's own MTP layers (DeepSeek-V3, GLM-4.5, "
            "Qwen3-Next, MiMo, ERNIE-4.5, ...): for this policy use eagle3, draft_model, ngram or suffix")
    if cfg.train.lora.enabled and spec.method == "draft_model":
        log.warning("rollout.speculative_config.method='draft_model' with train.lora: the draft model never gets "
                    "the policy's adapter, so its acceptance sags as the adapter moves the policy away from the "
                    "base (eagle3 trains on the adapted verifier's features; ngram and suffix draft its own text)")
    if spec.model is not None:
        check_draft_matches_policy(policy_cfg, spec.model, spec.method)
        try:
            read_acceptance(spec.model, spec.draft_sample_method or DEFAULT_DRAFT_SAMPLE_METHOD)
            if draft_online(cfg):
                from rayspec.draft.trainer import online_lr

                online_lr(cfg.draft.lr, spec.model, trained=True)
        except ValueError as e:
            raise ConfigError(f"rollout.speculative_config.model={spec.model}: {e}") from None
    try:
        problems = load_problems(cfg.data)
    except (OSError, ValueError, ImportError) as e:  # OSError: a missing file, or the hub out of reach
        raise ConfigError(f"data.path={cfg.data.path}: {e}") from None
    if cfg.trainer.eval_every:
        try:
            train_and_heldout(cfg.data, cfg.data.eval_num_problems)
        except ValueError as e:
            key = "data.eval_path" if cfg.data.eval_path else "data.eval_num_problems"
            raise ConfigError(f"{key}={getattr(cfg.data, key.split('.')[1])}: {e}") from None
    check_reward_functions(cfg.reward, set(problems[0].columns) | ({"environments"} if cfg.rollout.environment
                                                                   else set()))
    if cfg.rollout.multi_turn:
        check_agent(cfg, str(model_dir), problems)
    return str(model_dir)


def _has_mtp_layers(policy_cfg: dict) -> bool:
    """Whether a policy's HF config declares MTP layers as vLLM reads them
    (``num_nextn_predict_layers``, also under ``text_config``; MiMo-V2 has
    a fixed count vLLM knows by its model type)."""
    configs = [policy_cfg, policy_cfg.get("text_config") or {}]
    return any((c.get("num_nextn_predict_layers") or 0) > 0 for c in configs) or \
        "mimo" in str(policy_cfg.get("model_type", ""))


def check_draft_matches_policy(policy_cfg: dict, draft_dir: str | os.PathLike, method: str) -> None:
    """Check ``rollout.speculative_config.model`` against the policy before any engine starts.

    eagle3: the head reads the verifier's hidden states and proposes in its
    vocabulary (or a reduced draft vocabulary of it), so ``hidden_size`` and
    ``vocab_size`` must equal the policy's and its aux layers (vLLM's default
    where the config names none) must exist in the policy. draft_model: a
    safetensors causal LM (``check_causal_lm_dir``) with the policy's
    ``vocab_size`` (same tokenizer).

    Args:
        policy_cfg: the policy's config.json (from ``check_causal_lm_dir``).
        draft_dir: the draft directory.
        method: ``speculative_config.method``.

    Raises:
        ConfigError: naming the key, the draft's config.json, the field and both values.
    """
    key = "rollout.speculative_config.model"
    d = Path(draft_dir).expanduser()
    if method == "eagle3":
        cfg_file = d / "config.json"
        if not cfg_file.is_file() or not any((d / f).is_file() for f in WEIGHT_FILES):
            raise ConfigError(f"{key}={draft_dir}: expected an EAGLE-3 head (config.json and "
                              f"{' or '.join(WEIGHT_FILES)})")
        cfg = json.loads(cfg_file.read_text())
        # vLLM reads a head's target width from target_hidden_size when it differs
        pairs = (("target_hidden_size" if "target_hidden_size" in cfg else "hidden_size", "hidden_size"),
                 ("vocab_size", "vocab_size"))
    elif method == "draft_model":
        cfg, cfg_file = check_causal_lm_dir(d, key), d / "config.json"
        pairs = (("vocab_size", "vocab_size"),)
    else:
        return
    for f, pf in pairs:
        if cfg.get(f) != policy_cfg.get(pf):
            raise ConfigError(f"{key}={draft_dir}: {cfg_file} {f}={cfg.get(f)} does not match the "
                              f"policy's {pf}={policy_cfg.get(pf)}")
    if method != "eagle3":
        return
    layers = policy_cfg.get("num_hidden_layers", 0)
    aux = aux_layer_ids(cfg, layers)
    if any(not 0 <= i < layers for i in aux):
        raise ConfigError(f"{key}={draft_dir}: {cfg_file} eagle_aux_hidden_state_layer_ids={aux} "
                          f"name layers the {layers}-layer policy does not have")


def check_agent(cfg: RunConfig, model_dir: str, problems: list) -> None:
    """Before anything starts: the tools and the environment of a
    multi-turn run import and have schemas, the environment builds with no
    arguments, the tool parser exists, the chat template renders tool
    messages, and every prompt is a conversation (a chat template renders
    the tools and the turns).

    Raises:
        ConfigError: naming the key, file or row at fault and the fix.
    """
    from rayspec.models import load_tokenizer
    from rayspec.rollout.agent import ToolCallParser, ToolError, Toolset, check_template

    try:
        toolset = Toolset.load(cfg.rollout.tools, cfg.rollout.environment)
        if toolset.environment is not None:
            try:
                toolset.environment()
            except Exception as e:
                raise ToolError(f"rollout.environment={cfg.rollout.environment}: {toolset.environment.__name__}() "
                                f"raised {type(e).__name__}: {e} (one instance is built per trajectory, with no "
                                "arguments; the row comes to reset)") from None
        tokenizer = load_tokenizer(model_dir)
        check_template(tokenizer, cfg.model.path)
        ToolCallParser(cfg.rollout.tool_parser, tokenizer, toolset.schemas)
    except ToolError as e:
        raise ConfigError(str(e)) from None
    plain = next((p for p in problems if isinstance(p.prompt, str)), None)
    if plain is not None:
        raise ConfigError(f"rollout.tools / rollout.environment: row {plain.index} of {plain.source} has a string "
                          "prompt; multi-turn rollouts need conversational prompts (a list of role/content "
                          "messages), which the chat template renders with the tools")


def check_reward_functions(reward, columns: set[str]) -> None:
    """Import each of ``reward.functions`` here, on the driver, and check its
    signature against the dataset's ``columns`` (TRL's form), before
    anything starts.

    Raises:
        ConfigError: naming ``reward.functions[i]``: cannot be imported, or
            cannot be called with the dataset's columns.
    """
    from rayspec.reward.functions import RewardFunctionError, check_signature, resolve

    for i, spec in enumerate(reward.functions):
        key = f"reward.functions[{i}]={spec}"
        try:
            check_signature(resolve(spec, key, reward.format_pattern), key, columns)
        except RewardFunctionError as e:
            raise ConfigError(str(e)) from None


def check_run_dir(cfg: RunConfig) -> None:
    """Check, before anything starts, that ``trainer.run_dir`` can be created
    and written, leaving nothing behind: directories it had to create for
    the check are removed again (the run creates them once it starts).

    Raises:
        ConfigError: naming ``trainer.run_dir`` and what the OS said.
    """
    run_dir = Path(cfg.trainer.run_dir)
    created = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".rayspec-write-check-"):
            pass
    except OSError as e:
        raise ConfigError(f"trainer.run_dir={cfg.trainer.run_dir}: not a writable directory "
                          f"({type(e).__name__}: {e.strerror or e})") from None
    finally:
        for p in created:  # deepest first
            with contextlib.suppress(OSError):
                p.rmdir()


def check_resume(cfg: RunConfig, resume: bool) -> None:
    """A run directory with checkpoints is continued only when asked to, so
    a new run never silently resumes an old one (nor overwrites it).

    Raises:
        ConfigError: ``resume`` without a checkpoint to resume, a new run
            in a directory (or ``trainer.storage_path``) that holds one, or
            a ``trainer.storage_path`` that cannot be read (named, with
            pyarrow's error).
    """
    storage = train_storage(cfg.trainer)
    key = "trainer.storage_path" if cfg.trainer.storage_path else "trainer.run_dir"
    try:
        found = checkpoints(storage)
    except (OSError, ValueError) as e:  # pyarrow: ArrowInvalid (a ValueError) for an unknown scheme
        raise ConfigError(f"{key}={cfg.trainer.storage_path or cfg.trainer.run_dir}: Ray Train's checkpoints "
                          f"cannot be listed there ({type(e).__name__}: {e})") from e
    if resume and not found:
        raise ConfigError(f"resume={cfg.trainer.run_dir}: no checkpoint under {storage}/{TRAIN_NAME}")
    if not resume and found:
        latest = found[-1].path.rstrip("/").rsplit("/", 1)[-1]
        raise ConfigError(f"{key}={cfg.trainer.storage_path or cfg.trainer.run_dir} holds checkpoints of an "
                          f"earlier run (latest {latest}): continue it with `python -m jobs.grpo "
                          f"resume={cfg.trainer.run_dir}`, or choose another {key}")


def longest_prompt_tokens(cfg: RunConfig, model_dir: str) -> int:
    """The longest prompt of the run's training and held-out data in
    tokens, as the replicas get it (``prompt_ids``; a multi-turn run's
    with its tools' schemas, ``agent_prompt_ids``): a sequence of the memory
    plan is that plus ``grpo.max_new_tokens`` (a trajectory's turns and
    tool outputs included)."""
    from rayspec.data import prompt_ids
    from rayspec.models import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    train, heldout = train_and_heldout(cfg.data, cfg.data.eval_num_problems) if cfg.trainer.eval_every \
        else (load_problems(cfg.data), [])
    if cfg.rollout.multi_turn:
        from rayspec.rollout.agent import Toolset, agent_prompt_ids, template_renders_tools

        schemas = Toolset.load(cfg.rollout.tools, cfg.rollout.environment).schemas
        native = template_renders_tools(tokenizer)
        return max(len(agent_prompt_ids(tokenizer, p.prompt, schemas, native)) for p in train + heldout)
    return max(len(prompt_ids(tokenizer, p)) for p in train + heldout)


def check_memory_plan(cfg: RunConfig, model_dir: str, nodes: list[NodeInfo],
                      device_bytes: dict[str, int | None] | None = None, host_bytes: float | None = None,
                      prompt_tokens: int | None = None):
    """The memory plan (``rayspec.memory_plan``) of the run on the
    cluster's own memory, before any role starts. GPU roles: the plan of the
    smallest GPU's memory (host memory is not checked: the GPU plan's host
    sum is an upper bound; ``jobs.project_memory`` shows it). CPU roles on
    one node: its host memory per phase (``cpu_plan``).

    Args:
        prompt_tokens: a prompt's tokens in the plan's sequences (with
            ``grpo.max_new_tokens``); the launcher gives the run's longest
            (``longest_prompt_tokens``). None: ``memory_plan.PROMPT_TOKENS``.
        device_bytes: {node id: bytes of its smallest GPU, or None where
            unknown}; default: read on each GPU node (``gpu_memory_by_node``).
        host_bytes: the node's memory (CPU roles); default: this machine's
            (the driver runs on the one node).

    Returns:
        The plan, or None (CPU roles over several nodes, or a GPU whose
        memory nvidia-smi cannot read: a simulated one; logged).

    Raises:
        ClusterFitError: a device (or the host) and phase that overflow, with
            what holds the most, and the command that lists the knobs that
            would fit.
    """
    from rayspec.memory_plan import PROMPT_TOKENS, cpu_plan, plan
    from rayspec.model_shape import ModelShape

    prompt_tokens = PROMPT_TOKENS if prompt_tokens is None else prompt_tokens

    if cfg.rollout.num_gpus_per_replica <= 0 and cfg.train.num_gpus_per_worker <= 0:
        if len(nodes) != 1:
            log.info("memory plan of CPU roles not checked: %d nodes (jobs.project_memory --hardware cpu "
                     "plans one)", len(nodes))
            return None
        try:
            shape = ModelShape.from_hf_config(model_dir)
        except ValueError as e:  # an architecture the plan does not know runs all the same on CPUs
            log.warning("memory plan of CPU roles not checked: %s", e)
            return None
        if host_bytes is None:
            import psutil

            host_bytes = psutil.virtual_memory().total
        result, what, hardware = cpu_plan(cfg, shape, host_bytes, prompt_tokens=prompt_tokens), \
            "this node's host memory", f"cpu --host-gib {host_bytes / 2**30:.0f}"
    elif cfg.rollout.num_gpus_per_replica <= 0 or cfg.train.num_gpus_per_worker <= 0:
        return None  # a GPU role beside a CPU one: the GPU plan needs both on GPUs
    else:
        gpu_nodes = [n for n in nodes if n.gpus > 0]
        if device_bytes is None:
            device_bytes = gpu_memory_by_node(gpu_nodes)
        known = [device_bytes.get(n.node_id) for n in gpu_nodes]
        if not gpu_nodes or None in known:
            log.warning("memory plan not checked: nvidia-smi gave no GPU memory on node(s) %s",
                        [n.node_id[:8] for n, b in zip(gpu_nodes, known) if b is None])
            return None
        result = plan(cfg, ModelShape.from_hf_config(model_dir), "", gpus_per_node=int(max(n.gpus for n in gpu_nodes)),
                      nodes=len(gpu_nodes), prompt_tokens=prompt_tokens, device_bytes=min(known),
                      host_bytes=float("inf"))
        what, hardware = "this cluster's GPUs", "<h100|h200|gb200> --gpus N"
    problems = result.problems()
    if problems:
        raise ClusterFitError(f"the memory plan does not fit {what}:\n  " + "\n  ".join(problems)
                              + "\n(python -m jobs.project_memory <the same preset and overrides> --model "
                              f"<model.path> --hardware {hardware} prints the plan and the knobs that would fit)")
    log.info("memory plan: fits (%s)", "; ".join(
        f"{d.name} peak {max(d.used(p) for p in result.PHASES) / 2**30:.1f} of {d.capacity / 2**30:.1f} GiB"
        for d in result.devices if d.count))
    return result


def gpu_memory_by_node(nodes: list[NodeInfo]) -> dict[str, Optional[int]]:
    """{node id: bytes of the node's smallest GPU, or None where
    ``nvidia-smi`` cannot say (simulated GPUs)}: one task per node, pinned
    to it, using no CPU or GPU (``nvidia-smi`` opens no CUDA context), so
    it runs before any role is placed."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rayspec.tools import node_check

    @ray.remote(num_cpus=0)
    def query() -> Optional[int]:
        sizes = node_check.gpu_memory()
        return min(sizes) if sizes else None

    refs = [query.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False)).remote()
            for n in nodes]
    return dict(zip((n.node_id for n in nodes), ray.get(refs, timeout=120)))


def node_inputs(cfg: RunConfig) -> list[tuple[str, str]]:
    """(config key, path) of each local file or directory a role reads,
    besides the policy and the run directory: the dataset's files (on rank
    0), the reward functions' and the tools' Python files (in reward workers
    beside rank 0 and in the replicas), a draft model (in the replicas; a
    given EAGLE-3 head is copied into the run directory). Paths that name
    nothing here (a hub dataset id) are left out."""
    out = []
    for key, path in (("data.path", cfg.data.path), ("data.eval_path", cfg.data.eval_path)):
        if path and "://" not in path:
            out += [(key, p) for p in (sorted(glob.glob(path)) if glob.has_magic(path) else [path])
                    if os.path.exists(p)]
    specs = [(f"reward.functions[{i}]", s) for i, s in enumerate(cfg.reward.functions)] + \
            [(f"rollout.tools[{i}]", s) for i, s in enumerate(cfg.rollout.tools)] + \
            [("rollout.environment", s) for s in [cfg.rollout.environment] if s]
    # as given: a role resolves a relative path in its own working directory (under `ray job submit`, the
    # job's working_dir, unpacked on every node), as the check's task on the node does
    out += [(key, s.rsplit(":", 1)[0]) for key, s in specs if s.rsplit(":", 1)[0].endswith(".py")]
    spec = cfg.rollout.speculative_config
    if spec.method == "draft_model" and spec.model:
        out.append(("rollout.speculative_config.model", spec.model))
    return out


def _what_this_node_sees(model_path: str, cache_dir: str, paths: list[str], markers: list[str]) -> dict:
    """On one node: whether it sees each of ``markers``, the digest of each of
    ``paths`` (None: not there) and of the policy as this node resolves it
    (a bundled model: dequantised into this node's ``cache_dir`` now, once,
    before the roles start), or why it cannot."""
    out = {"markers": [os.path.exists(m) for m in markers], "paths": [content_digest(p) for p in paths]}
    try:
        out["model"] = content_digest(resolve_model_path(model_path, cache_dir))
    except (ConfigError, OSError) as e:
        out["model_error"] = f"{type(e).__name__}: {e}"
    return out


def check_nodes_see_inputs(cfg: RunConfig, plan: PlacementPlan, model_dir: str, timeout_s: float = 900.0) -> None:
    """On several nodes, before any role starts: every node the plan gives a
    role (other than the driver's) sees what the run's roles read, through
    Ray, in a zero-CPU task on it:

    - ``trainer.run_dir`` itself, not a copy: the replicas read the draft
      head there, rank 0 and the DraftTrainer write records, checkpoints
      and the trained policy there (a marker the driver writes must show),
      and ``trainer.storage_path`` where it is a directory (Ray Train's
      workers write their checkpoint shards there); a URI (``s3://``) is
      reached through its own client;
    - the policy, with the driver's content: a bundled model is resolved in
      the node's own ``model.cache_dir`` (its HOME's, as
      ``cluster/install_node.sh`` made it), a path must hold the same files;
    - each of ``node_inputs`` with the driver's content (shared storage, or
      the same copy at the same path).

    Raises:
        ConfigError: naming the key, the path, the node (id, address and
            its roles) and what it sees instead; the directory the check
            created, if any, is removed again.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    nodes = [n for n in plan.nodes if n.node_id != here and any(b.node_id == n.node_id for b in plan.bundles)]
    if not nodes:
        return
    inputs = node_inputs(cfg)
    want = {"model": content_digest(model_dir), "paths": [content_digest(p) for _, p in inputs]}
    storage = cfg.trainer.storage_path
    shared = {"trainer.run_dir": Path(cfg.trainer.run_dir)}
    if storage and "://" not in storage:
        shared["trainer.storage_path"] = Path(storage).expanduser()
    created = [d for d in shared.values() if not d.exists()]
    markers = []
    for d in shared.values():
        d.mkdir(parents=True, exist_ok=True)
        markers.append(d / f".rayspec-node-check-{uuid.uuid4().hex[:12]}")
        markers[-1].touch()
    probe = ray.remote(num_cpus=0)(_what_this_node_sees)
    try:
        refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False)).remote(
            cfg.model.path, cfg.model.cache_dir, [p for _, p in inputs], [str(m) for m in markers]) for n in nodes]
        seen = ray.get(refs, timeout=timeout_s)
    finally:
        for m in markers:
            m.unlink()
    why = {"trainer.run_dir": "the replicas read the draft head from it, rank 0 and the DraftTrainer write "
                              "records and the trained policy into it" + ("" if storage else
                              f", and Ray Train's checkpoints (<run_dir>/{TRAIN_STORAGE})"),
           "trainer.storage_path": "Ray Train's workers write their checkpoint shards into it and restore from it "
                                   "(or give a pyarrow.fs URI such as s3://bucket/prefix)"}
    problems = []
    for n, got in zip(nodes, seen):
        where = f"node {n.node_id[:8]} ({n.address or '?'}; runs " + ", ".join(
            sorted({b.role for b in plan.bundles if b.node_id == n.node_id})) + ")"
        for (key, d), seen_it in zip(shared.items(), got["markers"]):
            if not seen_it:
                problems.append(f"{key}={d}: {where} does not see this directory (it is local to the driver's "
                                "node); on several nodes it must be storage every node mounts (NFS, a cluster "
                                f"filesystem): {why[key]}")
        if "model_error" in got:
            problems.append(f"model.path={cfg.model.path}: {where} cannot load it: {got['model_error']}")
        elif got["model"] != want["model"]:
            problems.append(f"model.path={cfg.model.path}: {where} holds other files at "
                            f"{'its model.cache_dir' if cfg.model.path.startswith('bundled:') else 'that path'} "
                            "than the driver's node (another release, or a partial copy)")
        for (key, path), have, expect in zip(inputs, got["paths"], want["paths"]):
            if have != expect:
                problems.append(f"{key}={path}: {where} " + ("does not see it" if have is None else
                                                              "holds another file or directory there"))
    if problems:
        for d in created:
            with contextlib.suppress(OSError):
                d.rmdir()
        raise ConfigError("on several nodes every node that runs a role reads the run's inputs (put them on "
                          "storage every node mounts, or the same copy at the same path on each node):\n  "
                          + "\n  ".join(problems))
    log.info("inputs: %d node(s) besides the driver's see the run directory, the policy and %d input file(s)",
             len(nodes), len(inputs))
