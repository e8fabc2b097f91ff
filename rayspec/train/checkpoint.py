"""RL checkpoints through Ray Train: written with ``ray.train.report(checkpoint=...)``,
read back with ``ray.train.get_checkpoint()`` when a run resumes or its
worker group restarts after a failure.

One checkpoint directory (Ray Train merges every rank's files into it and
registers it only once all ranks have reported, so a crash mid-write never
leaves a checkpoint that a resume would pick)::

    policy/            DeepSpeed ``save_checkpoint``: fp32 weights, optimizer
                       (each rank its ZeRO partition), DeepSpeed's own state
    rng_rank<r>.json   torch / Python / NumPy RNG states of rank r
    trainer_state.json step, policy version, data cursor of the next batch
    draft.safetensors  DraftTrainer: head, AdamW state, replay buffer
    draft.json         (only with online draft training)

Everything rayspec writes is JSON or safetensors; DeepSpeed's own files are
``torch.save`` pickles, read by DeepSpeed with ``weights_only=False``: resume
only run directories you trust (your own runs).
"""

from __future__ import annotations

import base64
import json
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import ray
import torch
from safetensors.torch import load_file, save_file

POLICY_TAG = "policy"
TRAINER_STATE = "trainer_state.json"


def _rng_state() -> dict[str, Any]:
    kind, keys, *rest = np.random.get_state()
    return {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
            "python": random.getstate(), "numpy": [kind, keys.tolist(), *rest]}


def _set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(s["torch"])), dtype=torch.uint8))
    random.setstate(_tuplify(s["python"]))
    kind, keys, *rest = s["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))


def _tuplify(x):
    """JSON's lists back into the tuples ``random.setstate`` wants."""
    return tuple(_tuplify(v) for v in x) if isinstance(x, list) else x


def report_checkpoint(metrics: dict[str, Any], engine, rank: int,
                      trainer_state: dict[str, Any] | None,
                      stage_draft: Callable[[Path], Any] | None) -> None:
    """Write this rank's part of a checkpoint and report it with ``metrics``.
    Collective: every rank calls it at the same step.

    Args:
        metrics: numeric metrics of the step (``ray.train.report``).
        engine: the policy's DeepSpeed engine (``save_checkpoint`` is collective).
        rank: world rank.
        trainer_state: rank 0: {"step", "policy_version", "prompts" (the
            PromptSource cursor of the next batch to train)}; None elsewhere.
        stage_draft: rank 0 with online draft training: writes the
            DraftTrainer's state into the staging directory it is given
            (``stage_draft_state``).

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
            engine.save_checkpoint(str(d / "policy"), tag=POLICY_TAG)
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


def restore_checkpoint(checkpoint, engine, rank: int,
                       restore_draft: Callable[[Path, dict[str, Any]], Any] | None = None
                       ) -> tuple[dict[str, Any], Any]:
    """Load a checkpoint written by ``report_checkpoint`` into ``engine`` and
    this process's RNGs. Collective (DeepSpeed ``load_checkpoint``).

    Args:
        restore_draft: rank 0 with online draft training: called with the
            checkpoint's directory and its trainer state where it holds
            draft state (``restore_draft_state``).

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
        load_path, _ = engine.load_checkpoint(str(d / "policy"), tag=POLICY_TAG,
                                              load_optimizer_states=True, load_lr_scheduler_states=True)
        if load_path is None:
            raise FileNotFoundError(f"{d / 'policy'}: no DeepSpeed checkpoint '{POLICY_TAG}'")
        _set_rng_state(json.loads(rng.read_text()))
        state = json.loads((d / TRAINER_STATE).read_text())
        draft = restore_draft(d, state) if restore_draft is not None and (d / "draft.json").is_file() else None
    return state, draft


def save_draft_state(state: tuple[dict[str, torch.Tensor], dict[str, Any]], d: Path) -> None:
    """``DraftTrainer.get_state()`` as ``d/draft.safetensors`` + ``d/draft.json``."""
    tensors, meta = state
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "draft.safetensors"))
    (d / "draft.json").write_text(json.dumps(meta))


def load_draft_state(d: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """What ``save_draft_state`` wrote (safetensors and JSON: no pickle)."""
    meta = json.loads((d / "draft.json").read_text())
    meta["rng"] = _tuplify(meta["rng"])
    return load_file(str(d / "draft.safetensors")), meta


def stage_draft_state(draft, d: Path) -> str:
    """Write the DraftTrainer actor ``draft``'s state (``get_state``) into the
    staging directory ``d`` on this process's node.

    On the actor's own node the actor writes the files itself
    (``DraftTrainer.save_state``); from another node the state comes through
    the object store. The state is the head's fp32 weights, AdamW's two
    moments of its trained part and the replay buffer (``draft.buffer_steps``
    RL steps of verifier features, 8 bytes per token per hidden unit):
    80 MB plus 4.6 KB a token for SmolLM2-135M's 8192-token head, about 4 GB
    plus 32 KiB a token for a Llama-3.1-8B EAGLE-3 head (0.42 B parameters).
    Through the object store that is two more host copies (the store's and
    this process's), and the store's shared-memory pages it touches above
    their high-water mark stay allocated to the end of the run (Ray 2.60
    never gives them back).

    Returns:
        ``"file"`` or ``"object_store"``: how the state came.

    Raises:
        ray.exceptions.RayActorError: the actor died.
        OSError: the files could not be written.
    """
    if _same_node(draft):
        ray.get(draft.save_state.remote(str(d)))
        return "file"
    save_draft_state(ray.get(draft.get_state.remote()), d)
    return "object_store"


def restore_draft_state(draft, d: Path) -> int:
    """Load the draft state in checkpoint directory ``d`` into the
    DraftTrainer actor ``draft`` (``set_state``), read by the actor itself
    where it shares this process's node (as ``stage_draft_state``); returns
    the draft version.

    Raises:
        ray.exceptions.RayActorError: the actor died.
    """
    if _same_node(draft):
        return ray.get(draft.load_state.remote(str(d)))
    return ray.get(draft.set_state.remote(*load_draft_state(d)))


def _same_node(actor) -> bool:
    return ray.get(actor.node_and_gpu.remote())[0] == ray.get_runtime_context().get_node_id()
