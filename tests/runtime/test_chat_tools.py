"""Tool calling (runtime/chat.py): OpenAI's tools rendered into the prompt, the answer's calls
parsed, and tool_choice "required" / a named function as a grammar that holds under speculation.

The grammar's reference is written here without the runtime's code: the Lark text of a call is
spelled out in the test, and a plain loop (one causal call over the whole sequence per token, the
row masked by a fresh llguidance matcher fed every token so far) gives the tokens that vanilla,
tree and self-drafted decoding must give exactly."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_text_export

from arborspec.runtime.chat import (
    CLOSE,
    OPEN,
    ToolCallStream,
    ToolError,
    ToolSpec,
    chat_messages,
    render_chat,
    tool_spec,
)
from arborspec.runtime.decode import SpeculativeDecoder
from arborspec.runtime.drafts.model import ModelDraft
from arborspec.runtime.errors import InputError
from arborspec.runtime.generator import Generator
from arborspec.runtime.sampling import SamplingParams
from arborspec.runtime.tokenizer import TextTokenizer

CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
COUNT = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "The weather in a city", "parameters": CITY}},
    {"type": "function", "function": {"name": "count", "parameters": COUNT}},
]
ASK = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    return tiny_text_export(tmp_path_factory.mktemp("tools") / "export", seed=9, max_position=2048)  # the tools' text


def follows(call: dict) -> bool:
    """A returned call names a tool and its arguments follow that tool's schema."""
    fn = call["function"]
    args = json.loads(fn["arguments"])
    assert call["type"] == "function" and call["id"].startswith("call_")
    if fn["name"] == "weather":
        return args in ({"city": "Paris"}, {"city": "Oslo"})
    return fn["name"] == "count" and set(args) == {"n"} and isinstance(args["n"], int) and 0 <= args["n"] <= 9


# ------------------------------------------------------------------------------ checking the request
@pytest.mark.parametrize(
    "tools, choice, parallel, param",
    [
        ("weather", None, None, "tools"),
        ([{"type": "function", "function": {"description": "no name"}}], None, None, "tools"),
        ([{"type": "function", "function": {"name": "has space"}}], None, None, "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], None, None, "tools"),
        ([{"type": "function", "function": {"name": "f"}}] * 2, None, None, "tools"),
        ([{"type": "retrieval"}], None, None, "tools"),
        (TOOLS, "sometimes", None, "tool_choice"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "tool_choice"),
        (TOOLS, None, "yes", "parallel_tool_calls"),
        (None, "required", None, "tool_choice"),
    ],
)
def test_tool_spec_names_the_bad_field(tools, choice, parallel, param):
    with pytest.raises(ToolError) as e:
        tool_spec(tools, choice, parallel)
    assert e.value.param == param and "\n" not in str(e.value)


def test_tool_spec_defaults():
    assert tool_spec(None) is None and tool_spec([], "none") is None
    spec = tool_spec(TOOLS)
    assert (spec.choice, spec.name, spec.parallel, spec.names) == ("auto", None, True, ["weather", "count"])
    named = tool_spec(TOOLS, {"type": "function", "function": {"name": "count"}}, False)
    assert (named.choice, named.name, named.parallel) == ("function", "count", False)
    assert tool_spec(TOOLS, "none").offered == () and spec.response_format() is None


# ------------------------------------------------------------------------------ parsing an answer
def test_parse_splits_text_and_calls():
    spec = tool_spec(TOOLS)
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    text, calls = spec.parse("Let me look.\n" + call + "\n" + call.replace("Oslo", "Paris"))
    assert text == "Let me look." and [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Oslo"},
        {"city": "Paris"},
    ]
    assert len({c["id"] for c in calls}) == 2
    # the answer ended inside its last block (EOS before the closing tag); arguments as JSON text
    text, calls = spec.parse('<tool_call>{"name": "count", "arguments": "{\\"n\\": 3}"}')
    assert text is None and calls[0]["function"] == {"name": "count", "arguments": '{"n": 3}'}
    for bad in (
        "no call at all",
        '<tool_call>{"name": "weather", "arguments": {"city": "Ro',  # cut by max_tokens
        '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',  # not an offered tool
        '<tool_call>{"name": "count", "arguments": [1]}</tool_call>',  # arguments not an object
        call + '<tool_call>{"name": "count"</tool_call>',  # one good call, one broken but closed: all text
    ):
        assert spec.parse(bad) == (bad, [])
    # whole calls, then one cut off by max_tokens: the whole ones stand
    text, calls = spec.parse(call + "\n" + call + '\n<tool_call>\n{"name": "count", "argu')
    assert text is None and len(calls) == 2
    assert tool_spec(TOOLS, "none").parse(call) == (call, [])  # "none": never a call
    # an untagged call (Llama 3.1's template asks for bare JSON with "parameters"): the whole answer
    text, calls = spec.parse(' {"name": "count", "parameters": {"n": 5}}')
    assert text is None and calls[0]["function"] == {"name": "count", "arguments": '{"n": 5}'}
    for answer in ('{"name": "count"', '{"answer": 5}', '{"name": "count", "parameters": {}} and more'):
        assert spec.parse(answer) == (answer, [])
    # a JSON list of calls (Mistral's [TOOL_CALLS] list; the special token is not in the text)
    text, calls = spec.parse(
        '[{"name": "count", "arguments": {"n": 1}}, {"name": "weather", "arguments": {"city": "Oslo"}}]'
    )
    assert text is None and [c["function"]["name"] for c in calls] == ["count", "weather"]
    for answer in ("[1] An answer", "[]", '[{"name": "count", "arguments": {}}, {"name": "nope"}]'):
        assert spec.parse(answer) == (answer, [])
    one = tool_spec(TOOLS, parallel_tool_calls=False)
    assert len(one.parse(call + call)[1]) == 1
    named = tool_spec(TOOLS, {"type": "function", "function": {"name": "count"}})
    assert named.parse(call) == (call, [])  # a call of another function than the named one


def test_stream_holds_back_from_the_tag():
    s = ToolCallStream(tool_spec(TOOLS))
    out = [s.push(p) for p in ("Sure", ", one moment <", "tool", "_call>\n{", '"name"')]
    assert out == ["Sure", ", one moment ", "", "", ""] and s.held == '<tool_call>\n{"name"'
    s = ToolCallStream(tool_spec(TOOLS))
    assert [s.push(p) for p in ("a <to", "ast>", " b")] == ["a ", "<toast>", " b"] and s.held == ""
    s = ToolCallStream(tool_spec(TOOLS, "required"))
    assert s.push("anything") == "" and s.held == "anything"
    assert ToolCallStream(tool_spec(TOOLS, "none")).push("<tool_call>") == "<tool_call>"
    s = ToolCallStream(tool_spec(TOOLS))  # an answer that begins with "{" may be an untagged call
    assert [s.push(p) for p in (" ", '{"na', 'me"')] == ["", "", ""] and s.held == ' {"name"'
    s = ToolCallStream(tool_spec(TOOLS))
    assert [s.push(p) for p in ("\n", "Hi {x}")] == ["", "\nHi {x}"]
    s = ToolCallStream(tool_spec(TOOLS))  # "[" then "{": a list of calls may be coming
    assert [s.push(p) for p in ("[", ' {"name', '": 1}]')] == ["", "", ""] and s.held == '[ {"name": 1}]'
    s = ToolCallStream(tool_spec(TOOLS))  # "[" then anything else: text
    assert [s.push(p) for p in ("[", "1] Intro")] == ["", "[1] Intro"]


# ------------------------------------------------------------------------------ rendering
def test_a_conversation_with_calls_renders_in_the_hermes_form(export_dir):
    """A template that knows no tools (ChatML): the tools as a system message, the assistant's
    call as its <tool_call> text, the result as a <tool_response> user turn."""
    with Generator.from_export(export_dir) as g:
        msgs = chat_messages(
            [
                {"role": "system", "content": "Be brief."},
                *ASK,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "rain"},
            ]
        )
        text = render_chat(g.tokenizer, msgs, tool_spec(TOOLS))
        system = text.split("<|im_end|>")[0]
        assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and "<tools>" in system
        listed = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
        assert [json.loads(x) for x in listed] == [
            {
                "type": "function",
                "function": {"name": "weather", "description": "The weather in a city", "parameters": CITY},
            },
            {"type": "function", "function": {"name": "count", "description": "", "parameters": COUNT}},
        ]
        assert (
            '<|im_start|>assistant\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>'
            in text
        )
        assert "<|im_start|>user\n<tool_response>\nrain\n</tool_response><|im_end|>" in text
        assert text.endswith("<|im_start|>assistant\n")
        plain = render_chat(g.tokenizer, msgs, tool_spec(TOOLS, "none"))  # "none": the tools not shown
        assert "<tools>" not in plain and plain.startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_a_template_that_knows_tools_renders_them_itself(export_dir):
    """Qwen2.5-style templates read `tools` and each message's `tool_calls` (arguments as an object)."""
    template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}|"
        "{% endfor %}"
    )
    with Generator.from_export(export_dir) as g:
        tok = TextTokenizer(g.tokenizer.tokenizer, {**g.tokenizer.meta, "chat_template": template})
        call = {"type": "function", "function": {"name": "count", "arguments": '{"n": 2}'}}
        msgs = chat_messages([*ASK, {"role": "assistant", "content": "", "tool_calls": [call]}])
        assert (
            render_chat(tok, msgs, tool_spec(TOOLS))
            == 'TOOLS:weather;count;|user:hello there|assistant:[count {"n": 2}]|'
        )
        assert render_chat(tok, msgs) == 'user:hello there|assistant:[count {"n": 2}]|'


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{nope"}}]}],
        [{"role": "assistant", "content": None, "tool_calls": "f()"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    ],
)
def test_bad_messages_are_one_line(messages):
    with pytest.raises(InputError) as e:
        chat_messages(messages)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------ the grammar
lg = pytest.importorskip("llguidance")


def count_call_grammar() -> str:
    """The named function `count`'s answer, spelled out without runtime/chat.py."""
    schema = {
        "type": "object",
        "properties": {"name": {"const": "count"}, "arguments": COUNT},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    }
    return lg.LLMatcher.grammar_from_lark(f'start: "<tool_call>\\n" %json{json.dumps(schema)} "\\n</tool_call>"')


def test_a_named_function_is_the_reference_in_every_mode(export_dir):
    """tool_choice naming `count`: vanilla, a layer draft's tree and the target as its own draft
    give the plain loop's tokens; the answer is one call of `count` whose arguments follow its
    schema; without tools the same conversation is no call (the grammar is what made it one)."""
    named = {"type": "function", "function": {"name": "count"}}
    with Generator.from_export(export_dir, tree="full:2,2") as g:
        c = g.chat(ASK, 120, tools=TOOLS, tool_choice=named)
        assert c.text == "" and len(c.tool_calls) == 1 and c.tool_calls[0]["function"]["name"] == "count"
        assert follows(c.tool_calls[0]) and c.stop_reason == "eos"
        prompt = g.encode_prompt(render_chat(g.tokenizer, chat_messages(ASK), tool_spec(TOOLS, named)))
        from test_structured import reference  # (the plain constrained loop)

        want = reference(g, prompt, 120, count_call_grammar())
        assert c.tokens == want
        text = g.tokenizer.decode(want, skip_special_tokens=True)
        assert text.startswith(OPEN) and text.endswith(CLOSE)
        free = g.chat(ASK, 120, tools=TOOLS, tool_choice="auto")
        assert free.tool_calls is None and free.tokens != want  # the test can see the grammar
        sp = SamplingParams(grammar=g.grammar(tool_spec(TOOLS, named).response_format()))
        for draft, tree in ((None, None), (g.draft, "full:2,2"), (ModelDraft(g.target), "chain:4")):
            dec = SpeculativeDecoder(
                g.target, draft, mode="tree" if draft else "vanilla", tree=tree or "full:3,2", sampling=sp
            )
            res = dec.generate(prompt, 120, g.eos_token_ids)
            assert res.tokens == want, tree
            if tree == "chain:4":  # the constrained target as its own draft: its chains accepted whole
                assert res.stats.mean_accepted > 3.0, res.stats.mean_accepted


def test_required_calls_sampled_follow_their_schemas(export_dir):
    """tool_choice "required", sampled hot (T = 2): every answer is one call (parallel calls off)
    of an offered tool with valid arguments; "auto" at the same seeds makes no call (the random
    model knows no tools: the grammar is what makes each answer a call)."""
    with Generator.from_export(export_dir, tree="full:2,2") as g:
        for seed in range(6):
            kw = {"tools": TOOLS, "temperature": 2.0, "seed": seed}
            c = g.chat(ASK, 160, tool_choice="required", parallel_tool_calls=False, **kw)
            assert c.tool_calls and len(c.tool_calls) == 1 and follows(c.tool_calls[0]), c.text
            assert g.chat(ASK, 40, **kw).tool_calls is None
        with pytest.raises(InputError, match="give one"):
            g.chat(ASK, 8, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})


def test_spec_grammar_is_the_spelled_out_one(export_dir):
    """ToolSpec's grammar for a named function takes what the test's own spelling takes (so the
    reference above checks what the runtime sends); a required choice takes every tool, and
    several calls only with parallel calls."""
    named = ToolSpec(tuple(t["function"] for t in TOOLS), "function", "count")
    call = '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>'
    good, oslo = call % ("count", '{"n": 4}'), call % ("weather", '{"city": "Oslo"}')
    with Generator.from_export(export_dir) as g:
        tok = lg.LLTokenizer(
            g.tokenizer.tokenizer.to_str(), n_vocab=g.target.info.vocab_size, eos_token=g.eos_token_ids
        )

        def takes(grammar: str, text: str) -> bool:
            m = lg.LLMatcher(tok, grammar, log_level=0)
            ids = g.tokenizer.encode(text)
            return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

        ours, spelled = named.response_format()["grammar"], count_call_grammar()
        for text in (good, good.replace(": ", ":"), oslo, call % ("count", '{"n": 12}'), good + "\n" + good):
            assert takes(ours, text) == takes(spelled, text), text
        assert takes(ours, good) and not takes(ours, oslo)
        both = tool_spec(TOOLS, "required").response_format()["grammar"]
        assert takes(both, good) and takes(both, oslo) and takes(both, good + "\n" + oslo)
        assert not takes(tool_spec(TOOLS, "required", False).response_format()["grammar"], good + "\n" + oslo)


# ------------------------------------------------------------------------------ the server
@pytest.fixture(scope="module")
def served(export_dir):
    pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    from test_serve import serving

    from arborspec.tools.serve.app import GeneratorPool

    pool = GeneratorPool(lambda: Generator.from_export(export_dir, tree="full:2,2"), 1)
    with serving(pool, max_context=2048) as base:
        yield base


def post(base, body: dict, path: str = "/v1/chat/completions"):
    import httpx

    return httpx.post(base + path, json=body, timeout=120)


def streamed(base, body: dict) -> list[dict]:
    """The choice deltas of a streamed chat answer, and the finish reasons."""
    import httpx

    out = []
    with httpx.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out += json.loads(line[6:])["choices"]
    return out


FORCED = '"Checking.\\n<tool_call>\\n{\\"name\\": \\"count\\", \\"arguments\\": {\\"n\\": 3}}\\n</tool_call>"'


def test_server_required_and_named_calls(served, export_dir):
    """tool_choice "required" / named over HTTP: finish_reason tool_calls, content null, the calls
    Generator.chat makes; streamed as one tool_calls delta and no content."""
    named = {"type": "function", "function": {"name": "count"}}
    with Generator.from_export(export_dir, tree="full:2,2") as g:
        want = g.chat(ASK, 120, tools=TOOLS, tool_choice=named).tool_calls[0]["function"]
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": named, "max_tokens": 120, "temperature": 0}
    r = post(served, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [want]
    chunks = streamed(served, body)
    assert "".join(c["delta"].get("content") or "" for c in chunks) == ""
    calls = [tc for c in chunks for tc in c["delta"].get("tool_calls", [])]
    assert [(tc["index"], tc["type"], tc["function"]) for tc in calls] == [(0, "function", want)]
    assert calls[0]["id"].startswith("call_") and chunks[-1]["finish_reason"] == "tool_calls"
    r = post(served, {**body, "tool_choice": "required", "parallel_tool_calls": False, "temperature": 2, "seed": 1})
    assert r.status_code == 200 and all(follows(c) for c in r.json()["choices"][0]["message"]["tool_calls"]), r.text


def test_server_auto_reads_the_calls_of_the_answer(served):
    """tool_choice auto: an answer that writes text and then a <tool_call> block (forced here by a
    grammar: the random model knows no tools) is content + tool_calls, streamed as the content
    before the tag and then the call; an answer that only begins like the tag is all content."""
    rf = {"type": "grammar", "grammar": f"start: {FORCED}"}
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 200, "response_format": rf}
    msg = post(served, body).json()["choices"][0]
    assert msg["finish_reason"] == "tool_calls" and msg["message"]["content"] == "Checking."
    assert [c["function"] for c in msg["message"]["tool_calls"]] == [{"name": "count", "arguments": '{"n": 3}'}]
    chunks = streamed(served, body)
    assert "".join(c["delta"].get("content") or "" for c in chunks) == "Checking.\n"
    assert [tc["function"]["name"] for c in chunks for tc in c["delta"].get("tool_calls", [])] == ["count"]
    near = {"type": "grammar", "grammar": 'start: "Checking <tool_cat> done"'}
    for chunks in (streamed(served, {**body, "response_format": near}),):
        assert "".join(c["delta"].get("content") or "" for c in chunks) == "Checking <tool_cat> done"
        assert chunks[-1]["finish_reason"] == "stop" and not any("tool_calls" in c["delta"] for c in chunks)
    # the call and its result sent back: the next turn is served
    turn = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": msg["message"]["tool_calls"]},
        {"role": "tool", "tool_call_id": msg["message"]["tool_calls"][0]["id"], "content": "3 apples"},
    ]
    assert post(served, {"messages": turn, "tools": TOOLS, "max_tokens": 4}).status_code == 200


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": "weather"}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"messages": [{"role": "tool"}]}, "messages"),
    ],
)
def test_server_bad_tools_are_400s(served, body, param):
    r = post(served, {"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = post(served, {"prompt": "hi", "tools": TOOLS}, "/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_a_template_without_tags_gets_bare_json_calls(export_dir):
    """A template that renders tools without Hermes tags (Llama 3.1-3.3's JSON tool calling): the
    call format is one bare JSON object with "parameters"; a named function's answer is that
    object, read back as the call; a Hermes template keeps the tags."""
    llama = (
        "{% if tools %}Use JSON with name and parameters. {% for t in tools %}{{ t.function.name }} {% endfor %}{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}|{% endfor %}assistant: "
    )
    with Generator.from_export(export_dir, tree="full:2,2") as g:
        hermes_tok = TextTokenizer(g.tokenizer.tokenizer, {**g.tokenizer.meta, "chat_template": llama + OPEN})
        assert tool_spec(TOOLS, tokenizer=hermes_tok).tagged and tool_spec(TOOLS, tokenizer=g.tokenizer).tagged
        g.tokenizer = TextTokenizer(g.tokenizer.tokenizer, {**g.tokenizer.meta, "chat_template": llama})
        named = {"type": "function", "function": {"name": "count"}}
        spec = tool_spec(TOOLS, named, tokenizer=g.tokenizer)
        assert not spec.tagged and '"parameters"' in spec.response_format()["grammar"]
        c = g.chat(ASK, 120, tools=TOOLS, tool_choice=named)
        text = g.tokenizer.decode(c.tokens, skip_special_tokens=True)
        assert text.startswith('{"name": "count", "parameters": {') and OPEN not in text, text
        assert c.text == "" and [x["function"]["name"] for x in c.tool_calls] == ["count"] and follows(c.tool_calls[0])


def test_nested_parameters_keep_their_refs(export_dir):
    """Parameters with `$defs` (pydantic's nested models; two tools each with its own `Address`)
    and a recursive one (`"$ref": "#"`): their refs still point where they did once the schemas
    sit inside the call's grammar. The grammar compiles, takes calls that follow each schema and
    refuses ones that follow the other tool's `Address`."""
    addr = {
        "type": "object",
        "properties": {"city": {"enum": ["Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    other = {
        "type": "object",
        "properties": {"zip": {"type": "integer"}},
        "required": ["zip"],
        "additionalProperties": False,
    }
    tree = {
        "type": "object",
        "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
        "required": ["v"],
        "additionalProperties": False,
    }

    def nested(name, a):
        params = {
            "type": "object",
            "properties": {"to": {"$ref": "#/$defs/Address"}},
            "required": ["to"],
            "additionalProperties": False,
            "$defs": {"Address": a},
        }
        return {"type": "function", "function": {"name": name, "parameters": params}}

    tools = [
        nested("ship", addr),
        nested("mail", other),
        {"type": "function", "function": {"name": "grow", "parameters": tree}},
    ]
    grammar = tool_spec(tools, "required", False).response_format()["grammar"]
    call = '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>'
    with Generator.from_export(export_dir) as g:
        tok = lg.LLTokenizer(
            g.tokenizer.tokenizer.to_str(), n_vocab=g.target.info.vocab_size, eos_token=g.eos_token_ids
        )

        def takes(text: str) -> bool:
            m = lg.LLMatcher(tok, grammar, log_level=0)
            assert not m.is_error(), m.get_error()
            ids = g.tokenizer.encode(text)
            return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

        assert takes(call % ("ship", '{"to": {"city": "Oslo"}}')) and takes(call % ("mail", '{"to": {"zip": 5}}'))
        assert not takes(call % ("ship", '{"to": {"zip": 5}}')) and not takes(
            call % ("mail", '{"to": {"city": "Oslo"}}')
        )
        assert takes(call % ("grow", '{"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}]}'))
        assert not takes(call % ("grow", '{"v": 1, "kids": [{"w": 2}]}'))
