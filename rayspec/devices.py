"""Where tensors live.

Every role computes on the device it was given (a Train worker on DeepSpeed's
accelerator device, the DraftTrainer on ``draft.num_gpus``'s device), and
everything that enters the Ray object store is host memory: Ray 2.60 pickles
torch tensors with torch's own reducer, so a CUDA tensor put by one process
is restored onto a CUDA device by whichever process reads it (a Serve replica
whose GPU vLLM already fills, or a DraftTrainer on a GPU-less node, which
cannot deserialize it at all).
"""

from __future__ import annotations

from typing import Optional

import torch


def to_host(tensors: dict[str, torch.Tensor], dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """Detached CPU copies of ``{name: tensor}``, for the object store or a file.

    Always a copy, never a view of live parameters (the caller may keep
    training while the copy is in flight).

    Args:
        tensors: tensors on any device.
        dtype: cast to this dtype while copying (None: keep each tensor's).

    Returns:
        {name: CPU tensor}, same shapes.
    """
    return {k: v.detach().to("cpu", dtype or v.dtype, copy=True) for k, v in tensors.items()}


def to_device(tensors: dict[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` moved to ``device`` (no copy where already there)."""
    return {k: v.to(device) for k, v in tensors.items()}
