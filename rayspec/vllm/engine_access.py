"""What vLLM's distributed helpers and model runner give rayspec beyond the
public API, through their touch points (``touchpoints.py``)."""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import time
from datetime import timedelta

from rayspec.vllm import touchpoints as tp


def stateless_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
                    listen_socket=None):
    """vLLM's stateless torch process group (no global ``init_process_group``):
    the weight-sync group as vLLM's RLHF examples form it, a gloo group on
    the interface that reaches ``host`` (``gloo_interface``). Blocks until
    all ``world_size`` ranks have joined, at most ``timeout_s`` seconds.

    Args:
        listen_socket: rank 0's socket, already bound to ``port`` and
            listening (``rayspec.sync.collective.listening_socket``), which
            the group's store takes over; None: the store binds ``port``
            itself.

    Raises:
        VllmInternalsError: ``listen_socket`` given to a vLLM whose function
            takes none (vLLM 0.32 does: its DP groups bind theirs the same way).
    """
    form = tp.STATELESS_GROUP.load()
    kwargs = {"timeout": timedelta(seconds=timeout_s)}
    if listen_socket is not None:
        if "listen_socket" not in inspect.signature(form).parameters:
            raise tp.internals_error(tp.STATELESS_GROUP.hook, f"{tp.STATELESS_GROUP.symbol} takes no listen_socket")
        kwargs["listen_socket"] = listen_socket
    with gloo_interface(host, backend):
        return form(host, port, rank, world_size, backend, **kwargs)


def route_interface(host: str) -> str | None:
    """The network interface whose address this machine sends from to reach
    ``host`` (IPv4; a UDP socket's ``connect`` picks the route and sends
    nothing), or None where none has that address."""
    import socket

    import psutil  # a Ray dependency

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        local = s.getsockname()[0]
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addrs):
            return name
    return None


@contextlib.contextmanager
def gloo_interface(host: str, backend: str):
    """``GLOO_SOCKET_IFNAME`` set, while a gloo group forms, to the interface
    that reaches the rendezvous ``host`` (the trainer's Ray node IP).

    torch's ``ProcessGroupGloo`` without options binds to the address this
    machine's hostname resolves to; where that is a loopback address
    (Debian's 127.0.1.1, or 127.0.0.1), ranks on other nodes cannot connect
    and the group waits out its timeout. A ``GLOO_SOCKET_IFNAME`` the user
    set stands; NCCL groups are left alone (``NCCL_SOCKET_IFNAME`` is
    NCCL's own)."""
    import os

    name = None
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        with contextlib.suppress(OSError):
            name = route_interface(host)
    if name is None:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = name
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def cpu_linear(layer):
    """``layer.cpu_linear`` as vLLM's CPU backend builds it for an
    unquantized linear layer (oneDNN with a prepacked weight on x86), its
    weight dropped; called as ``f(x, None, None)``."""
    tp.CPU_GEMM_DISPATCH.load()(layer, remove_weight=True)
    return layer.cpu_linear


@contextlib.contextmanager
def step_timers(k: int):
    """Time vLLM's V1 model runner per decode step while the block runs
    (an engine core in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

    Args:
        k: the cell's draft tokens; a step is a decode step when no new
            request is scheduled and no request runs more than 1 + k query
            tokens (prefill steps are left out).

    Yields:
        dict {name: [seconds summed over decode steps, calls]} for ``target``
        (``execute_model``), ``forward`` (``_model_forward``), ``sampler``
        (``_sample``), ``sample_tokens`` and ``drafter`` (the proposers'
        ``propose``).

    Raises:
        VllmInternalsError: a timed method is missing (named).
    """
    acc: dict = collections.defaultdict(lambda: [0.0, 0])
    decode = [False]
    names = {"execute_model": "target", "_model_forward": "forward", "_sample": "sampler",
             "sample_tokens": "sample_tokens", "propose": "drafter"}
    points = [*tp.RUNNER_TIMED, tp.RUNNER_SAMPLE, tp.PROPOSE, tp.SUFFIX_PROPOSE]
    originals = [(point, point.load()) for point in points]

    def timed(fn, name):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if name == "target":
                so = args[1]
                decode[0] = bool(so.num_scheduled_tokens) and not so.scheduled_new_reqs and \
                    max(so.num_scheduled_tokens.values()) <= 1 + k
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if decode[0]:
                    acc[name][0] += time.perf_counter() - t
                    acc[name][1] += 1
        return wrapper

    try:
        for point, fn in originals:
            point.install(timed(fn, names[point.symbol.rpartition(".")[2]]))
        yield acc
    finally:
        for point, fn in originals:
            point.install(fn)
