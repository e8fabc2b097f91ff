"""Detached verifier features for the EAGLE-3 head, captured with forward
hooks during the policy's own training forward (no second forward)."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def capture_eagle3_features(model, aux_layer_ids: list[int]):
    """Record the inputs of decoder layers ``aux_layer_ids`` and the final
    norm's output while ``model`` runs forward.

    The inputs of layer i equal vLLM's aux hidden state i (vLLM records
    ``hidden_states + residual`` before layer i).

    Args:
        model: a transformers Llama-family causal LM (``model.model.layers``,
            ``model.model.norm``).
        aux_layer_ids: the three verifier layers the head reads.

    Yields:
        dict filled after the forward with ``aux_hidden`` [B, L, 3H] and
        ``final_hidden`` [B, L, H], detached, in the model's dtype.
    """
    inner = model.model
    found: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}

    def pre_hook(idx):
        def fn(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            found[idx] = h.detach()
        return fn

    def norm_hook(module, args, output):
        out["final_hidden"] = output.detach()
        out["aux_hidden"] = torch.cat([found[i] for i in aux_layer_ids], dim=-1)

    handles = [inner.layers[i].register_forward_pre_hook(pre_hook(i), with_kwargs=True)
               for i in aux_layer_ids]
    handles.append(inner.norm.register_forward_hook(norm_hook))
    try:
        yield out
    finally:
        for h in handles:
            h.remove()
