"""Run config: every YAML preset validates, overrides apply, and bad input fails
with a ConfigError that names the key and the value (no Ray, no vLLM)."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from rayspec.config import (BUNDLED_MODEL, CPU_ZERO_BUCKET_SIZE, DATA_DEFAULTS, DRAFT_LINEAR_DTYPE, GPU_MEMORY_UTILIZATION,
                            LORA_DEFAULT_KEYS, PLATFORM_DEFAULT_KEYS, ConfigError, RunConfig, apply_defaults, dtype_reason, load_config, to_dict)

CONFIG_DIR = Path(__file__).resolve().parents[1] / "jobs" / "configs"
PRESETS = sorted(CONFIG_DIR.glob("*.yaml"))
DEFAULT = CONFIG_DIR / "default.yaml"
K = "rollout.speculative_config.num_speculative_tokens"


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_presets_exist():
    assert {"default.yaml", "gsm8k.yaml"} <= {p.name for p in PRESETS}


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_preset_validates(preset):
    cfg = load_config(preset)
    assert isinstance(cfg, RunConfig)


def test_default_preset():
    cfg = load_config(DEFAULT)
    assert cfg.model.path == BUNDLED_MODEL
    assert cfg.data.name == "arithmetic"
    assert cfg.rollout.speculative_config.method == "eagle3"
    assert cfg.rollout.speculative_config.num_speculative_tokens == 3
    assert cfg.rollout.adaptive_k.enabled  # k = 0 where drafting would not pay
    # the learning preset: exact serving, a learning rate that moves the policy, evaluations
    assert cfg.model.dtype == "float32"
    assert cfg.train.deepspeed["optimizer"]["params"]["lr"] == 2e-5
    assert (cfg.data.max_operand, cfg.grpo.group_size, cfg.grpo.kl_coef) == (10, 8, 0.04)
    # the first run: 15 steps, 10-20 minutes on 2 cores, evaluations included (docs/benchmarks.md)
    assert (cfg.trainer.steps, cfg.trainer.eval_every, cfg.trainer.eval_samples) == (15, 5, 2)
    assert cfg.data.eval_num_problems == 40
    assert cfg.trainer.run_dir == "runs/default"


def test_gsm8k_preset_differs_from_default_only_in_data_group_length_steps_and_run_dir():
    default = _flat(to_dict(load_config(DEFAULT)))
    gsm8k = _flat(to_dict(load_config(CONFIG_DIR / "gsm8k.yaml")))
    changed = {k: gsm8k[k] for k in default if gsm8k[k] != default[k]}
    assert changed == {"data.name": "gsm8k", "data.path": os.path.abspath("../shared/data/gsm8k"), "data.split": "train",
                       "data.level": None, "data.max_operand": None, "data.eval_num_problems": 64, "grpo.group_size": 4,
                       "grpo.max_new_tokens": 256, "trainer.steps": 10, "trainer.eval_samples": 1,
                       "trainer.run_dir": "runs/gsm8k"}


def test_overrides():
    cfg = load_config(DEFAULT, [f"{K}=2", "trainer.steps=3", "data.name=gsm8k"])
    assert cfg.rollout.speculative_config.num_speculative_tokens == 2
    assert cfg.trainer.steps == 3
    assert cfg.data.name == "gsm8k"
    assert cfg.data.path == "openai/gsm8k"  # filled in by apply_defaults
    assert cfg.rollout.speculative_config.method == "eagle3"  # untouched sibling


def test_overrides_without_preset_start_from_dataclass_defaults():
    cfg = load_config(None, ["trainer.steps=3"])
    defaults = OmegaConf.to_container(OmegaConf.structured(RunConfig))
    apply_defaults(defaults)
    built = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), defaults))
    assert dataclasses.replace(cfg, trainer=RunConfig().trainer) == built


def test_the_config_is_read_only_and_validation_changes_nothing():
    cfg = load_config(None, ["data.name=gsm8k"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.trainer.steps = 5
    before = to_dict(cfg)
    cfg.validate()
    assert to_dict(cfg) == before


def test_cpu_roles_keep_the_cpu_defaults_and_gpu_roles_get_the_gpu_ones():
    cpu = load_config(DEFAULT)
    assert cpu.rollout.engine_kwargs["enforce_eager"] is True
    assert "gpu_memory_utilization" not in cpu.rollout.engine_kwargs
    assert cpu.rollout.engine_kwargs["additional_config"] == {DRAFT_LINEAR_DTYPE: "auto"}
    assert cpu.train.deepspeed["bf16"] == {"enabled": False}
    assert "torch_adam" not in cpu.train.deepspeed["optimizer"]["params"]
    assert cpu.train.torch_threads_per_worker == 1 and cpu.train.gradient_checkpointing is False
    zero = cpu.train.deepspeed["zero_optimization"]
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == CPU_ZERO_BUCKET_SIZE

    gpus = ["rollout.num_gpus_per_replica=0.6", "train.num_gpus_per_worker=0.3"]
    gpu = load_config(DEFAULT, gpus)
    assert gpu.rollout.engine_kwargs["enforce_eager"] is False  # CUDA graphs
    assert gpu.rollout.engine_kwargs["gpu_memory_utilization"] == GPU_MEMORY_UTILIZATION["colocate"]
    assert "additional_config" not in gpu.rollout.engine_kwargs  # a CPU patch's key
    assert gpu.train.deepspeed["bf16"] == {"enabled": True}
    assert gpu.train.deepspeed["optimizer"]["params"]["torch_adam"] is True  # no nvcc at run time
    assert gpu.train.torch_threads_per_worker is None and gpu.train.gradient_checkpointing is True
    assert gpu.train.deepspeed["zero_optimization"] == {"stage": 2}  # DeepSpeed's own bucket sizes
    split = load_config(DEFAULT, ["scheduler.layout=split", "rollout.num_gpus_per_replica=1",
                                  "train.num_gpus_per_worker=1"])
    assert split.rollout.engine_kwargs["gpu_memory_utilization"] == GPU_MEMORY_UTILIZATION["split"]
    # colocated GPU ranks give their states back while the replicas run; ZeRO-3 only with FusedAdam
    assert gpu.train.offload_states is True and split.train.offload_states is False
    assert cpu.train.offload_states is False and cpu.rollout.sleep_level == 2
    assert load_config(DEFAULT, gpus + ["train.deepspeed.zero_optimization.stage=3"]).train.offload_states is False
    assert load_config(DEFAULT, gpus + ["train.deepspeed.zero_optimization.stage=3",
                                        "train.deepspeed.optimizer.params.torch_adam=false"]).train.offload_states
    with pytest.raises(ConfigError, match=r"rollout\.sleep_level=3"):
        load_config(DEFAULT, ["rollout.sleep_level=3"])

    # what the user sets stays, on either platform
    mine = load_config(DEFAULT, gpus + ["rollout.engine_kwargs.enforce_eager=true",
                                        "rollout.engine_kwargs.gpu_memory_utilization=0.3",
                                        f"rollout.engine_kwargs.additional_config.{DRAFT_LINEAR_DTYPE}=float32",
                                        "train.deepspeed.bf16.enabled=false",
                                        "train.deepspeed.optimizer.params.torch_adam=false",
                                        "train.torch_threads_per_worker=4", "train.gradient_checkpointing=false",
                                        "train.deepspeed.zero_optimization.reduce_bucket_size=1000"])
    assert mine.rollout.engine_kwargs["enforce_eager"] is True
    assert mine.rollout.engine_kwargs["gpu_memory_utilization"] == 0.3
    assert mine.rollout.engine_kwargs["additional_config"] == {DRAFT_LINEAR_DTYPE: "float32"}
    with pytest.raises(ConfigError, match=rf"rollout\.engine_kwargs\.additional_config\.{DRAFT_LINEAR_DTYPE}='fp16'"):
        load_config(DEFAULT, [f"rollout.engine_kwargs.additional_config.{DRAFT_LINEAR_DTYPE}=fp16"])
    with pytest.raises(ConfigError, match=rf"{DRAFT_LINEAR_DTYPE}='bfloat16': a CPU replica setting"):
        load_config(DEFAULT, gpus + [f"rollout.engine_kwargs.additional_config.{DRAFT_LINEAR_DTYPE}=bfloat16"])
    assert mine.train.deepspeed["bf16"] == {"enabled": False}
    assert mine.train.deepspeed["optimizer"]["params"]["torch_adam"] is False
    assert mine.train.torch_threads_per_worker == 4 and mine.train.gradient_checkpointing is False
    assert mine.train.deepspeed["zero_optimization"]["reduce_bucket_size"] == 1000
    assert load_config(DEFAULT, ["train.deepspeed.zero_optimization.allgather_bucket_size=2000"]).train.deepspeed[
        "zero_optimization"] == {"stage": 2, "reduce_bucket_size": CPU_ZERO_BUCKET_SIZE, "allgather_bucket_size": 2000}


@pytest.mark.parametrize("amx, avx512_bf16, expected", [(False, False, "float32"), (False, True, "bfloat16"),
                                                          (True, False, "bfloat16")])
def test_auto_dtype_serves_bf16_only_where_it_is_native(monkeypatch, amx, avx512_bf16, expected):
    import torch

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    cfg = load_config(None)  # the dataclass default, auto (the presets serve float32)
    assert cfg.model.dtype == expected  # resolved at load time: config.yaml states what ran
    assert ("natively" in dtype_reason(cfg)) == (expected == "bfloat16")
    assert load_config(None, ["rollout.num_gpus_per_replica=0.6",
                                 "train.num_gpus_per_worker=0.3"]).model.dtype == "bfloat16"
    mine = load_config(None, ["model.dtype=bfloat16"])
    assert mine.model.dtype == "bfloat16"  # what the user sets stays
    if expected == "float32":
        assert dtype_reason(mine).startswith("as configured; auto would pick float32: this CPU has neither")
    # fp32 replicas beside bf16 training serve bf16-rounded weights, and say so
    gpu_fp32 = load_config(None, ["model.dtype=float32", "rollout.num_gpus_per_replica=0.6",
                                  "train.num_gpus_per_worker=0.3"])
    assert "refits send DeepSpeed's bf16 module weights (not the fp32 master)" in dtype_reason(gpu_fp32)
    assert "bf16 module weights" not in dtype_reason(load_config(None, ["model.dtype=float32"]))


def test_auto_dtype_on_a_torch_without_the_cpu_checks_names_the_key_and_the_version(monkeypatch):
    import torch

    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    with pytest.raises(ConfigError, match=re.escape(f"model.dtype=auto: torch {torch.__version__} has no "
                                                    "torch.cpu._is_amx_tile_supported")):
        load_config(None)
    assert load_config(DEFAULT).model.dtype == "float32"  # the preset's explicit dtype needs no check


def test_no_speculation_ignores_k_and_adaptive_k():
    # the presets adapt k: turning speculation off must not need a second override
    cfg = load_config(DEFAULT, ["rollout.speculative_config.method=null", f"{K}=0"])
    assert cfg.rollout.speculative_config.method is None and cfg.rollout.adaptive_k.enabled


def test_suffix_keys_reach_vllm_under_its_names():
    from rayspec.rollout.engine import speculative_config_for_vllm

    cfg = load_config(DEFAULT, ["rollout.speculative_config.method=suffix", f"{K}=8",
                                "rollout.speculative_config.suffix_decoding_max_cached_requests=512"])
    assert cfg.rollout.adaptive_k.enabled  # the preset's adaptive k: each suffix draft's budget
    assert speculative_config_for_vllm(vars(cfg.rollout.speculative_config)) == {
        "method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_cached_requests": 512}
    # the preset's sampled drafts are its EAGLE-3 head's; a suffix match has no distribution
    eagle = speculative_config_for_vllm(vars(load_config(DEFAULT, []).rollout.speculative_config))
    assert eagle == {"method": "eagle3", "num_speculative_tokens": 3, "draft_sample_method": "probabilistic"}


def test_draft_model_with_existing_dir(tmp_path):
    cfg = load_config(DEFAULT, ["rollout.speculative_config.method=draft_model",
                                f"rollout.speculative_config.model={tmp_path}"])
    assert cfg.rollout.speculative_config.model == str(tmp_path)


@pytest.mark.parametrize("overrides, key, value", [
    (["rollout.bogus=1"], "rollout.bogus", None),  # unknown key: no value to check
    ([f"{K}=0"], K, "0"),
    (["rollout.speculative_config.method=medusa2"], "rollout.speculative_config.method", "medusa2"),
    (["model.path=/nonexistent/dir"], "model.path", "/nonexistent/dir"),
    (["grpo.group_size=1"], "grpo.group_size", "1"),
    (["grpo.temperature=0"], "grpo.temperature", "0"),
    (["trainer.steps=abc"], "trainer.steps", "abc"),
    (["rollout.speculative_config.method=draft_model"], "rollout.speculative_config.model",
     "draft_model"),
    (["rollout.speculative_config.method=draft_model",
      "rollout.speculative_config.model=/nonexistent/draft"],
     "rollout.speculative_config.model", "/nonexistent/draft"),
    (["train.num_workers=3"], "train.num_workers", "3"),  # 3 does not divide 4 * 4
    (["data.name=squad"], "data.name", "squad"),
    (["rollout.adaptive_k.enabled=true", "rollout.adaptive_k.probe_every=0"],
     "rollout.adaptive_k.probe_every", "0"),
    (["rollout.speculative_config.draft_sample_method=top1"],
     "rollout.speculative_config.draft_sample_method", "top1"),
    (["train.deepspeed.train_micro_batch_size_per_gpu=abc"],
     "train.deepspeed.train_micro_batch_size_per_gpu", "abc"),
    (["train.deepspeed.zero_optimization=3"], "train.deepspeed.zero_optimization", "3"),
    (["nosuch.key=1"], "nosuch.key", None),
    (["trainer.eval_every=-1"], "trainer.eval_every", "-1"),
    (["trainer.eval_samples=0"], "trainer.eval_samples", "0"),
    (["data.eval_num_problems=0"], "data.eval_num_problems", "0"),
    (["data.max_operand=1"], "data.max_operand", "1"),
    (["draft.aux_hidden_state_layer_ids={a: 1}"], "draft.aux_hidden_state_layer_ids", None),
    (["rollout.speculative_config.suffix_decoding_max_cached_requests=100"],
     "rollout.speculative_config.suffix_decoding_max_cached_requests", "100"),  # method eagle3
    (["rollout.speculative_config.method=suffix", "rollout.adaptive_k.enabled=false",
      "rollout.speculative_config.suffix_decoding_min_token_prob=2"],
     "rollout.speculative_config.suffix_decoding_min_token_prob", "2.0"),
    (["draft.idle_train_every=-1"], "draft.idle_train_every", "-1"),
    (["draft.idle_train_every=8", "draft.idle_train_max_every=4"], "draft.idle_train_max_every", "4"),
    (["draft.min_acceptance_gain=-0.1"], "draft.min_acceptance_gain", "-0.1"),
    (["draft.min_drafted_share=1.5"], "draft.min_drafted_share", "1.5"),
    (["draft.tv_loss_weight=-1"], "draft.tv_loss_weight", "-1"),
    (["draft.lr=0"], "draft.lr", "0"),
    (["draft.capture_share=0"], "draft.capture_share", "0"),
], ids=["unknown-key", "k<1", "unknown-method", "missing-model", "group-size-1", "greedy", "wrong-type",
        "draft-model-no-path", "draft-model-missing-dir", "num-workers-not-dividing",
        "unknown-dataset", "adaptive-probe-every-0",
        "bad-draft-sample-method", "micro-batch-not-int", "zero-section-not-a-map", "unknown-section",
        "eval-every-negative", "eval-samples-0", "eval-problems-0", "max-operand-1", "mapping-for-a-list",
        "suffix-key-without-suffix", "suffix-min-prob-above-1", "idle-train-every-negative", "idle-train-max-every-below-it",
        "min-acceptance-gain-negative", "min-drafted-share-above-1", "tv-loss-weight-negative",
        "draft-lr-0", "capture-share-0"])
def test_bad_override_names_key_and_value(overrides, key, value):
    with pytest.raises(ConfigError) as e:
        load_config(DEFAULT, overrides)
    msg = str(e.value)
    assert key in msg
    if value is not None:
        assert value in msg


def test_unknown_key_in_yaml_names_file_and_key(tmp_path):
    preset = tmp_path / "typo.yaml"
    preset.write_text("trainer:\n  stepz: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(preset)
    assert str(preset) in str(e.value)
    assert "trainer.stepz" in str(e.value)


def test_an_old_spelling_names_the_new_key_and_writes_nothing(tmp_path):
    """Ray's resource counts are spelled as Ray spells them in every section
    (num_cpus / num_gpus), and every switch ``enabled``: the old keys are
    refused, in a preset or an override, naming the new key."""
    preset = tmp_path / "old.yaml"
    preset.write_text("train:\n  gpus_per_worker: 1\n")
    with pytest.raises(ConfigError, match=r"'train.gpus_per_worker' is now 'train.num_gpus_per_worker'") as e:
        load_config(preset)
    assert str(preset) in str(e.value)
    with pytest.raises(ConfigError, match=r"override 'train.cpus_per_worker=1'.*'train.num_cpus_per_worker'"):
        load_config(None, ["train.cpus_per_worker=1"])
    with pytest.raises(ConfigError, match=r"'grpo.overlong_buffer.enable' is now 'grpo.overlong_buffer.enabled'"):
        load_config(None, ["grpo.overlong_buffer.enable=true"])
    assert load_config(None, ["train.num_gpus_per_worker=1", "train.num_cpus_per_worker=1",
                              "rollout.num_gpus_per_replica=1"]).train.num_gpus_per_worker == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.yaml"]


SCALAR_FOR_SECTION = pytest.mark.parametrize("yaml_text, overrides, key", [
    ("trainer: 3\n", [], "trainer"),
    ("", ["rollout.speculative_config=3"], "rollout.speculative_config"),
], ids=["in-yaml", "in-override"])


def _load_scalar_for_section(tmp_path, yaml_text, overrides) -> str:
    preset = tmp_path / "p.yaml"
    preset.write_text(yaml_text)
    with pytest.raises(ConfigError) as e:
        load_config(preset, overrides)
    return str(e.value).replace(str(preset), "<preset>")


@SCALAR_FOR_SECTION
def test_scalar_for_section_raises_config_error(tmp_path, yaml_text, overrides, key):
    _load_scalar_for_section(tmp_path, yaml_text, overrides)


@SCALAR_FOR_SECTION
def test_scalar_for_section_message_names_key(tmp_path, yaml_text, overrides, key):
    assert key in _load_scalar_for_section(tmp_path, yaml_text, overrides)


@pytest.mark.parametrize("text", ["trainer: [unclosed", "- a\n- b\n"])
def test_unreadable_yaml_is_a_config_error_naming_the_file(tmp_path, text):
    preset = tmp_path / "bad.yaml"
    preset.write_text(text)
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(preset)


def test_missing_preset_and_invalid_value_in_preset_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    preset = tmp_path / "g1.yaml"
    preset.write_text("grpo:\n  group_size: 1\n")
    with pytest.raises(ConfigError, match=r"grpo.group_size=1.*g1.yaml"):
        load_config(preset)


LEAVES = sorted(_flat(to_dict(RunConfig())))
DATASET_DEFAULT_KEYS = {f"data.{k}" for defaults in DATA_DEFAULTS.values() for k in defaults}
VALUES = st.one_of(
    st.integers(-3, 100), st.floats(-2, 2, allow_nan=False), st.booleans(), st.none(),
    st.sampled_from(["eagle3", "draft_model", "ngram", "mtp", "split", "async", "gsm8k", "float32",
                     "abc", "''", "[1, 2]", "{a: 1}", "/nonexistent"]))


def _render(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(LEAVES + ["rollout.bogus", "nosuch.key", "trainer"]), VALUES),
                max_size=4))
def test_any_overrides_give_a_valid_config_or_a_config_error_naming_a_key(pairs):
    """Property: whatever the overrides, load_config returns a config that
    validates, with the overridden values, or raises ConfigError (never
    another exception) whose message names an overridden key or the schema
    key a cross-key check failed on."""
    overrides = [f"{k}={_render(v)}" for k, v in pairs]
    try:
        cfg = load_config(DEFAULT, overrides)
    except ConfigError as e:
        msg = str(e)
        assert any(k in msg for k, _ in pairs) or any(leaf in msg for leaf in LEAVES), msg
        return
    cfg.validate()
    flat = _flat(to_dict(cfg))
    for k, v in dict(pairs).items():  # the last override of a key wins
        if v is None and (k in PLATFORM_DEFAULT_KEYS + LORA_DEFAULT_KEYS or k in DATASET_DEFAULT_KEYS):
            continue  # null there means: the platform's (the dataset's, LoRA's) default
        if k in flat and not isinstance(v, str) and k != "data.path":
            # OmegaConf coerces to the field's type: str fields take the text,
            # bool fields take integers as C does (0 false, others true)
            got = flat[k]
            same = got == v or str(got).lower() == _render(v) or (
                isinstance(got, bool) and isinstance(v, int) and got == bool(v)) or (
                isinstance(v, (int, float)) and isinstance(got, (int, float)) and float(got) == float(v))
            assert same, (k, v, got)


def test_replica_env_puts_engine_env_over_the_cpu_backend_settings():
    from rayspec.rollout.engine import replica_env

    cfg = load_config(None, ["rollout.cpu_kvcache_space_gib=3", "rollout.cpu_omp_threads_bind=0",
                             "rollout.engine_env.VLLM_ENABLE_V1_MULTIPROCESSING=0", "rollout.engine_cls=offline",
                             "rollout.engine_env.VLLM_CPU_OMP_THREADS_BIND=1"])
    env = replica_env(cfg.rollout)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["NUMBA_THREADING_LAYER"] == "workqueue"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # V1 unless asked: the runner vLLM's CI and the CPU run


def test_an_engines_env_is_the_callers_again_once_it_started(monkeypatch):
    """A spawned engine core inherits the environment at its start; the
    caller's (a notebook's) is restored after, set keys and unset ones alike,
    and what the start set goes too."""
    from rayspec.rollout.engine import _engine_env

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")
    monkeypatch.delenv("NUMBA_THREADING_LAYER", raising=False)
    with pytest.raises(RuntimeError):
        with _engine_env({"VLLM_CPU_KVCACHE_SPACE": "1", "NUMBA_THREADING_LAYER": "workqueue"}):
            assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1" and os.environ["NUMBA_THREADING_LAYER"] == "workqueue"
            os.environ["RAYSPEC_SET_BY_THE_START"] = "1"  # what the start itself sets in this process
            raise RuntimeError("the engine failed to start")
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "7" and "NUMBA_THREADING_LAYER" not in os.environ
    assert "RAYSPEC_SET_BY_THE_START" not in os.environ


def test_an_in_process_engine_core_and_in_flight_updates_ask_for_the_engine_that_can():
    """vLLM's AsyncLLM always starts its engine core in a process of its
    own, and vllm.LLM takes one call at a time, so no refit meets requests in
    flight there: asking either of the wrong engine is refused, naming the
    key that can."""
    with pytest.raises(ConfigError, match=r"rollout\.engine_env\.VLLM_ENABLE_V1_MULTIPROCESSING.*"
                                          r"rollout\.engine_cls=offline"):
        load_config(None, ["rollout.engine_env.VLLM_ENABLE_V1_MULTIPROCESSING=0"])
    with pytest.raises(ConfigError, match=r"rollout\.engine_cls.*'module:Class'"):
        load_config(None, ["rollout.engine_cls=vllm"])
    assert load_config(None, ["rollout.engine_cls=my.engines:Engine"]).rollout.engine_cls == "my.engines:Engine"
    async_mode = ["scheduler.layout=split", "scheduler.mode=async"]
    with pytest.raises(ConfigError, match=r"scheduler\.in_flight_updates=True.*scheduler\.mode=async"):
        load_config(None, ["scheduler.in_flight_updates=true"])
    with pytest.raises(ConfigError, match=r"scheduler\.in_flight_updates=True.*rollout\.engine_cls=async"):
        load_config(None, [*async_mode, "scheduler.in_flight_updates=true", "rollout.engine_cls=offline"])
    assert load_config(None, [*async_mode, "scheduler.in_flight_updates=true"]).scheduler.in_flight_updates


def test_the_v2_model_runner_is_asked_for_by_its_key_only_and_not_with_adaptive_k():
    from rayspec.rollout.engine import replica_env

    cfg = load_config(None, ["rollout.model_runner=v2"])
    assert replica_env(cfg.rollout)["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    for overrides, key in ((["rollout.model_runner=v3"], "rollout.model_runner"),
                           (["rollout.engine_env.VLLM_USE_V2_MODEL_RUNNER=1"],
                            "rollout.engine_env.VLLM_USE_V2_MODEL_RUNNER"),
                           (["rollout.model_runner=v2", "rollout.adaptive_k.enabled=true"], "rollout.model_runner")):
        with pytest.raises(ConfigError, match=re.escape(key)):
            load_config(None, overrides)
