"""The vLLM engine a rollout replica drives, behind one small interface.

``SpecVLLMEngine`` (``rayspec.rollout.engine``) holds one of these and calls
only what is below; the two differ in how requests reach vLLM, not in what
rayspec does with them:

- ``AsyncEngine``: vLLM's ``AsyncLLM``, the engine ``vllm serve`` and Ray
  Serve LLM run (its engine core always in a process of its own). Requests
  from many callers are batched continuously, so a replica takes each
  prompt group as it comes (``concurrent = True``), and a refit can land
  while they are in flight (``pause_generation`` / ``resume_generation``).
  The replicas' default.
- ``OfflineEngine``: ``vllm.LLM``, one call at a time (``concurrent =
  False``). Its engine core can run in the caller's process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): what the tests of an engine's
  behaviour, the jobs that time vLLM's kernels in-process
  (``jobs.bench_step``) and the lossless test's engines use.

Both give the same synchronous, thread-safe calls: ``generate``,
``collective_rpc``, ``reset_prefix_cache``, ``sleep``,
``wake_up``, the weight-transfer round (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``),
``call_utility``, ``shutdown``, and ``vllm_config``. ``ENGINE_CLASSES``
names them for ``rollout.engine_cls``; a class of one's own
(``"module:Class"``) that gives the same calls plugs in the same way, as Ray
Serve LLM's ``engine_cls`` does. ``AsyncEngine`` alone also runs coroutines
of requests (``run``, ``generate_one``): the multi-turn trajectories of
``rayspec.rollout.agent``, each its own coroutine.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import threading
from typing import Any, Optional

from rayspec import config
from rayspec.vllm import touchpoints as tp


class OfflineEngine:
    """``vllm.LLM`` (one call at a time) behind the replica's engine interface.

    Args:
        engine_args: ``vllm.LLM`` keyword arguments (model, dtype,
            speculative_config, worker_extension_cls, ...).
        stat_logger: a vLLM stat logger (``StatLoggerBase``'s methods) to
            receive every engine step's stats, or None. ``vllm.LLM`` 0.32
            takes none, so it is appended to the engine's
            ``StatLoggerManager`` (two touch points).

    Raises:
        VllmInternalsError: ``stat_logger`` given and the engine keeps no
            stat loggers (built with ``disable_log_stats``), or vLLM moved them.
    """

    concurrent = False

    def __init__(self, engine_args: dict[str, Any], stat_logger=None):
        from vllm import LLM

        self.llm = LLM(**engine_args)
        self.vllm_config = tp.require(self.llm.llm_engine, "vllm_config", tp.ENGINE)
        if stat_logger is not None:
            manager = tp.require(self.llm.llm_engine, "logger_manager", tp.ADAPTIVE)
            if manager is None:
                raise tp.internals_error(tp.ADAPTIVE, "the engine keeps no stat loggers (built with "
                                                      "disable_log_stats)")
            tp.require(manager, "stat_loggers", tp.ADAPTIVE).append(stat_logger)

    def generate(self, prompts: list, params, lora_request=None) -> list:
        """``RequestOutput`` per prompt (``TokensPrompt``), in input order
        (``params``: one ``SamplingParams`` for all, or one per prompt;
        ``lora_request``: the LoRA adapter every request runs with, or None
        for the base model); a progress bar where someone watches (a terminal)."""
        import sys

        return self.llm.generate(prompts, params, use_tqdm=sys.stderr.isatty(), lora_request=lora_request)

    def add_lora(self, lora_request) -> bool:
        """Load a LoRA adapter (vLLM's ``LoRARequest``) into the engine."""
        return self.llm.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Drop the adapter of ``lora_id`` from the engine."""
        return self.llm.llm_engine.remove_lora(lora_id)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None) -> list:
        """Every worker's ``method`` (a worker or worker-extension method name): their results."""
        return self.llm.collective_rpc(method, args=args, kwargs=kwargs)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        self.llm.wake_up(tags)

    # vllm.LLM's own RL calls (0.32: the same round AsyncLLM gives, through the workers' methods)
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self, draft: bool = False) -> None:
        (self.llm.start_draft_weight_update if draft else self.llm.start_weight_update)()

    def update_weights(self, update_info: dict) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def update_weight_version(self, version: str) -> None:
        """Label the weights sampled from now on (``CompletionOutput.weight_versions``)."""
        self.llm.update_weight_version(version)

    def call_utility(self, name: str, *args) -> Any:
        """Run an engine-core utility method ``name`` (added by a plugin) in
        the engine core, in its process or in this one.

        Raises:
            Exception: naming ``has no attribute '<name>'`` where the engine
                core lacks it (as vLLM reports it from a core process).
        """
        core = tp.require(self.llm.llm_engine, "engine_core", tp.ENGINE)
        if hasattr(core, "call_utility"):
            return core.call_utility(name, *args)
        fn = getattr(core.engine_core, name, None)  # InprocClient (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        if fn is None:
            raise AttributeError(f"'{type(core.engine_core).__name__}' object has no attribute '{name}'")
        return fn(*args)

    def shutdown(self) -> None:
        """Stop the engine-core process (and its workers) now, not at garbage collection."""
        tp.require(self.llm.llm_engine, "engine_core", tp.ENGINE).shutdown()


class AsyncEngine:
    """vLLM's ``AsyncLLM`` on an event loop of its own (a daemon thread),
    behind the replica's engine interface: every call may come from any
    thread, and ``generate`` calls made at once share the engine's
    continuous batching.

    Args:
        engine_args: ``vllm.AsyncEngineArgs`` keyword arguments (those of
            ``vllm.LLM``: model, dtype, speculative_config, ...).
        stat_logger: a vLLM stat logger to receive every engine step's stats
            (``AsyncLLM``'s ``stat_loggers``), or None.

    Raises:
        Whatever ``AsyncLLM`` raised starting (the loop is stopped first).
    """

    concurrent = True

    def __init__(self, engine_args: dict[str, Any], stat_logger=None):
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rayspec-async-llm", daemon=True)
        self._thread.start()
        self._ids = itertools.count()
        loggers = [lambda vllm_config, engine_index: stat_logger] if stat_logger is not None else None

        async def start():  # on the loop, so AsyncLLM's output handler runs there
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args), stat_loggers=loggers)

        try:
            self.engine = self._run(start())
        except BaseException:
            self._stop_loop()
            raise
        self.vllm_config = self.engine.vllm_config

    def _run(self, coro) -> Any:
        """``coro`` run on the engine's loop; its result, waited for here.

        Raises:
            RuntimeError: called on the loop's own thread (it would wait for itself).
        """
        if threading.current_thread() is self._thread:
            raise RuntimeError("AsyncEngine: a blocking call made on its own event loop")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(self, prompts: list, params, lora_request=None) -> list:
        """``RequestOutput`` per prompt, in input order: each prompt one
        request of ``params.n`` samples (``params``: one ``SamplingParams``
        for all, or one per prompt; ``lora_request``: the LoRA adapter each
        runs with, or None), its final output only."""
        from vllm.sampling_params import RequestOutputKind

        def final_only(p):
            p = p.clone()
            p.output_kind = RequestOutputKind.FINAL_ONLY
            return p

        per_prompt = list(map(final_only, params)) if isinstance(params, list) else \
            [final_only(params)] * len(prompts)

        async def all_of():
            return await asyncio.gather(*(self._final(p, sp, lora_request) for p, sp in zip(prompts, per_prompt)))

        return self._run(all_of())

    async def _final(self, prompt, params, lora_request=None):
        """The final ``RequestOutput`` of one request (``params.output_kind`` FINAL_ONLY)."""
        final = None
        async for out in self.engine.generate(prompt, params, request_id=f"rayspec-{next(self._ids)}",
                                              lora_request=lora_request):
            final = out
        return final

    async def generate_one(self, prompt, params, lora_request=None):
        """A coroutine on the engine's loop (``run``): the final
        ``RequestOutput`` of one request (``params``: one ``SamplingParams``;
        ``lora_request``: its LoRA adapter, or None).
        A multi-turn trajectory (``rayspec.rollout.agent``) awaits one per turn."""
        from vllm.sampling_params import RequestOutputKind

        params = params.clone()
        params.output_kind = RequestOutputKind.FINAL_ONLY
        return await self._final(prompt, params, lora_request)

    def add_lora(self, lora_request) -> bool:
        """Load a LoRA adapter (vLLM's ``LoRARequest``) into the engine (``AsyncLLM.add_lora``)."""
        return self._run(self.engine.add_lora(lora_request))

    def remove_lora(self, lora_id: int) -> bool:
        """Drop the adapter of ``lora_id`` from the engine (``AsyncLLM.remove_lora``)."""
        return self._run(self.engine.remove_lora(lora_id))

    def run(self, coro) -> Any:
        """``coro`` (e.g. trajectories awaiting ``generate_one``) run on the
        engine's loop; its result, waited for here."""
        return self._run(coro)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None) -> list:
        return self._run(self.engine.collective_rpc(method, args=args, kwargs=kwargs))

    async def collective_rpc_async(self, method: str, args: tuple = (), kwargs: Optional[dict] = None) -> list:
        """``collective_rpc`` awaited on the engine's loop (from a coroutine ``run`` runs)."""
        return await self.engine.collective_rpc(method, args=args, kwargs=kwargs)

    def reset_prefix_cache(self) -> None:
        self._run(self.engine.reset_prefix_cache())

    def sleep(self, level: int) -> None:
        self._run(self.engine.sleep(level))

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        self._run(self.engine.wake_up(tags))

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._run(self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self, draft: bool = False) -> None:
        self._run(self.engine.start_draft_weight_update() if draft else self.engine.start_weight_update())

    def update_weights(self, update_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run(self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self._run(self.engine.finish_weight_update(weight_version))

    def update_weight_version(self, version: str) -> None:
        self._run(self.engine.update_weight_version(version))

    def pause_generation(self) -> None:
        """Freeze the requests in flight (vLLM's ``mode="keep"``; the KV
        cache is dropped and recomputed on resume) until ``resume_generation``."""
        self._run(self.engine.pause_generation(mode="keep"))

    def resume_generation(self) -> None:
        self._run(self.engine.resume_generation())

    def call_utility(self, name: str, *args) -> Any:
        core = tp.require(self.engine, "engine_core", tp.ENGINE)
        return self._run(core.call_utility_async(name, *args))

    def _stop_loop(self) -> None:
        """Let the tasks the engine cancelled finish cancelling, then stop the loop."""
        async def drain():
            current = asyncio.current_task()
            pending = [t for t in asyncio.all_tasks() if t is not current]
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(drain(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def shutdown(self) -> None:
        """Stop the engine-core process, then the loop (idempotent)."""
        engine = self.__dict__.pop("engine", None)
        if engine is not None and self._thread.is_alive():
            async def stop():  # on the loop, as vLLM's API server stops it: no task runs in between
                engine.shutdown()

            self._run(stop())
        self._stop_loop()


# rollout.engine_cls's names, as the config validates them
ENGINE_CLASSES: dict[str, type] = dict(zip(config.ENGINE_CLASSES, (AsyncEngine, OfflineEngine)))


def engine_class(name: str) -> type:
    """The engine class ``rollout.engine_cls`` names: ``async``,
    ``offline``, or ``module:Class`` (one's own with the same calls).

    Raises:
        ValueError: no such name, or the module or class does not import.
    """
    if name in ENGINE_CLASSES:
        return ENGINE_CLASSES[name]
    module, _, cls = name.partition(":")
    if not cls:
        raise ValueError(f"rollout.engine_cls={name!r}: one of {sorted(ENGINE_CLASSES)} or 'module:Class'")
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"rollout.engine_cls={name!r} does not import: {e}") from None
