"""Routes POST /tokenize and POST /detokenize (vLLM's): what a client counts a prompt with.

Role in one decode step: none; /tokenize applies the chat template and the tools as
/v1/chat/completions applies them.
"""

from __future__ import annotations

from fastapi import APIRouter, Request  # module level: FastAPI resolves the (string) annotations here

from arborspec.tools.serve.state import server_state
from arborspec.tools.serve.validation import detokenize_ids, read_body, tokenize_prompt

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request):
    state = server_state(request)
    prompt = tokenize_prompt(state, await read_body(request))
    ids = state.first.encode_prompt(prompt) if prompt else []
    return {"count": len(ids), "max_model_len": state.settings.max_context, "tokens": ids}


@router.post("/detokenize")
async def detokenize(request: Request):
    state = server_state(request)
    ids = detokenize_ids(state, await read_body(request))
    return {"prompt": state.first.tokenizer.decode(ids)}
