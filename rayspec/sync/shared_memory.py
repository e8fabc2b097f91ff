"""The ``shared_memory`` transport: the trainer's rank 0 packs each refit
into files under /dev/shm (tmpfs, so host memory), one per bucket of
``packed_buffer_size_bytes`` in the collective's packed layout
(``rayspec.buckets``), and every replica maps them read-only
(``torch.from_file``) and streams the views into vLLM's in-place reload. One host
copy, the pack, whatever the replica count: no serialization, no TCP, no
staging file per replica, no process group. A GPU replica's load is then
its host-to-device copy.

Replicas must share rank 0's node (tmpfs is per host): a replica on another
node is named in the error. For several nodes, the collective transport.
This is the host-memory counterpart of CUDA IPC (each colocated replica
reading its Train rank's device tensors), which needs every rank to export
its own weights.

Files live until every replica has loaded them (``Refit.results``); a
replica that falls behind catches up through the object store, as with the
collective transport. A rank 0 killed with a refit in flight leaves its
files behind (tmpfs: host memory); the sender that replaces it removes the
directories of senders no longer alive (``remove_orphans``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from rayspec.buckets import Bucket, bucket_nbytes, pack_bucket, plan_buckets, state_dict_nbytes
from rayspec.sync.interfaces import Refit, WeightReceiver, WeightSender, WeightSyncError, all_landed

SHM = "/dev/shm"
PREFIX = "rayspec-refit-shm-"  # then the sending process's pid and "-"


def shm_dir() -> str:
    """Where refit files go: /dev/shm (tmpfs).

    Raises:
        WeightSyncError: /dev/shm is missing or not writable (its name in
            the message; Ray's object store wants it too).
    """
    if not os.access(SHM, os.W_OK):
        raise WeightSyncError(f"rollout.weight_sync.transport=shared_memory needs a writable {SHM} (tmpfs)")
    return SHM


class SharedMemorySender(WeightSender):
    """Weights through files in /dev/shm (see the module docstring).

    Args:
        replicas: the rollout replicas (``RolloutClient``), on this node.
        packed_buffer_size_bytes: bytes per file (bucket).
    """

    name = "shared_memory"

    def __init__(self, replicas, packed_buffer_size_bytes: int):
        super().__init__(replicas)
        self.bucket_bytes = packed_buffer_size_bytes
        remove_orphans(Path(shm_dir()), PREFIX, "-")
        self.directory = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=shm_dir()))

    def send(self, target: str, weights: dict[str, torch.Tensor], version: int) -> Refit:
        """Pack ``weights`` (host tensors) into files, one per bucket, and
        have every replica load them; returns once they are written.

        Raises:
            WeightSyncError: /dev/shm has no room for the refit (bytes named).
        """
        t0 = time.perf_counter()
        nbytes = state_dict_nbytes(weights)
        free = shutil.disk_usage(self.directory).free
        if nbytes > free:
            raise WeightSyncError(f"{target} refit of {nbytes / 2**30:.2f} GiB does not fit in {SHM} "
                                  f"({free / 2**30:.2f} GiB free): enlarge it, or use "
                                  "rollout.weight_sync.transport=collective")
        self.latest[target] = (version, None)
        self._weights[target] = weights
        files = []
        try:
            for bucket in plan_buckets(weights, self.bucket_bytes):
                path = self.directory / f"{target}-v{version}-{uuid.uuid4().hex[:8]}.bin"
                out = torch.from_file(str(path), shared=True, size=bucket_nbytes(bucket), dtype=torch.uint8)
                pack_bucket(weights, bucket, out=out)
                files.append((str(path), bucket))
        except BaseException:
            _unlink(files)
            raise
        response = self.replicas.receive_shared(target, files, version)
        sent = time.perf_counter()

        def wait():
            try:
                out = all_landed(response)
            finally:
                _unlink(files)  # every replica has its mapping (or failed): the pages go with the last
            return out, sent - t0, time.perf_counter() - sent

        return Refit(self, wait, nbytes)

    def catch_up(self, refits: dict[str, tuple[int, Any]]) -> dict[str, tuple[int, Any]]:
        return self._put_newest(refits)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def remove_orphans(shm: Path, prefix: str, sep: str) -> list[Path]:
    """Remove the entries of ``shm`` named ``<prefix><pid><sep>...`` whose
    process is gone (a rank 0 killed mid-refit: Ray Train restarts the
    worker group); returns them. A pid in use again keeps its entries (a
    leak, not a loss)."""
    import psutil  # a Ray dependency

    removed = []
    for d in shm.glob(f"{prefix}*{sep}*"):
        pid = d.name[len(prefix):].split(sep, 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            if d.is_dir():
                shutil.rmtree(d, ignore_errors=True)
            else:
                d.unlink(missing_ok=True)
            removed.append(d)
    return removed


def _unlink(files: list[tuple[str, Bucket]]) -> None:
    for path, _ in files:
        Path(path).unlink(missing_ok=True)


class SharedMemoryReceiver(WeightReceiver):
    """A replica's side: the vLLM workers map the files and load the
    buckets' views (``RefitExtension.rayspec_load_shared``)."""

    def receive(self, target: str, files: list[tuple[str, Bucket]], version: int) -> int:
        """Load ``target``'s weights from ``files`` ([(path, bucket)]) at
        ``version``; returns the version.

        Raises:
            WeightSyncError: a file is not on this replica's node (named).
        """
        missing = [path for path, _ in files if not os.path.exists(path)]
        if missing:
            raise WeightSyncError(f"replica {self.host.replica_id}: {missing[0]} is not on this node: the "
                                  "shared_memory transport needs every replica on the trainer's rank 0's node "
                                  "(rollout.weight_sync.transport=collective serves several nodes)")
        return self.host.load_refit(target, version, lambda: self.host.llm.collective_rpc(
            "rayspec_load_shared", args=(target, files)))
