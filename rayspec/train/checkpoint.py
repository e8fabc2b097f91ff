"""RL checkpoints through Ray Train: written with ``ray.train.report(checkpoint=...)``,
read back with ``ray.train.get_checkpoint()`` when a run resumes or its
worker group restarts after a failure.

One checkpoint directory (Ray Train merges every rank's files into it and
registers it only once all ranks have reported, so a crash mid-write never
leaves a checkpoint that a resume would pick)::

    policy/            DeepSpeed ``save_checkpoint``: fp32 weights, optimizer
                       (each rank its ZeRO partition), DeepSpeed's own state
    rng_rank<r>.json   torch / Python / NumPy RNG states of rank r
    trainer_state.json step, the run's trainer.steps, policy version, data
                       cursor of the next batch to train
    draft.safetensors  DraftTrainer: head, AdamW state, replay buffer
    draft.json         (only with online draft training)

Everything rayspec writes is JSON or safetensors; DeepSpeed's own files are
``torch.save`` pickles, read by DeepSpeed with ``weights_only=False``: resume
only run directories you trust (your own runs).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from rayspec.draft.state import DRAFT_JSON
from rayspec.files import json_tuples

log = logging.getLogger(__name__)

TRAIN_STORAGE, TRAIN_NAME = "ray_train", "train"  # <run_dir>/ray_train/train/checkpoint_* by default
SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray 2.60 Train V2's list of the checkpoints it registered

POLICY_TAG = "policy"
TRAINER_STATE = "trainer_state.json"


def _rng_state() -> dict[str, Any]:
    kind, keys, *rest = np.random.get_state()
    return {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
            "python": random.getstate(), "numpy": [kind, keys.tolist(), *rest]}


def _set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(s["torch"])), dtype=torch.uint8))
    random.setstate(json_tuples(s["python"]))
    kind, keys, *rest = s["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))


def report_checkpoint(metrics: dict[str, Any], engine, rank: int,
                      trainer_state: dict[str, Any] | None,
                      stage_draft: Callable[[Path], Any] | None) -> None:
    """Write this rank's part of a checkpoint and report it with ``metrics``
    (rank 0 logs it). Collective: every rank calls it at the same step.

    Args:
        metrics: numeric metrics of the step (``ray.train.report``).
        engine: the policy's DeepSpeed engine (``save_checkpoint`` is collective).
        rank: world rank.
        trainer_state: rank 0: {"step", "policy_version", "prompts" (the
            PromptSource cursor of the next batch to train)}; None elsewhere.
        stage_draft: rank 0 with online draft training: writes the
            DraftTrainer's state into the staging directory it is given
            (``rayspec.draft.state.stage_draft_state``).

    Raises:
        OSError: this rank's part could not be staged (the system temp dir,
            ``TMPDIR``, is full or unwritable); names the directory and its
            free space. Earlier checkpoints are untouched: Ray Train registers
            a checkpoint only once every rank has reported it.
    """
    import ray.train

    with tempfile.TemporaryDirectory(prefix="rayspec-ckpt-") as tmp:
        d = Path(tmp)
        try:
            save_engine(engine, d / "policy")
            (d / f"rng_rank{rank}.json").write_text(json.dumps(_rng_state()))
            if trainer_state is not None:
                (d / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
            if stage_draft is not None:
                stage_draft(d)
        except (OSError, RuntimeError) as e:
            # torch.save reports a full disk as "basic_ios::clear: iostream error"
            staged = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
            raise OSError(f"rank {rank}: staging the checkpoint under {tmp} failed after "
                          f"{staged / 2**30:.2f} GiB with {shutil.disk_usage(tmp).free / 2**30:.2f} GiB "
                          f"free there (TMPDIR moves the staging directory): {type(e).__name__}: {e}") from e
        # Ray Train copies the directory into the run's storage before returning
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
    if trainer_state is not None:
        log.info("step %d: checkpoint saved", trainer_state["step"])


def restore_checkpoint(checkpoint, engine, rank: int,
                       restore_draft: Callable[[Path, dict[str, Any]], Any] | None = None
                       ) -> tuple[dict[str, Any], Any]:
    """Load a checkpoint written by ``report_checkpoint`` into ``engine`` and
    this process's RNGs. Collective (DeepSpeed ``load_checkpoint``).

    Args:
        restore_draft: rank 0 with online draft training: called with the
            checkpoint's directory and its trainer state where it holds
            draft state (``rayspec.draft.state.restore_draft_state``).

    Returns:
        (trainer_state, what ``restore_draft`` returned, or None where it was
        not called); see ``report_checkpoint``.

    Raises:
        FileNotFoundError: the checkpoint lacks this rank's files (written
            with another number of Train workers).
    """
    with checkpoint.as_directory() as tmp:
        d = Path(tmp)
        rng = d / f"rng_rank{rank}.json"
        if not rng.is_file():
            raise FileNotFoundError(f"{rng}: checkpoint {d} has no state for rank {rank} "
                                    "(was it written with another train.num_workers?)")
        load_engine(engine, d / "policy")
        _set_rng_state(json.loads(rng.read_text()))
        state = json.loads((d / TRAINER_STATE).read_text())
        draft = restore_draft(d, state) if restore_draft is not None and (d / DRAFT_JSON).is_file() else None
    return state, draft


def train_storage(trainer) -> str:
    """Ray Train's ``storage_path`` of a run (``TrainerConfig``):
    ``trainer.storage_path`` (a directory or a ``pyarrow.fs`` URI), else
    ``<run_dir>/ray_train``; a directory as an absolute path (Ray Train's
    controller and workers do not share the driver's working directory)."""
    storage = trainer.storage_path or str(Path(trainer.run_dir) / TRAIN_STORAGE)
    return storage if "://" in storage else str(Path(storage).expanduser().absolute())


def checkpoints(storage: str | os.PathLike) -> list:
    """The checkpoints Ray Train registered under ``storage`` (a run's
    ``train_storage``), oldest first, as ``ray.train.Checkpoint`` (a path on
    the ``pyarrow.fs`` filesystem the URI names, as Ray Train resolves it:
    ``from_uri``; a plain path is local). Read one with
    ``as_directory()``, or ``rayspec.files.checkpoint_files`` for a few of
    its files.

    Ray Train copies each checkpoint into ``<storage>/train/`` and registers
    it in ``checkpoint_manager_snapshot.json`` once every rank has reported
    and the copy is complete (Ray 2.60's Train V2; it restores only those).
    A directory it has not registered is one being written, or one whose
    writer was killed mid-copy, so it is never read (a resume, a restarted
    DraftTrainer). Without a snapshot (Train V1) every directory counts.

    Raises:
        ValueError: a snapshot that is not Ray Train's JSON (named), or a
            URI no ``pyarrow.fs`` filesystem takes (``ArrowInvalid``).
        OSError: the storage cannot be read (pyarrow's error: no such
            bucket, no credentials).
    """
    import pyarrow.fs
    from ray.train import Checkpoint

    storage = os.fspath(storage)
    if "://" in storage:
        fs, root = pyarrow.fs.FileSystem.from_uri(storage)
    else:
        fs, root = pyarrow.fs.LocalFileSystem(), str(Path(storage).expanduser().absolute())
    root = f"{root.rstrip('/')}/{TRAIN_NAME}"
    found = sorted(i.path for i in fs.get_file_info(pyarrow.fs.FileSelector(root, allow_not_found=True))
                   if i.type == pyarrow.fs.FileType.Directory and i.base_name.startswith("checkpoint_"))
    snapshot = f"{root}/{SNAPSHOT}"
    if fs.get_file_info(snapshot).type != pyarrow.fs.FileType.File:
        return [Checkpoint(p, fs) for p in found]
    for attempt in range(3):  # Ray Train rewrites it in place: a read can meet it half-written
        try:
            with fs.open_input_stream(snapshot) as f:
                results = json.loads(f.read())["checkpoint_results"]
            registered = {r["checkpoint_dir_name"] for r in results}
            return [Checkpoint(p, fs) for p in found if p.rsplit("/", 1)[-1] in registered]
        except (ValueError, KeyError, TypeError) as e:
            if attempt == 2:
                where = snapshot if isinstance(fs, pyarrow.fs.LocalFileSystem) else f"{storage} ({snapshot})"
                raise ValueError(f"{where}: not Ray Train's checkpoint snapshot ({e})") from e
            time.sleep(0.2)


def read_trainer_state(checkpoint) -> dict[str, Any]:
    """A checkpoint's ``trainer_state.json`` (``report_checkpoint``), read
    through its filesystem.

    Raises:
        OSError: the file is missing or unreadable.
    """
    with checkpoint.filesystem.open_input_stream(f"{checkpoint.path.rstrip('/')}/{TRAINER_STATE}") as f:
        return json.loads(f.read())


def _has_frozen(engine) -> bool:
    """Whether the engine's module has frozen parameters (a LoRA policy's base)."""
    return any(not p.requires_grad for p in engine.module.parameters())


def save_engine(engine, out: Path) -> None:
    """DeepSpeed's ``save_checkpoint`` of the policy into ``out`` (collective):
    its trainable weights, optimizer and DeepSpeed state. Frozen parameters
    (a LoRA policy's base, the model the run started from) are left out:
    a LoRA checkpoint is its adapter and the adapter's optimizer states."""
    engine.save_checkpoint(str(out), tag=POLICY_TAG, exclude_frozen_parameters=_has_frozen(engine))


def load_engine(engine, src: Path) -> None:
    """Load ``save_engine``'s checkpoint in ``src`` into ``engine``
    (collective); frozen parameters keep the values they were loaded with.

    Raises:
        FileNotFoundError: ``src`` holds no such checkpoint.
    """
    load_path, _ = engine.load_checkpoint(str(src), tag=POLICY_TAG, load_optimizer_states=True,
                                          load_lr_scheduler_states=True, load_module_strict=not _has_frozen(engine))
    if load_path is None:
        raise FileNotFoundError(f"{src}: no DeepSpeed checkpoint '{POLICY_TAG}'")
