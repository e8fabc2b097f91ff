"""A LoRA policy on the Train ranks (``train.lora``): peft's model under
DeepSpeed ZeRO 0-2, the KL reference as the same model with its adapter
off, and the adapter in peft's file format for the replicas' vLLM LoRA
(``rayspec.sync.lora``) and for the saved run.

peft is the library for the trainer's side (TRL, verl and OpenRLHF train
their LoRA policies with it); vLLM reads its format (``adapter_config.json``
+ ``adapter_model.safetensors``, the ``base_model.model.`` names of
``get_peft_model_state_dict``).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch


def wrap_lora(model, lora) -> Any:
    """``model`` (a transformers causal LM) as a peft ``PeftModel`` whose
    only trainable parameters are a fresh adapter of ``lora``
    (``rayspec.config.LoraConfig``): A drawn as peft draws it, B zero, so
    the policy starts as the base model (Hu et al. 2021, arXiv 2106.09685,
    Sec. 4.1). Seeded by torch's global generator (the Train loop seeds it
    with ``trainer.seed``, the same on every rank)."""
    from peft import LoraConfig, get_peft_model

    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    config = LoraConfig(r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout,
                        target_modules=targets, bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def random_adapter(model, r: int, lora_alpha: float, std: float, seed: int,
                   target_modules: str | list[str] = "all-linear") -> Any:
    """``model`` wrapped by ``wrap_lora`` with a rank-``r`` adapter whose B is
    drawn N(0, ``std``) (A as peft draws it), seeded by ``seed``: a trained
    adapter's size and shapes, far from the base model, for the benchmarks,
    the lossless check and the tests (a fresh adapter has B = 0). In eval
    mode."""
    from types import SimpleNamespace

    torch.manual_seed(seed)
    peft_model = wrap_lora(model, SimpleNamespace(r=r, lora_alpha=lora_alpha, lora_dropout=0.0,
                                                  target_modules=target_modules))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=std)
    return peft_model.eval()


def is_lora(module) -> bool:
    """Whether ``module`` (a DeepSpeed engine's module) is a peft model."""
    return hasattr(module, "peft_config") and hasattr(module, "disable_adapter")


def causal_lm(module):
    """The transformers causal LM inside ``module``: peft's base model, its
    adapter layers in place (so hooks on its decoder layers see the adapted
    verifier), else ``module`` itself."""
    return module.get_base_model() if is_lora(module) else module


class AdapterOff:
    """The KL reference of a LoRA policy: the policy's own module with its
    adapter switched off (peft's ``disable_adapter``), so no reference copy
    is loaded. Called as a model: ``ref(input_ids=..., attention_mask=...)``
    returns the base model's output on the module's device."""

    def __init__(self, module):
        self.module = module

    def __call__(self, **inputs):
        with self.module.disable_adapter():
            return self.module(**inputs)


def adapter_parameters(module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """The adapter's tensors as peft saves them (``get_peft_model_state_dict``:
    ``base_model.model.<module>.lora_A.weight`` [r, in] and ``lora_B.weight``
    [out, r], the training dtype, on the module's device), as weight sources
    take weights: (name, tensor, persistent True). ZeRO 0-2 hold them whole
    on every rank."""
    from peft import get_peft_model_state_dict

    for name, t in get_peft_model_state_dict(module).items():
        yield name, t, True


def adapter_config(module) -> dict[str, Any]:
    """The adapter's ``adapter_config.json`` as a JSON-ready dict (peft's
    ``PeftConfig.save_pretrained`` writes its sets as lists too)."""
    config = module.peft_config["default"].to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}

