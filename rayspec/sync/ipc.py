"""The ``cuda_ipc`` transport: colocated refits that never leave the device.

Colocated, each Train rank shares its GPU with a replica, and under ZeRO 1-2
every rank already holds the whole policy there. So every rank exports
handles to its own copy (torch.multiprocessing's ``reduce_tensor``), rank 0
gathers them keyed by device (the GPU's UUID) and sends them to every
replica, and the replica loads them through vLLM's weight-transfer round
(``start_weight_update``, ``update_weights``, ``finish_weight_update``) into
the worker-side engine it was built with: on GPUs vLLM 0.32's own ``ipc``
engine (``weight_transfer/ipc_engine.py``, which its GPU CI runs), which
opens the handles of its device and reloads layer by layer: a copy from
device memory to device memory on one GPU. The payload is that engine's
``IPCWeightTransferUpdateInfo`` (names, dtype_names, shapes, ipc_handles by
GPU UUID), as its own trainer engine builds it.

Why not vLLM's trainer-side ``IPCTrainerWeightTransferEngine`` too: its
``send_weights`` runs the export, the handles' all-gather and the replicas'
load as one call on every rank, where the RL step collects on every rank,
sends from rank 0 and releases after the refit landed, the same three
phases for every transport (``PolicyWorker.refit_weights`` / ``refit_sent``);
and it is CUDA only, where CI needs the same control plane on CPUs.

On a GPU the handles point at the weights themselves (CUDA IPC maps their
allocation), where the serving dtype is the training dtype; otherwise, and
under ZeRO-3 (whose gathered parameters are freed after the gather), at a
copy. On a CPU the same code path runs as its twin, which CI tests: the
tensor is copied into shared memory (torch's ``file_system`` sharing
strategy, a file under /dev/shm), one export per host serves every replica
on that host, and the replicas load it through rayspec's CPU twin of vLLM's
engine (``ipc_engine.py``, registered as ``cpu_ipc``).

The exports live until rank 0 has seen the refit land (``DeviceExport.done``,
a barrier). So the transport needs the colocated layout, which is sync mode:
every refit lands before the step goes on. Rank 0 keeps a host copy of the
newest policy for a replica that Serve restarts (``catch_up``, through the
object store). On a CPU that copy is its export; on a GPU, a copy to host
memory made while the replicas load. The draft head, which the DraftTrainer
sends as host tensors, goes through the object store.

A CPU export whose rank was killed stays in /dev/shm: torch's shm manager
would unlink it, but Ray kills a dead worker's child processes, the manager
among them; the next ``DeviceExport`` on the host removes it.
"""

from __future__ import annotations

import contextlib
import pickle
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from rayspec.buckets import state_dict_nbytes
from rayspec.sync.interfaces import Refit, WeightReceiver, all_landed, transfer_round
from rayspec.sync.object_store import ObjectStoreSender
from rayspec.sync.shared_memory import SHM, remove_orphans

TORCH_SHM_PREFIX = "torch_"  # then the creating process's pid: torch's file_system storages in /dev/shm


def device_key(device: torch.device) -> str:
    """Which exports a process on ``device`` can open: a CUDA device's UUID
    (the same physical GPU whatever CUDA_VISIBLE_DEVICES numbers it; vLLM's
    ``ipc`` engine looks its handles up by it), ``host:<hostname>`` for the
    CPU (shared memory is per host)."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_properties(device).uuid)
    return f"host:{socket.gethostname()}"


@contextlib.contextmanager
def _file_system_sharing():
    """torch's ``file_system`` sharing strategy for the duration: CPU storages
    become named files in /dev/shm that any process on the host can open.
    The default, ``file_descriptor``, hands a descriptor over a socket whose
    key only a process's own multiprocessing children have."""
    import torch.multiprocessing as mp

    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(before)


def shareable(t: torch.Tensor, dtype: torch.dtype, copy: bool) -> torch.Tensor:
    """``t`` in ``dtype`` (floating point only), contiguous, in memory another
    process can map: on a GPU the tensor itself where neither the cast, the
    layout nor ``copy`` needs a new one; on a CPU a copy in shared memory
    (``file_system``) always.

    Args:
        t: a weight, on this rank's device.
        dtype: the serving dtype.
        copy: the tensor is freed after this call (ZeRO-3's gathered
            parameters): copy it on a GPU too.
    """
    t = t.detach()
    dtype = dtype if t.is_floating_point() else t.dtype
    if t.device.type == "cuda":
        out = t.to(dtype).contiguous()
        return out.clone() if copy and out.data_ptr() == t.data_ptr() else out
    with _file_system_sharing():
        storage = torch.UntypedStorage._new_shared(t.numel() * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, t.shape).copy_(t)


def share(t: torch.Tensor) -> tuple | bytes:
    """A handle to ``t`` (from ``shareable``) that another process opens:
    for a CUDA tensor ``reduce_tensor``'s arguments of
    ``rebuild_cuda_tensor`` (what vLLM's ``ipc`` engine rebuilds from); for
    a CPU tensor ``reduce_tensor``'s (rebuild function, args) pickled with
    torch's reductions, its storage's file's name inside (``open_shared``).

    On a CPU this adds a reference to the file for the receivers (torch's
    ``reduce_storage``), which ``release`` gives back."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing.reductions import reduce_tensor

    if t.device.type == "cuda":
        return reduce_tensor(t)[1]
    with _file_system_sharing():
        return bytes(ForkingPickler.dumps(reduce_tensor(t)))


def release(t: torch.Tensor) -> None:
    """Give back the reference ``share`` added (CPU); its file goes once ``t``
    and every receiver's view of it are freed."""
    if t.device.type == "cpu":
        t.untyped_storage()._shared_decref()


def open_shared(handle: bytes) -> torch.Tensor:
    """The CPU tensor behind a ``share`` handle, mapped into this process
    (no copy).

    torch's ``rebuild_storage_filename`` (2.13) drops the reference the
    sender added, which assumes one receiver per handle; every replica on
    the host opens the same one, so the reference is put back here, and
    the file lives until the sender's ``release`` and every mapping is gone.
    """
    rebuild, args = pickle.loads(handle)
    t = rebuild(*args)
    t.untyped_storage()._shared_incref()
    return t


@dataclass
class IpcWeights:
    """A refit as rank 0 sends it: vLLM's ``IPCWeightTransferUpdateInfo``
    fields (``payload``, what replicas get: the tensors' names, dtype names
    and shapes, and per tensor the handles of every exporting rank by
    device key), with the host copy of the weights for replicas that catch
    up (``host``)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    ipc_handles: list[dict[str, Any]]  # per tensor: {device key: share() handle}
    nbytes: int
    _host: Any = field(default=None, repr=False)  # {name: host tensor}, or a thread making it (GPU)

    @property
    def payload(self) -> dict[str, Any]:
        return {"names": self.names, "dtype_names": self.dtype_names, "shapes": self.shapes,
                "ipc_handles": self.ipc_handles}

    def host(self) -> dict[str, torch.Tensor]:
        """The weights as host tensors (waits for the copy on a GPU)."""
        if isinstance(self._host, _HostCopy):
            self._host = self._host.result()
        return self._host


class _HostCopy(threading.Thread):
    """Copies device tensors to host memory beside the replicas' loads."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__(name="rayspec-ipc-host-copy", daemon=True)
        self.tensors, self.out, self.error = tensors, None, None
        self.device = next(iter(tensors.values())).device
        self.start()

    def run(self) -> None:
        from rayspec.devices import to_host

        try:
            torch.cuda.set_device(self.device)  # a new thread's current device is 0
            self.out = to_host(self.tensors)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            self.error = e
        finally:
            self.tensors = {}  # the device memory goes back with the export's (DeviceExport.done)

    def result(self) -> dict[str, torch.Tensor]:
        self.join()
        if self.error is not None:
            raise self.error
        return self.out


class DeviceExport:
    """A Train rank's side of the cuda_ipc transport: exports this rank's
    copy of the policy and keeps it alive until the refit has landed.

    Args:
        ranks: this rank among the Train workers (``rayspec.train.ranks.Ranks``).
        device: this rank's device (its GPU, or the CPU).

    Attributes:
        reads_device: True: the replicas read this rank's device memory, so
            it is given back (``PolicyWorker.release``) only after ``done``.
    """

    reads_device = True

    def __init__(self, ranks, device: torch.device):
        self.ranks, self.key = ranks, device_key(torch.device(device))
        if torch.device(device).type == "cpu":
            remove_orphans(Path(SHM), TORCH_SHM_PREFIX, "_")
        self._tensors: list[torch.Tensor] = []  # this rank's export (empty where another rank's serves its key)
        self._host: _HostCopy | None = None
        self._pending = False  # collected, not yet done: every rank then meets at done's barrier

    def collect(self, weights: Iterable[tuple[str, torch.Tensor, bool]], dtype: torch.dtype) -> IpcWeights | None:
        """Export ``weights`` (this rank's full policy on its device: (name,
        tensor, persistent), ``rayspec.train.policy.full_parameters``; a
        tensor not persistent is freed after it is iterated, so it is
        copied) in ``dtype``. Collective: every rank iterates them, the
        first rank on each device key exports, and rank 0 gets every handle
        (None elsewhere). Tensors sharing storage (tied embeddings) go once,
        under their first name."""
        self.done()
        keys = self.ranks.all_gather(self.key)
        exports = keys.index(self.key) == self.ranks.rank
        names, seen, handles, self._pending = [], set(), [], True
        for name, t, persistent in weights:
            if persistent:
                if t.data_ptr() in seen:
                    continue
                seen.add(t.data_ptr())
            names.append(name)
            if exports:
                self._tensors.append(shareable(t, dtype, copy=not persistent))
                handles.append(share(self._tensors[-1]))
        gathered = self.ranks.all_gather(handles if exports else None)
        if not self.ranks.is_driver:
            return None
        tensors = dict(zip(names, self._tensors))
        on_cpu = self._tensors[0].device.type == "cpu"
        self._host = None if on_cpu else _HostCopy(tensors)
        return IpcWeights(
            names, [str(t.dtype).removeprefix("torch.") for t in self._tensors],
            [list(t.shape) for t in self._tensors],
            [{keys[r]: h[i] for r, h in enumerate(gathered) if h is not None} for i in range(len(names))],
            state_dict_nbytes(tensors), tensors if on_cpu else self._host)

    def done(self) -> None:
        """After the refit landed (rank 0 waited for it): every rank drops its
        export (collective: a barrier first, so no rank drops one a replica
        still reads). Rank 0's host copy is finished first."""
        if not self._pending:
            return
        self._pending = False
        self.ranks.barrier()
        if self._host is not None:
            self._host.join()
            self._host = None
        for t in self._tensors:
            release(t)
        self._tensors = []
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # free the exported blocks the receivers have let go of


class CudaIpcSender(ObjectStoreSender):
    """Rank 0's side: sends the gathered handles (``IpcWeights``) to every
    replica; the draft head's host tensors go through the object store.

    Args:
        replicas: the rollout replicas (``RolloutClient``).
    """

    name = "cuda_ipc"

    def send(self, target: str, weights, version: int) -> Refit:
        """Have every replica load ``weights`` (``IpcWeights`` from
        ``DeviceExport.collect``; host tensors go through the object
        store); returns at once."""
        if not isinstance(weights, IpcWeights):
            return super().send(target, weights, version)
        t0 = time.perf_counter()
        self.latest[target] = (version, None)
        self._weights[target] = weights
        response = self.replicas.receive_ipc(target, weights.payload, version)
        sent = time.perf_counter()

        def wait():
            return all_landed(response), sent - t0, time.perf_counter() - sent

        return Refit(self, wait, weights.nbytes)

    def catch_up(self, refits: dict[str, tuple[int, Any]]) -> dict[str, tuple[int, Any]]:
        """``refits`` with each None payload (a cuda_ipc refit) replaced by
        the host copy of its weights as an ObjectRef."""
        for target, (_, ref) in refits.items():
            if ref is None and isinstance(self._weights.get(target), IpcWeights):
                self._weights[target] = self._weights[target].host()
        return self._put_newest(refits)

    def close(self) -> None:
        """Drop the newest weights kept for catching up (on a CPU, the export's shared memory)."""
        self._weights.clear()
        self._catch_up_refs.clear()


class CudaIpcReceiver(WeightReceiver):
    """A replica's side: its workers' weight-transfer engine (vLLM's ``ipc``
    on GPUs, ``cpu_ipc`` on CPUs) opens the handles of their device and
    loads the tensors, in vLLM's round (the engine's
    ``start_weight_update`` / ``start_draft_weight_update``,
    ``update_weights``, ``finish_weight_update``)."""

    def __init__(self, host):
        super().__init__(host)
        self._joined = False

    def receive(self, target: str, payload: dict[str, Any], version: int) -> int:
        """Load ``target``'s weights from ``payload`` (``IpcWeights.payload``)
        at ``version``; returns the version.

        Raises:
            Whatever the workers' engine raised (vLLM's ``ipc``: no handle
            for a worker's GPU; ``cpu_ipc``: ``WeightSyncError`` naming the
            replica's host and the exporting ones).
        """
        engine = self.host.llm  # vLLM's weight-transfer calls (rayspec.vllm.engines)

        def load():
            if not self._joined:  # the handshake vLLM's trainer engine makes: unpacked handles
                engine.init_weight_transfer_engine({"packed": False})
                self._joined = True
            transfer_round(engine, target, payload)

        return self.host.load_refit(target, version, load)
