"""The DraftTrainer's state in an RL checkpoint: the head's fp32 weights,
AdamW's moments and the replay buffer (``draft.safetensors``) and the rest
(``draft.json``): safetensors and JSON, no pickle."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ray
import torch
from safetensors.torch import load_file, save_file

from rayspec.files import json_tuples

DRAFT_JSON, DRAFT_TENSORS = "draft.json", "draft.safetensors"
DRAFT_FILES = [DRAFT_JSON, DRAFT_TENSORS]  # what a checkpoint with draft state holds of it


def save_draft_state(state: tuple[dict[str, torch.Tensor], dict[str, Any]], d: Path) -> None:
    """``DraftTrainer.get_state()`` as ``d/draft.safetensors`` + ``d/draft.json``."""
    tensors, meta = state
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / DRAFT_TENSORS))
    (d / DRAFT_JSON).write_text(json.dumps(meta))


def load_draft_state(d: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """What ``save_draft_state`` wrote (safetensors and JSON: no pickle)."""
    meta = json.loads((d / DRAFT_JSON).read_text())
    meta["rng"] = json_tuples(meta["rng"])
    return load_file(str(d / DRAFT_TENSORS)), meta


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
