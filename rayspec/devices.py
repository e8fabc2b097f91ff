"""Where tensors live.

Every role computes on the device it was given (a Train worker on DeepSpeed's
accelerator device, the DraftTrainer on ``draft.num_gpus``'s device), and
everything that enters the Ray object store is host memory: Ray 2.60 pickles
torch tensors with torch's own reducer, so a CUDA tensor put by one process
is restored onto a CUDA device by whichever process reads it (a Serve replica
whose GPU vLLM already fills, or a DraftTrainer on a GPU-less node, which
cannot deserialize it at all).

``MemoryTrace`` samples how much of a GPU is in use over time: the GPU
checks (``jobs.gpu_smoke``) read each phase's peak of an RL step from it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import threading
import time
from typing import Optional

import torch


def to_host(tensors: dict[str, torch.Tensor], dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """Detached CPU copies of ``{name: tensor}``, for the object store or a file.

    Always a copy, never a view of live parameters (the caller may keep
    training while the copy is in flight). Tensors that are one (tied
    embeddings) stay one: copied once, under every name.

    Args:
        tensors: tensors on any device.
        dtype: cast floating-point tensors to this dtype while copying
            (None: keep each tensor's); integer and bool tensors (an EAGLE-3
            head's d2t / t2d maps) keep theirs.

    Returns:
        {name: CPU tensor}, same shapes.
    """
    out, copies = {}, {}
    for k, v in tensors.items():
        same = (v.device, v.data_ptr(), v.dtype, v.shape, v.stride())
        if v.data_ptr() and same in copies:
            out[k] = copies[same]
            continue
        out[k] = copies[same] = v.detach().to("cpu", dtype if dtype and v.is_floating_point() else v.dtype, copy=True)
    return out


def to_device(tensors: dict[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` moved to ``device`` (no copy where already there)."""
    return {k: v.to(device) for k, v in tensors.items()}


def assigned_gpu(local_index: int = 0) -> str | None:
    """The physical id of the GPU this process computes on: entry
    ``local_index`` of CUDA_VISIBLE_DEVICES, which Ray sets to an actor's GPU
    ids, and Ray Train to the ids of all its workers on the node (a rank then
    uses ``cuda:<local rank>``, as DeepSpeed does). None without GPUs."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [i for i in visible.split(",") if i] if visible not in ("", "NoDevFiles") else []
    return ids[local_index] if local_index < len(ids) else None


def cpu_native_bf16() -> Optional[str]:
    """The instruction set this host's CPU computes bf16 with, or None.

    ``"AMX"`` or ``"AVX512-BF16"`` as torch detects them
    (``torch.cpu._is_amx_tile_supported`` / ``_is_avx512_bf16_supported``),
    the checks vLLM 0.32's CPU attention backend makes
    (``vllm/v1/attention/backends/cpu_attn.py``). Without either, vLLM's CPU
    kernels emulate bf16 through fp32 conversions: on 2 AVX2 cores the
    default job decoded 9 tokens/s in bf16 against 25 in fp32.

    Raises:
        RuntimeError: this torch lacks the checks (named by its version).
    """
    checks = {"AMX": "_is_amx_tile_supported", "AVX512-BF16": "_is_avx512_bf16_supported"}
    for name, check in checks.items():
        if not hasattr(torch.cpu, check):
            raise RuntimeError(f"torch {torch.__version__} has no torch.cpu.{check} (read against torch 2.13); "
                               "set model.dtype explicitly instead of auto")
        if getattr(torch.cpu, check)():
            return name
    return None


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library is another."""
    if platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL("libc.so.6").malloc_trim


def trim_host_heap() -> Optional[bool]:
    """Give the freed pages of this process's C heap back to the OS
    (glibc ``malloc_trim(0)``).

    PyTorch's CPU tensors live on the C heap. glibc keeps what they free in
    its arenas for reuse, so a process that idles after a large computation
    keeps its peak resident set: the DraftTrainer kept 1.3 GiB after one
    ``train`` call, 0.6 GiB of it freed (an in-process call on 16 GSM8K
    chunks, SmolLM2-135M's features). On a node where the roles are
    colocated that is memory the policy update runs short of. Dask's workers
    trim for the same reason ("Memory not released back to the OS",
    distributed.dask.org, worker memory management).

    Returns:
        True where pages were released, False where there were none to
        release, None where the C library is not glibc (nothing done).
    """
    trim = _malloc_trim()
    return None if trim is None else bool(trim(0))


class MemoryTrace:
    """Device-wide memory in use on CUDA device 0, sampled in a thread while
    the ``with`` block runs: ``samples`` is [(epoch seconds, bytes)].

    Read from ``cudaMemGetInfo`` (total minus free), so it counts every
    process on the device (a colocated run's replica, Train rank and
    DraftTrainer) and this process's own CUDA context, which
    ``torch.cuda.max_memory_allocated`` would miss.

    Args:
        period_s: seconds between samples.
    """

    def __init__(self, period_s: float = 0.02):
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)

    def _run(self, period_s: float) -> None:
        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info(0)
            self.samples.append((time.time(), total - free))
            time.sleep(period_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def peak(self, intervals: list[list[float]]) -> int:
        """Largest memory in use (bytes) during any of ``intervals`` ([[start, end]],
        epoch s): the samples inside them and the last one before each start
        (what was in use as the phase began; a phase may be shorter than the
        sampling period). 0 without samples."""
        inside = [b for t, b in self.samples if any(s <= t <= e for s, e in intervals)]
        before = [max(((t, b) for t, b in self.samples if t <= s), default=(0.0, 0))[1] for s, _ in intervals]
        return max(inside + before, default=0)
