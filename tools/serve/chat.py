"""Route POST /v1/chat/completions: messages answered through the chat template, with tools.

Role in one decode step: none of its own; each of n choices is one generation
(tools/serve/choices.py). Tools (runtime/chat.py): the answer's <tool_call> blocks become its
`tool_calls`; tool_choice "required" or a named function constrain the answer with a grammar.
"""

from __future__ import annotations

from fastapi import APIRouter, Request  # module level: FastAPI resolves the (string) annotations here

from arborspec.tools.serve.choices import answer_request
from arborspec.tools.serve.validation import chat_prompts

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await answer_request(request, "chat", chat_prompts)
