"""Route POST /v1/completions: text (or token-id) prompts continued, whole or streamed.

Role in one decode step: none of its own; each of prompts x n choices is one generation
(tools/serve/choices.py). OpenAI's legacy fields (echo, integer logprobs) and vLLM's extensions
(guided_*, truncate_prompt_tokens, ...) are read by tools/serve/validation.py.
"""

from __future__ import annotations

from fastapi import APIRouter, Request  # module level: FastAPI resolves the (string) annotations here

from arborspec.tools.serve.choices import answer_request
from arborspec.tools.serve.validation import completions_prompts

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request):
    return await answer_request(request, "completions", completions_prompts)
