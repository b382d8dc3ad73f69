"""Routes GET /health (no API key needed) and GET /metrics (Prometheus text).

Role in one decode step: none; /metrics reports the steps and tokens the generations counted
(tools/serve/metrics.py).
"""

from __future__ import annotations

from fastapi import APIRouter, Request  # module level: FastAPI resolves the (string) annotations here

from arborspec.tools.serve.state import server_state

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    return {"status": "ok", "model": server_state(request).settings.model_name}


@router.get("/metrics")
async def metrics(request: Request):
    from fastapi.responses import PlainTextResponse

    text = server_state(request).metrics.render()
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")
