"""The wire format of a collective or shared-memory refit: a state dict
split into buckets of at most ``packed_buffer_size_bytes``, each sent as one
flat uint8 buffer (vLLM's packed layout), and unpacked back into named
tensor views. Packed by the trainer's side of the transports
(``rayspec.sync``) and unpacked inside vLLM's workers
(``rayspec.vllm.worker_ext``), so it sits below both."""

from __future__ import annotations

import math

import torch

Bucket = list[tuple[str, str, list[int]]]  # (name, torch dtype name, shape) per tensor


def plan_buckets(state_dict: dict[str, torch.Tensor], packed_buffer_size_bytes: int) -> list[Bucket]:
    """Split a state dict into buckets of at most ``packed_buffer_size_bytes``
    (a larger tensor goes alone). Tensors sharing storage (tied embeddings)
    are sent once, under their first name: vLLM ties them itself.

    Returns:
        [[(name, dtype name, shape), ...], ...]: metadata only, what the
        receivers need to size their buffers and unpack.
    """
    buckets: list[Bucket] = [[]]
    size, seen = 0, set()
    for name, t in state_dict.items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        nbytes = t.numel() * t.element_size()
        if buckets[-1] and size + nbytes > packed_buffer_size_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, str(t.dtype).removeprefix("torch."), list(t.shape)))
        size += nbytes
    return [b for b in buckets if b]


def bucket_nbytes(bucket: Bucket) -> int:
    """Bytes of a bucket's packed buffer."""
    return sum(math.prod(shape) * getattr(torch, dtype).itemsize for _, dtype, shape in bucket)


def pack_bucket(state_dict: dict[str, torch.Tensor], bucket: Bucket, out: torch.Tensor | None = None) -> torch.Tensor:
    """The bucket's tensors as one flat uint8 buffer [bucket_nbytes], on
    their device, in the bucket's order (vLLM's packed layout: each tensor's
    bytes, contiguous, back to back); written into ``out`` where given (a
    uint8 tensor of that size, e.g. a mapped file)."""
    return torch.cat([state_dict[name].contiguous().view(-1).view(torch.uint8) for name, _, _ in bucket], out=out)


def unpack_bucket(buffer: torch.Tensor, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views of a received buffer, the inverse of ``pack_bucket``."""
    sizes = [math.prod(shape) * getattr(torch, dtype).itemsize for _, dtype, shape in bucket]
    out = []
    for (name, dtype, shape), part in zip(bucket, buffer.split(sizes)):
        dt = getattr(torch, dtype)
        if part.storage_offset() % dt.itemsize:  # e.g. an int64 d2t map after an odd-sized bf16 tensor
            part = part.clone()
        out.append((name, part.view(dt).view(shape)))
    return out


def state_dict_nbytes(state_dict: dict[str, torch.Tensor]) -> int:
    """Bytes a refit moves (tied tensors once)."""
    return sum(bucket_nbytes(b) for b in plan_buckets(state_dict, 1 << 62))
