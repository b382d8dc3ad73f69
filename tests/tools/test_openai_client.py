"""The official OpenAI Python client against `arborspec serve` (a real server on 127.0.0.1 over a
tiny export): what the client parses is what its users get. Chat and completions, streamed and not,
log-probs, structured output through the client's own `parse` (a pydantic model), tool calls (the
client's typed tool_calls, streamed deltas accumulated as its users do), and errors as the client's
exception types."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
pydantic = pytest.importorskip("pydantic")

from conftest import tiny_text_export  # noqa: E402
from test_chat_tools import ASK, TOOLS, follows  # noqa: E402

from arborspec.runtime.generator import Generator  # noqa: E402


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    return tiny_text_export(tmp_path_factory.mktemp("openai") / "export", seed=9, max_position=2048)


@pytest.fixture(scope="module")
def client(export_dir):
    from test_serve import serving

    from arborspec.tools.serve.app import GeneratorPool

    pool = GeneratorPool(lambda: Generator.from_export(export_dir, tree="full:2,2"), 1)
    with serving(pool, max_context=2048, api_key="k") as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=120)


def test_chat_and_completions(client, export_dir):
    with Generator.from_export(export_dir, tree="full:2,2") as g:
        want_chat = g.chat(ASK, 16).text
        want_text = g.generate("hello there", 16)
    assert [m.id for m in client.models.list()] == ["tiny"]
    r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == want_chat and r.usage.completion_tokens == 16
    parts = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == want_chat
    r = client.completions.create(model="tiny", prompt="hello there", max_tokens=16, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    # (the legacy shape keys alternatives by text: two that decode alike are one entry)
    assert (
        r.choices[0].text == want_text.text and len(lp.tokens) == 16 and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    )


def test_structured_output_through_the_clients_parse(client):
    """`client.chat.completions.parse(response_format=Model)`: the client sends a strict
    json_schema of the pydantic model and validates the answer into it."""

    from typing import Literal

    class Pick(pydantic.BaseModel):
        # compact JSON (llguidance's option, passed inside the schema): a random model's answer ends
        model_config = pydantic.ConfigDict(json_schema_extra={"x-guidance": {"whitespace_flexible": False}})
        colour: Literal["red", "blue"]
        count: int = pydantic.Field(ge=0, le=9)

    r = client.chat.completions.parse(model="tiny", messages=ASK, max_tokens=120, temperature=0, response_format=Pick)
    got = r.choices[0].message.parsed
    assert isinstance(got, Pick) and r.choices[0].finish_reason == "stop", r.choices[0].message.content


def test_tool_calls_as_the_client_reads_them(client):
    r = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=160, temperature=0, tools=TOOLS, tool_choice="required"
    )
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None and msg.tool_calls
    calls = [
        {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": c.function.arguments}}
        for c in msg.tool_calls
    ]
    assert all(follows(c) for c in calls)
    # streamed: the deltas accumulated by index, as the client's users do
    acc: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=160, temperature=0, tools=TOOLS, tool_choice="required", stream=True
    ):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                a = acc.setdefault(d.index, {"name": "", "arguments": ""})
                a["name"] += d.function.name or ""
                a["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and [acc[i] for i in sorted(acc)] == [c["function"] for c in calls]
    # the call and its result sent back: the next turn is served
    turn = [
        *ASK,
        msg.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "ok"},
    ]
    r = client.chat.completions.create(model="tiny", messages=turn, max_tokens=4, tools=TOOLS)
    assert r.choices[0].message.content is not None or r.choices[0].message.tool_calls


def test_errors_are_the_clients_exceptions(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny",
            messages=ASK,
            max_tokens=4,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=ASK, max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0).models.list()
    json.dumps(e.value.body)


def test_pydantic_tools_through_the_clients_parse(client):
    """`openai.pydantic_function_tool(Model)` (a strict tool whose parameters nest a model under
    `$defs`) with `tool_choice` required: the client's `parse` validates the call's arguments into
    the model (`parsed_arguments`)."""
    from typing import Literal

    class Address(pydantic.BaseModel):
        city: Literal["Oslo", "Rome"]

    class Ship(pydantic.BaseModel):
        """Ship a parcel."""

        to: Address
        kg: int = pydantic.Field(ge=1, le=5)

    r = client.chat.completions.parse(
        model="tiny",
        messages=ASK,
        max_tokens=200,
        temperature=0,
        tools=[openai.pydantic_function_tool(Ship)],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    (call,) = r.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Ship) and call.function.name == "Ship"
