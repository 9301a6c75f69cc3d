"""The routes that describe the server: /health, /v1/models, /props and /metrics."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edgespec import __version__
from edgespec.config import LLAMA_N_PREDICT, LLAMA_TEMPERATURE
from edgespec.server import metrics, schemas
from edgespec.server.http import guard
from edgespec.server.service import Service


class AdminRoutes:
    def __init__(self, svc: Service) -> None:
        self.svc = svc

    def routes(self) -> list[Route]:
        return [Route("/health", self.health, methods=["GET"]), Route("/v1/models", self.models, methods=["GET"]),
                Route("/props", guard(self.props), methods=["GET"]),
                Route("/metrics", self.metrics_text, methods=["GET"])]

    async def health(self, request: Request) -> Response:
        if self.svc.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if self.svc.load_error:
            return JSONResponse({"status": "error", "error": self.svc.load_error}, status_code=500)
        if self.svc.loaded is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.svc.settings.model_name,
                             "generations": dict(self.svc.finished), "background_jobs": len(self.svc.background)})

    async def models(self, request: Request) -> Response:
        """OpenAI's list, with llama.cpp's owner and `meta`: llama.vscode reads them to find the context size."""
        model: dict[str, Any] = {"id": self.svc.settings.model_name, "object": "model", "created": 0,
                                 "owned_by": "llamacpp"}
        if self.svc.loaded is not None:
            f = self.svc.loaded.target.facts
            model["meta"] = {"n_ctx": self.svc.loaded.n_ctx, "n_ctx_train": f.n_ctx_train, "n_vocab": f.n_vocab,
                             "n_embd": f.n_embd, "size": f.weights_bytes}
        return JSONResponse({"object": "list", "data": [model]})

    async def props(self, request: Request) -> Response:
        """llama.cpp's /props: what llama.vscode and others read to learn the context and the template."""
        eng = self.svc.engine()
        m = eng.target
        defaults = schemas.generation({}, schemas.COMPLETION, eng.n_ctx, LLAMA_N_PREDICT, LLAMA_TEMPERATURE)
        return JSONResponse({
            "default_generation_settings": {"params": defaults.settings, "n_ctx": eng.n_ctx},
            "total_slots": len(eng.slots), "model_alias": self.svc.settings.model_name, "model_path": str(m.path),
            "modalities": {"vision": False, "audio": False},
            "chat_template": m.facts.chat_template or "",
            "bos_token": m.token_text(m.vocab.bos) if m.vocab.bos is not None else "",
            "eos_token": m.token_text(m.vocab.eos) if m.vocab.eos is not None else "",
            "build_info": f"edgespec {__version__}, llama-cpp-python {importlib.metadata.version('llama_cpp_python')}",
            "speculative": {"proposer": eng.config.proposer, "k_max": eng.plan.k_max,
                            "draft": eng.config.draft, "draft_loaded": eng.draft_loaded,
                            "memory": eng.memory is not None},
            "cache_reuse": {"can_shift": m.can_shift, "infill": self.svc.cache_reuse(schemas.INFILL),
                            "other_routes": self.svc.cache_reuse(schemas.COMPLETION),
                            "fim_layout": self.svc.settings.fim_layout},
            "endpoint_metrics": True, "endpoint_slots": False, "endpoint_props": True,
        })

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.svc.metrics.render(), media_type=metrics.CONTENT_TYPE)
