"""The OpenAI ingress ``jobs.serve`` deploys: Ray Serve LLM's, with an
unknown model answered in the OpenAI error shape.

Ray 2.60's ``OpenAiIngress._get_model_id`` raises FastAPI's
``HTTPException`` for a model it does not serve, which Starlette answers as
``{"detail": ...}`` before Ray's exception middleware sees it; every other
refusal comes back as ``{"error": {"message", "type", "code"}}``, which
OpenAI clients parse. Raised as ``NotFoundError`` (an exception with a
``status_code``), the middleware answers it in that shape
(``ray.llm._internal.serve.utils.server_utils.get_response_for_error``).
"""

from __future__ import annotations

import ray
from fastapi import HTTPException
from ray.serve.llm.ingress import OpenAiIngress

if not hasattr(OpenAiIngress, "_get_model_id"):
    raise ImportError(f"ray {ray.__version__}: OpenAiIngress._get_model_id is gone (rayspec read Ray 2.60.0's); "
                      "rayspec.tools.ingress needs updating for this Ray")


class NotFoundError(Exception):
    """A request for a model the server does not serve (HTTP 404)."""

    status_code = 404


class OpenAiErrorIngress(OpenAiIngress):
    """``OpenAiIngress`` whose unknown-model refusal is in the OpenAI error shape."""

    async def _get_model_id(self, model):
        try:
            return await super()._get_model_id(model)
        except HTTPException as e:
            if e.status_code != 404:
                raise
            raise NotFoundError(str(e.detail)) from None
