"""Several Ray nodes on one host, each with a HOME, CPU cores and private
directories of its own: the multi-node cluster the tests and benchmarks run
on (Ray's own tests simulate nodes on one host too, with
``ray.cluster_utils.Cluster``: one raylet and object store per node).

The head node (``ray.cluster_utils.Cluster``) is the driver's. Every other
node is what a user starts on a machine of its own, ``ray start
--address=<head> --block``, here inside a mount namespace of its own
(``unshare -m``, which needs root or CAP_SYS_ADMIN) where:

- ``<root>/head`` and the directories of the nodes started before it are
  empty (a tmpfs over each), so a file the driver writes under
  ``<root>/head`` is on the driver's node only, as on separate machines;
  the rest of the host's filesystem stays shared, as an NFS mount would be;
- ``/dev/shm`` is a tmpfs of its own (its object store, and the
  shared-memory weight transport, cannot reach another node's);
- ``HOME`` and ``TMPDIR`` are ``<root>/<name>/home`` and ``<root>/<name>/tmp``
  (``~/.cache/rayspec``, Hugging Face's and vLLM's caches are the node's);
- its processes run on its own CPU cores (``taskset``; workers inherit the
  raylet's affinity), so a role pinned to "core 0 of its node" runs there,
  not on the host's core 0.

``TORCH_EXTENSIONS_DIR`` is the directory the host's torch builds its C++
extensions in (``torch_extensions_dir``): DeepSpeed's CPU ops, which
``cluster/install_node.sh`` builds on every real node, are found there, not
built again in each node's HOME (~70 s an op on 2 cores, while the
replicas wait). The nodes share the host's network: every address is the
host's.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil


def torch_extensions_dir() -> str:
    """The directory this process's torch builds and finds JIT-compiled C++
    extensions in: ``TORCH_EXTENSIONS_DIR`` where set, else torch's default
    root (``cpp_extension.get_default_build_root``, under HOME) with the
    per-Python, per-accelerator folder torch adds only then
    (``py311_cpu``; torch 2.13's ``cpp_extension._get_build_directory``).
    A node given the root alone would build every op again in it."""
    from torch.utils.cpp_extension import get_default_build_root

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    import torch

    accelerator = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip
                   else f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return os.path.join(get_default_build_root(), f"{python}_{accelerator}")


@dataclass(frozen=True)
class NodeSpec:
    """One simulated node.

    Attributes:
        num_cpus: Ray's CPU resource of the node (0: a head that hosts the
            driver and Ray's controllers only, as ``ray start --head
            --num-cpus=0``).
        cores: host CPU cores its processes run on (None: all of this
            process's).
        object_store_memory: bytes of its object store.
    """

    num_cpus: float
    cores: tuple[int, ...] | None = None
    object_store_memory: int = 256 << 20


class LocalCluster:
    """A Ray cluster of simulated nodes on this host (module doc).

    Args:
        root: directory holding each node's directory (``<root>/head``,
            ``<root>/node1``, ...); keep it short (Ray's unix sockets).
        head: the head node, whose raylet the driver (this process) joins.
        system_config: Ray ``_system_config`` of the cluster (e.g. shorter
            ``health_check_*`` to notice a dead node sooner).
        dashboard: start Ray's dashboard on the head (what ``ray.util.state``
            asks; off: one process less).

    Attributes:
        address: the GCS address (``ray.init(address=...)``).
        names: node id (hex) -> the node's name (``head``, ``node1``, ...).

    Raises:
        RuntimeError: a node did not join within 120 s (its ``ray start``
            output, e.g. ``unshare: ... Operation not permitted`` without
            CAP_SYS_ADMIN).
    """

    def __init__(self, root: str | os.PathLike, head: NodeSpec, system_config: dict | None = None,
                 dashboard: bool = False):
        from ray.cluster_utils import Cluster

        self.root = Path(root)
        self._cluster = Cluster()
        self._procs: dict[str, subprocess.Popen] = {}
        self.names: dict[str, str] = {}
        home, tmp = self._dirs("head")
        with _affinity(head.cores):
            node = self._cluster.add_node(num_cpus=head.num_cpus, object_store_memory=head.object_store_memory,
                                          env_vars=self._env(home, tmp), include_dashboard=dashboard,
                                          _system_config=system_config or {})
        self._head = node
        self.names[node.node_id] = "head"
        self.address = self._cluster.address

    def _dirs(self, name: str) -> tuple[Path, Path]:
        home, tmp = self.root / name / "home", self.root / name / "tmp"
        home.mkdir(parents=True, exist_ok=True)
        tmp.mkdir(parents=True, exist_ok=True)
        return home, tmp

    @staticmethod
    def _env(home: Path, tmp: Path) -> dict[str, str]:
        return {"HOME": str(home), "TMPDIR": str(tmp), "TORCH_EXTENSIONS_DIR": torch_extensions_dir()}

    def _alive(self) -> set[str]:
        return {n["NodeID"] for n in self._cluster.global_state.node_table() if n["Alive"]}

    def add_node(self, spec: NodeSpec, timeout_s: float = 120.0) -> str:
        """Start one more node, ``node<n>`` (module doc); returns its node id
        once Ray lists it alive."""
        name = f"node{len(self._procs) + 1}"
        home, tmp = self._dirs(name)
        private = [self.root / "head", *(self.root / n for n in self._procs)]
        ray_cmd = [str(Path(sys.executable).with_name("ray")), "start", f"--address={self.address}",
                   f"--num-cpus={spec.num_cpus:g}", f"--object-store-memory={spec.object_store_memory}",
                   "--disable-usage-stats", "--block"]
        if spec.cores is not None:
            ray_cmd = ["taskset", "-c", ",".join(map(str, spec.cores)), *ray_cmd]
        script = "".join(f"mount -t tmpfs -o size=1m rayspec-private {shlex.quote(str(d))} && " for d in private)
        script += "mount -t tmpfs rayspec-shm /dev/shm && exec " + shlex.join(ray_cmd)
        before = self._alive()
        log = (self.root / name / "ray-start.log").open("w")
        self._procs[name] = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            env={**os.environ, **self._env(home, tmp)}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not (new := self._alive() - before):
            if self._procs[name].poll() is not None or time.monotonic() > deadline:
                self._kill_tree(self._procs.pop(name).pid)
                raise RuntimeError(f"simulated node {name} did not join {self.address} within {timeout_s:g} s; "
                                   f"its output ({log.name}):\n{Path(log.name).read_text()[-2000:]}")
            time.sleep(0.5)
        (node_id,) = new
        self.names[node_id] = name
        return node_id

    def node_id(self, name: str) -> str:
        """The node id of the node named ``name``."""
        return next(i for i, n in self.names.items() if n == name)

    def home(self, name: str) -> Path:
        """The HOME of node ``name``'s processes."""
        return self.root / name / "home"

    def kill_node(self, name: str) -> None:
        """Kill node ``name`` (not the head) without warning, as a machine
        that dies: every process it started (raylet, object store, workers
        and their children, e.g. vLLM's engine core) gets SIGKILL at once.
        Ray marks it dead when its health checks fail (``health_check_*``
        of ``system_config``; 15 s by default)."""
        self._kill_tree(self._procs.pop(name).pid)

    @staticmethod
    def _kill_tree(pid: int) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
            for p in procs:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.send_signal(signal.SIGKILL)
            psutil.wait_procs(procs, timeout=30)

    def wait_dead(self, node_id: str, timeout_s: float = 120.0) -> float:
        """Wait until Ray lists ``node_id`` as dead; returns the seconds waited.

        Raises:
            TimeoutError: still alive after ``timeout_s``.
        """
        t0 = time.monotonic()
        while node_id in self._alive():
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"node {node_id[:8]} still alive after {timeout_s:g} s")
            time.sleep(0.5)
        return time.monotonic() - t0

    def shutdown(self) -> None:
        """Stop every node (this process leaves Ray first)."""
        import ray

        ray.shutdown()
        for name in list(self._procs):
            self.kill_node(name)
        self._cluster.shutdown()


@contextlib.contextmanager
def _affinity(cores: tuple[int, ...] | None):
    """This thread's CPU affinity set to ``cores`` while the block runs
    (the processes it starts keep it)."""
    before = os.sched_getaffinity(0)
    if cores is not None:
        os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
