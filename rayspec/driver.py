"""The driver of a run: check its inputs (``rayspec.preflight``), join or
start Ray, plan the placement, start the roles where the plan puts them, and
run the RL loop in Ray Train.

Each role declares its own resources in the config (rollout:
``num_cpus_per_replica`` / ``num_gpus_per_replica``; train:
``num_cpus_per_worker`` / ``num_gpus_per_worker``; draft: ``num_cpus`` /
``num_gpus``); ``scheduler.layout`` decides how they share the cluster
(``rayspec.scheduler.placement``) and ``scheduler.mode`` when rollouts run
(``rayspec.scheduler.pipeline``). A node that dies mid-run is placed around
(``NodeWatch``, ``rayspec.scheduler.recovery``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from pathlib import Path

import ray
from omegaconf import OmegaConf
from tqdm.contrib.logging import logging_redirect_tqdm

from rayspec.config import (DEFAULT_DRAFT_SAMPLE_METHOD, NAMESPACE, ConfigError, RunConfig, draft_online,
                            dtype_reason)
from rayspec.data import load_problems
from rayspec.models import load_policy
from rayspec.models.acceptance import ACCEPTANCE_FILE
from rayspec.preflight import (check_inputs, check_memory_plan, check_nodes_see_inputs, check_resume, check_run_dir,
                               longest_prompt_tokens)
from rayspec.scheduler.placement import ROLES, ClusterFitError, cluster_nodes, plan_placement
from rayspec.scheduler.recovery import alive_node_ids, dead_nodes, moved_roles, plan_without, start_node_events
from rayspec.console import Console
from rayspec.relay import start_console_relay
from rayspec.metrics import read_metrics
from rayspec.tracking import RecordFollower, check_trackers_installed, open_trackers
from rayspec.train.checkpoint import TRAIN_NAME, train_storage

log = logging.getLogger(__name__)



def init_ray(cfg: RunConfig) -> Path | None:
    """Join ``ray.address`` or start an embedded cluster sized by the config,
    streaming the roles' output to this process only with
    ``logging.verbose`` (``rayspec.console``).

    Under ``ray job submit`` the job's driver joins its cluster (address
    ``auto`` is implied by RAY_ADDRESS).

    Returns:
        The directory of Ray's logs on this node (its session's ``logs``),
        or None where Ray was already up (started by the caller).
    """
    if ray.is_initialized():
        return None
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
    # the libraries' output on this console only where asked for (rayspec.console)
    common = {"namespace": NAMESPACE, "runtime_env": env, "log_to_driver": cfg.logging.verbose}
    if cfg.ray.address is not None or os.environ.get("RAY_ADDRESS"):
        ctx = ray.init(address=cfg.ray.address, **common)
    else:
        # "local": always a new embedded cluster, never a stray `ray start` one
        ctx = ray.init(address="local", num_cpus=cfg.ray.num_cpus or os.cpu_count(),
                       object_store_memory=cfg.ray.object_store_memory, **common)
    if not cfg.logging.verbose:
        # Serve's client in this process logs its start and connections at INFO; importing
        # ray.serve sets that logger up (Ray 2.60: configure_default_serve_logger), so first
        from ray import serve  # noqa: F401

        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    session = ctx.address_info.get("session_dir")
    return Path(session) / "logs" if session else None


def link_ray_logs(run_dir: Path, logs: Path | None, verbose: bool) -> None:
    """``<run_dir>/ray_logs``: a link to Ray's logs on this node (every
    role's stdout and stderr there, the libraries' output included), named
    on the console once."""
    where = "`ray logs cluster` lists every node's, the dashboard's Logs view shows them"
    if logs is not None:
        link = run_dir / "ray_logs"
        if link.is_symlink():
            link.unlink()  # a resumed run's: the session before
        if not link.exists():
            link.symlink_to(logs, target_is_directory=True)
            where = f"{link} -> {logs} on this node; {where}"
    log.info("the libraries' output (vLLM, Ray Serve, Ray Train, DeepSpeed) is in Ray's worker logs: %s%s", where,
             "" if verbose else "; logging.verbose=true shows it here too")


def _absolute(cfg: RunConfig) -> RunConfig:
    """Resolve relative paths against the driver's cwd (workers run
    elsewhere). ``model.cache_dir`` keeps a leading ``~``: each node expands
    it to its own HOME (a cache is a node's own)."""
    def absp(p):
        return p if p is None or "://" in p or p.startswith("bundled:") or not os.path.exists(p) \
            else str(Path(p).expanduser().resolve())
    cache = cfg.model.cache_dir
    return dataclasses.replace(
        cfg, trainer=dataclasses.replace(cfg.trainer, run_dir=str(Path(cfg.trainer.run_dir).expanduser().resolve())),
        data=dataclasses.replace(cfg.data, path=absp(cfg.data.path)),
        model=dataclasses.replace(cfg.model, path=absp(cfg.model.path),
                                  cache_dir=cache if cache.startswith("~") else str(Path(cache).resolve())))


def prepare_draft(cfg: RunConfig, model_dir: str, run_dir: Path) -> tuple[str | None, list[int] | None]:
    """The draft checkpoint replicas start with, and the aux layers to capture.

    For eagle3 the head lives in ``<run_dir>/draft_head``: a copy of
    ``speculative_config.model`` when given (with its acceptance record,
    where adaptive speculation starts from; a published head's aux layers
    written into its config as vLLM resolves them), else the head already
    there, else a new head for the policy whose draft vocabulary
    (``draft.draft_vocab_size``) is the most frequent tokens of the training
    prompts. The aux layers are the head's own.
    """
    spec = cfg.rollout.speculative_config
    if spec.method != "eagle3":
        return spec.model, None
    from rayspec.draft.eagle3 import (aux_layer_ids, head_init_tensors, init_head, load_head, save_head,
                                      with_aux_layer_ids)

    head_dir = run_dir / "draft_head"

    def num_layers() -> int:  # read only where needed: a given head may name its layers
        return json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]

    def aux_ids(head_cfg: dict) -> list[int]:  # the policy's depth only where the head names no layers
        return aux_layer_ids(head_cfg, None) or aux_layer_ids(head_cfg, num_layers())

    if spec.model is not None:
        head = load_head(spec.model)
        head.cfg = with_aux_layer_ids(head.cfg, aux_ids(head.cfg))
        save_head(head, head_dir)
        record = Path(spec.model) / ACCEPTANCE_FILE  # validated by check_inputs
        if record.is_file():
            shutil.copyfile(record, head_dir / ACCEPTANCE_FILE)
    elif not (head_dir / "model.safetensors").is_file():
        policy = load_policy(model_dir, only=head_init_tensors(num_layers()))  # not the whole policy on the driver
        save_head(init_head(policy, cfg.draft.aux_hidden_state_layer_ids, seed=cfg.trainer.seed,
                            draft_vocab=_prompt_draft_vocab(cfg, model_dir, policy.config.vocab_size)), head_dir)
    return str(head_dir), aux_ids(json.loads((head_dir / "config.json").read_text()))


def draft_start(cfg: RunConfig, draft_dir: str) -> tuple[float, str, float | None]:
    """How the DraftTrainer starts on ``prepare_draft``'s head: its learning
    rate and why (``online_lr``: a given head continues at its warm start's
    final rate) and the training cadence's prior, the head's recorded
    acceptance length at the replicas' k and draft method
    (``recorded_acceptance_length``; None for a fresh head).

    Raises:
        ValueError: the head's acceptance record is malformed (named).
    """
    from rayspec.draft.trainer import online_lr, recorded_acceptance_length

    spec = cfg.rollout.speculative_config
    lr, why = online_lr(cfg.draft.lr, draft_dir, trained=spec.model is not None)
    prior = recorded_acceptance_length(draft_dir, spec.draft_sample_method or DEFAULT_DRAFT_SAMPLE_METHOD,
                                       spec.num_speculative_tokens)
    return lr, why, prior


def _prompt_draft_vocab(cfg: RunConfig, model_dir: str, vocab_size: int):
    """[draft.draft_vocab_size] token ids, the most frequent in the first 1000
    training prompts (the policy has written nothing yet), or None for the
    whole vocabulary."""
    n = cfg.draft.draft_vocab_size
    if n is None or n >= vocab_size:
        return None
    from rayspec.data import prompt_ids
    from rayspec.draft.vocab import select_draft_vocab, token_counts
    from rayspec.models import load_tokenizer

    tok = load_tokenizer(model_dir)
    # 1000 prompts: 0.7 s to tokenize here, where all of GSM8K's 7473 took 13 s
    problems = load_problems(cfg.data)[:1000]
    counts = token_counts((prompt_ids(tok, p) for p in problems), vocab_size)
    ids = select_draft_vocab(counts, n, always=[t for t in (tok.eos_token_id, tok.pad_token_id) if t is not None])
    log.info("draft vocabulary: %d of %d tokens, by frequency in %d training prompts", n, vocab_size,
                len(problems))
    return ids


def save_draft_head(draft, first_start, out: Path) -> bool:
    """Write the DraftTrainer's head to ``out`` after the run (its final
    head), unless the actor died, or Ray restarted it after the last step
    and no step took the restart over (it holds ``out``'s initial head
    again); ``first_start``: the ObjectRef of ``incarnation()`` called on
    its first start. Returns whether it wrote."""
    why = None
    try:
        now, adopted = ray.get(draft.incarnation.remote())
        try:
            first = ray.get(first_start)[0]
        except ray.exceptions.RayActorError:  # died before answering: only adoption tells
            first = None
        if now != first and not adopted:
            why = "was restarted after the last step"
        else:
            ray.get(draft.save.remote(str(out)))
    except ray.exceptions.RayActorError:
        why = "died at the end of the run"
    if why:
        log.warning("the DraftTrainer %s: %s is not its final head; the last checkpoint with a draft state "
                    "holds the newest one", why, out)
    return why is None


class Roles:
    """The run's roles where the placement plan puts them: the rollout
    deployment (Ray Serve), the DraftTrainer (a Ray actor) and the Train
    workers' ``TorchTrainer`` (one per attempt); ``follow`` moves them to a
    new plan after a node died.

    Args:
        cfg: the run's config (paths absolute).
        plan: the placement plan.
        draft_dir: the draft the replicas start with (``prepare_draft``).
        aux_ids: the verifier layers the EAGLE-3 head reads, or None.
    """

    def __init__(self, cfg: RunConfig, plan, draft_dir: str | None, aux_ids: list[int] | None):
        from rayspec.rollout.serve import deploy_rollout

        self.cfg, self.plan, self.draft_dir = cfg, plan, draft_dir
        t0 = time.perf_counter()
        log.info("deploying %d rollout replica(s) (speculative_config=%s)", cfg.rollout.num_replicas,
                 cfg.rollout.speculative_config)
        deploy_rollout(cfg, cfg.model.path, draft_dir, plan)
        self.draft = self.first_start = self.draft_prior = None
        self.aux_ids = aux_ids if draft_online(cfg) else None
        if draft_online(cfg):
            self.lr, why, self.draft_prior = draft_start(cfg, draft_dir)
            log.info("draft head learning rate %.3g: %s; recorded acceptance length %s", self.lr, why,
                     "none (a fresh head)" if self.draft_prior is None else f"{self.draft_prior:.3f}")
            self._start_draft()
        log.info("rollout ready in %.0fs", time.perf_counter() - t0)

    def _start_draft(self) -> None:
        from rayspec.draft.client import DRAFT_TRAINER_NAME
        from rayspec.draft.trainer import DraftTrainer

        cfg, spec = self.cfg, self.cfg.rollout.speculative_config
        # threaded: features arrive (submit_features) while train() runs
        self.draft = ray.remote(DraftTrainer).options(
            name=DRAFT_TRAINER_NAME, max_concurrency=2, max_restarts=cfg.draft.max_restarts,
            **self.plan.draft_options()).remote(
            self.draft_dir, self.lr, cfg.draft.ttt_steps, cfg.draft.torch_threads,
            cfg.draft.buffer_steps, cfg.trainer.seed,
            self.plan.cores.get("draft", {}).get(self.plan.role("draft")[0].node_id),
            device="cuda" if cfg.draft.num_gpus > 0 else "cpu",
            num_speculative_tokens=spec.num_speculative_tokens,
            draft_sample_method=spec.draft_sample_method or DEFAULT_DRAFT_SAMPLE_METHOD,
            temperature=cfg.grpo.temperature, tv_loss_weight=cfg.draft.tv_loss_weight)
        self.first_start = self.draft.incarnation.remote()  # runs on the first start, whatever happens later

    def trainer(self):
        """A ``TorchTrainer`` of the RL loop on the plan's Train bundles. Its
        storage path and name are the run's, so it resumes from the run's
        latest checkpoint where there is one (a resume, or the Train workers
        of a dead node restarted elsewhere)."""
        from ray.train import CheckpointConfig, FailureConfig
        from ray.train import RunConfig as TrainRunConfig
        from ray.train.torch import TorchTrainer

        from rayspec.train.loop import rl_worker_loop

        cfg = self.cfg
        return TorchTrainer(
            rl_worker_loop,
            train_loop_config={"cfg": cfg, "aux_layer_ids": self.aux_ids,
                               "cores": self.plan.cores.get("train", {}), "draft_prior": self.draft_prior},
            scaling_config=self.plan.scaling_config(),
            # on several nodes every node reaches it (check_nodes_see_inputs)
            run_config=TrainRunConfig(
                name=TRAIN_NAME, storage_path=train_storage(cfg.trainer),
                checkpoint_config=CheckpointConfig(num_to_keep=cfg.trainer.num_to_keep),
                # a worker group pinned to a dead node never starts: Ray Train's retries (every
                # RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, 60 s) would go on for ever, so the first
                # one that fails ends the attempt and the driver places the group again
                failure_config=FailureConfig(max_failures=cfg.trainer.max_failures, controller_failure_limit=0)))

    def follow(self, plan) -> dict[str, list[str]]:
        """Move to ``plan``: the rollout deployment is deployed again where
        a replica moved (Serve replaces its replicas, which catch up on the
        newest weights before their first rollout), the DraftTrainer started
        again where it moved (the next step restores it from the newest
        checkpoint); the Train workers take the plan at the next
        ``trainer()``. Returns ``moved_roles``."""
        from rayspec.rollout.serve import deploy_rollout

        moved = moved_roles(self.plan, plan)
        self.plan = plan
        if "rollout" in moved:
            deploy_rollout(self.cfg, self.cfg.model.path, self.draft_dir, plan)
        if "draft" in moved and self.draft is not None:
            ray.kill(self.draft, no_restart=True)
            self._start_draft()
        return moved

    def stop_rollout(self) -> None:
        """Delete the rollout deployment (a run that cannot go on: rank 0's
        rollouts then fail instead of waiting for replicas)."""
        from ray import serve

        from rayspec.rollout.serve import APP_NAME

        serve.delete(APP_NAME)

    def stop(self) -> None:
        """End of run: the rollout deployment and the DraftTrainer go; Serve
        stops unless other apps use it, so a later ``jobs.serve`` starts it
        with its HTTP options."""
        from ray import serve

        self.stop_rollout()
        if not serve.status().applications:
            serve.shutdown()
        if self.draft is not None:
            ray.kill(self.draft)


class NodeWatch:
    """While an attempt's Train workers run, a thread asks Ray every
    ``poll_s`` seconds whether a node of the plan died. When one did, the
    roles move to the plan without it (``plan_without``: what ran elsewhere
    stays, waiting up to ``scheduler.node_wait_s`` for nodes where the nodes
    left cannot hold the layout), after the new nodes pass
    ``check_nodes_see_inputs``; the loss is logged and posted for the next
    step record (``NodeEvents``) once its roles run again: at once for the
    rollout and the DraftTrainer, when the next attempt starts where Train
    workers moved (``take_train_moves``).

    Attributes:
        losses: the losses met in this attempt (each an event dict).
        error: why the run cannot go on (the nodes left cannot hold the
            layout, or a new node does not see the inputs); the rollout
            deployment is then deleted, so the attempt ends.
    """

    def __init__(self, roles: Roles, events, model_dir: str, poll_s: float = 2.0):
        import threading

        self.roles, self.events, self.model_dir, self.poll_s = roles, events, model_dir, poll_s
        self.losses: list[dict] = []
        self.error: Exception | None = None
        self._train_moves: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rayspec-node-watch", daemon=True)

    def __enter__(self) -> "NodeWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s) and self.error is None:
            try:
                self.check()
            except Exception as e:  # noqa: BLE001 - a failure to move is the run's end, not the thread's
                log.exception("placing the roles of a dead node again failed")
                self._stop_run(e)

    def check(self) -> dict | None:
        """One look: the event of a node loss handled now, or None."""
        with self._lock:
            if self.error is not None:
                return None
            plan = self.roles.plan
            dead = dead_nodes(plan, alive_node_ids())
            if not dead:
                return None
            detected = time.time()
            lost = {r: [b.index for b in plan.role(r) if b.node_id in dead] for r in ROLES
                    if any(b.node_id in dead for b in plan.role(r))}
            names = ", ".join(f"{n[:8]} ({next(x.address for x in plan.nodes if x.node_id == n) or '?'})"
                              for n in dead)
            log.warning("node(s) %s died, holding %s: placing those roles again", names,
                        "; ".join(f"{r} {idx}" for r, idx in lost.items()))
            try:
                new = plan_without(self.roles.cfg, plan, cluster_nodes, self.roles.cfg.scheduler.node_wait_s)
                check_nodes_see_inputs(self.roles.cfg, new, self.model_dir)
            except (ClusterFitError, ConfigError) as e:
                log.error("the run stops: %s", e)
                self._stop_run(e)
                return None
            moved = self.roles.follow(new)
            event = {"nodes": [n[:8] for n in dead], "lost": lost, "moved": moved, "detected_at": detected,
                     "recovered_s": time.time() - detected}
            self.losses.append(event)
            log.warning("the roles of node(s) %s run again (%.0f s): %s; placement now:\n%s", names,
                        event["recovered_s"], ", ".join(f"{r} on {', '.join(n)}" for r, n in moved.items())
                        or "nothing moved", new.describe())
            if "train" in moved:  # posted once the Train workers start again
                self._train_moves.append(event)
            else:
                self.events.post.remote(event)
            return event

    def _stop_run(self, error: Exception) -> None:
        """The run cannot go on: the Train workers are told why (they save
        the last step they finished, ``recovery.stopping_run``), then the
        rollout deployment goes, so that rank 0's wait for replicas ends."""
        self.error = error
        ray.get(self.events.stop.remote(str(error)), timeout=60)  # posted before rank 0 can ask
        self.roles.stop_rollout()

    def wait_for_loss(self, grace_s: float) -> None:
        """After the attempt failed: look for a node loss for up to
        ``grace_s`` seconds (Ray marks a node dead once its health checks
        fail, which may come after Ray Train gave its workers up)."""
        deadline = time.monotonic() + grace_s
        while not self.losses and self.error is None and time.monotonic() < deadline:
            self.check()
            time.sleep(self.poll_s)

    def take_train_moves(self) -> None:
        """The next attempt starts: the losses that moved Train workers are
        posted, their ``recovered_s`` counted up to now."""
        for event in self._train_moves:
            event["recovered_s"] = time.time() - event["detected_at"]
            self.events.post.remote(event)
        self._train_moves = []


def saved_state(trainer) -> str:
    """What a run that stopped leaves to continue from (``TrainerConfig``):
    its latest checkpoint's step and the ``resume=`` that continues it."""
    from rayspec.train.checkpoint import checkpoints, read_trainer_state

    storage = train_storage(trainer)
    found = checkpoints(storage)
    if not found:
        return "No step was finished: nothing to resume"
    where = found[-1].path if "://" not in storage else f"{found[-1].path.rsplit('/', 1)[-1]} under {storage}"
    return (f"The state after step {read_trainer_state(found[-1])['step']} is saved ({where}): "
            f"resume={trainer.run_dir} continues from it")


# Ray marks a node dead after its health checks fail for 15 s (health_check_period_ms 3000 x
# health_check_failure_threshold 5): an attempt that failed looks for a loss this long
NODE_DEATH_GRACE_S = 30.0


def run(cfg: RunConfig, resume: bool = False) -> Path:
    """Run GRPO steps up to ``cfg.trainer.steps``; returns the run directory.

    A node that dies mid-run is placed around (``NodeWatch``): its rollout
    replicas and the DraftTrainer start again on the nodes left, its Train
    workers restart there from the last checkpoint (a new attempt, as
    ``resume``); where the nodes left cannot hold the layout, the run waits
    up to ``scheduler.node_wait_s`` for nodes to join, then stops with a
    ``ClusterFitError``, the Train workers (where they live) saving the last
    step they finished first: ``resume=`` continues it.

    Args:
        cfg: the run's config.
        resume: continue the run in ``cfg.trainer.run_dir`` from its latest
            checkpoint (Ray Train restores a run of the same storage path
            and name).

    Raises:
        ConfigError: bad config, model, draft or data (``check_inputs``),
            a checkpoint where none is expected / none where resume is
            (``check_resume``), or on several nodes, a node that runs a role
            and does not see the run directory or an input
            (``check_nodes_see_inputs``), or a tracker of
            ``trainer.report_to`` that cannot start (``open_trackers``).
        ClusterFitError: the layout does not fit the cluster.
        All before any role is started.
        ClusterFitError: a node died and the nodes left (with those that
            joined within ``scheduler.node_wait_s``) cannot hold the layout;
            the message ends with the step saved and the ``resume=`` to run.
        RunAborted: the Train workers met a bad input a restart would meet
            again (a reward function that raised, a data file's bad row;
            ``rayspec.train.ranks.RunAborted``); the records and
            checkpoints written before it stay.
        ray.train.TrainingFailedError: the Train workers failed more than
            ``trainer.max_failures`` times with every node alive.
    """
    cfg = _absolute(cfg)
    check_resume(cfg, resume)
    model_dir = check_inputs(cfg)
    check_trackers_installed(cfg)
    check_run_dir(cfg)
    ray_logs = init_ray(cfg)
    nodes = cluster_nodes()
    plan = plan_placement(cfg, nodes)
    check_memory_plan(cfg, model_dir, nodes, prompt_tokens=longest_prompt_tokens(cfg, model_dir))
    check_nodes_see_inputs(cfg, plan, model_dir)
    log.info("scheduler mode %s%s; %s", cfg.scheduler.mode,
             f" (max_policy_lag {cfg.scheduler.max_policy_lag})" if cfg.scheduler.mode == "async" else "",
             plan.describe())
    log.info("model.dtype %s: %s", cfg.model.dtype, dtype_reason(cfg))
    run_dir = Path(cfg.trainer.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), run_dir / "config.yaml")
    link_ray_logs(run_dir, ray_logs, cfg.logging.verbose)
    trackers = open_trackers(cfg, run_dir)
    done = max((r["step"] for r in read_metrics(run_dir)), default=0) \
        if resume and (run_dir / "metrics.jsonl").is_file() else 0
    console = Console(cfg.trainer.steps, done, lines=not cfg.logging.verbose,
                      relay=None if cfg.logging.verbose else start_console_relay())
    follower = RecordFollower(run_dir, [console, *trackers], skip_existing=resume)
    failed = True
    try:
        with logging_redirect_tqdm(), follower:  # on leaving, the records written since its last look
            _run_roles(cfg, plan, model_dir, run_dir)
        failed = False
    finally:
        follower.finish({"curves": run_dir / "curves.png", "policy": run_dir / "policy",
                         "draft_head": run_dir / "draft_head"}, failed)
    return run_dir


def _run_roles(cfg: RunConfig, plan, model_dir: str, run_dir: Path) -> None:
    """``run``'s roles started where ``plan`` puts them and its attempts run
    to the end (see ``run``)."""
    from ray.train import TrainingFailedError

    from rayspec.train.ranks import RunAborted

    draft_dir, aux_ids = prepare_draft(cfg, model_dir, run_dir)
    events = start_node_events()
    roles = Roles(cfg, plan, draft_dir, aux_ids)
    try:
        while True:
            with NodeWatch(roles, events, model_dir) as watch:
                try:
                    aborted = roles.trainer().fit().return_value  # the workers stopped on a bad input
                    break
                except TrainingFailedError as e:
                    failed = e
                    watch.wait_for_loss(NODE_DEATH_GRACE_S)
            if watch.error is not None:
                break
            if not watch.losses:
                raise failed
            log.warning("attempt failed after losing node(s) %s (%s): the Train workers start again on the "
                        "plan without them, from the last checkpoint",
                        ", ".join(n for e in watch.losses for n in e["nodes"]), type(failed).__name__)
            watch.take_train_moves()
        if watch.error is not None:  # the Train workers saved the last step they finished, then stopped (or
            # died with their node: the last checkpoint stays)
            raise type(watch.error)(f"{watch.error}. {saved_state(cfg.trainer)}") from None
        if aborted:
            raise RunAborted(aborted)
        if roles.draft is not None:
            save_draft_head(roles.draft, roles.first_start, run_dir / "draft_head")
    finally:
        roles.stop()
        ray.kill(events)
