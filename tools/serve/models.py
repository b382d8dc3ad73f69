"""Routes GET /v1/models and GET /v1/models/{id} (OpenAI's list and retrieve): the one model served.

Role in one decode step: none.
"""

from __future__ import annotations

from fastapi import APIRouter, Request  # module level: FastAPI resolves the (string) annotations here

from arborspec.tools.serve.state import server_state
from arborspec.tools.serve.validation import check_model

router = APIRouter()


def model_card(model_name: str) -> dict:
    return {"id": model_name, "object": "model", "owned_by": "arborspec", "created": 0}


@router.get("/v1/models")
async def models(request: Request):
    return {"object": "list", "data": [model_card(server_state(request).settings.model_name)]}


@router.get("/v1/models/{model:path}")
async def model(model: str, request: Request):  # OpenAI's retrieve (openai-python's `client.models.retrieve`)
    name = server_state(request).settings.model_name
    check_model(model, name)
    return model_card(name)
