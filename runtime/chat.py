"""Chat: a conversation's messages checked and rendered, with OpenAI's tools, and tool calls parsed.

Role in one decode step: none inside the loop; before it and after it. Before: `chat_messages`
checks a conversation (text content, an assistant's `tool_calls`, `tool` results) and
`render_chat` renders it with the model's chat template: with the request's tools through the
template when the template knows tools (Qwen2.5's, Hermes', SmolLM3's), else in the Hermes
format as a system message (the function signatures inside `<tools>`, calls asked for inside
`<tool_call>`, results given back inside `<tool_response>`). `tool_choice` "required" or a named
function becomes a grammar (runtime/structured.py): the answer is then one call (or several)
whose arguments follow each function's JSON schema, exact under speculation like any structured
output. After: `ToolSpec.parse` splits an answer into its text and its calls (OpenAI's
`tool_calls`), and `ToolCallStream` holds a streamed answer back from `<tool_call>` on.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .errors import InputError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CHOICES = ("none", "auto", "required")
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's function names
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolError(InputError):
    """A malformed `tools` / `tool_choice` / `parallel_tool_calls` (`param` names the field)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


# ------------------------------------------------------------------------------ messages
def _text(content) -> str | None:
    """A message's content as text: a string, or OpenAI's list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        if all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str) for c in content):
            return "".join(c["text"] for c in content)
    return None


def _arguments(args) -> dict | None:
    """A call's arguments as a dict: an object, or its JSON text (OpenAI sends text)."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    return args if isinstance(args, dict) else None


MESSAGES = (
    'messages must be a non-empty list of {"role", "content"}: content a string or a list of '
    '{"type": "text", "text"} parts (only text is supported); an assistant message may carry '
    '"tool_calls" instead, a "tool" message answers one'
)


def chat_messages(messages) -> list[dict]:
    """A conversation checked -> [{"role", "content": text, ...}]: an assistant's `tool_calls`
    kept as [{"id", "type": "function", "function": {"name", "arguments": dict}}] (content "" when
    it had none), a tool result's `tool_call_id` kept. One InputError line (MESSAGES) otherwise."""
    if not isinstance(messages, list) or not messages:
        raise InputError(MESSAGES)
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InputError(MESSAGES)
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        text = _text(m.get("content"))
        if text is None and not (calls and m.get("content") in (None, "")):
            raise InputError(MESSAGES)
        msg = {"role": m["role"], "content": text or ""}
        if calls:
            msg["tool_calls"] = [_checked_call(c) for c in (calls if isinstance(calls, list) else [None])]
        if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def _checked_call(c) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    args = _arguments(fn.get("arguments", {})) if isinstance(fn, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or args is None:
        raise InputError(
            'an assistant\'s tool_calls must be [{"type": "function", "function": {"name", "arguments"}}] '
            "(arguments a JSON object or its text)"
        )
    return {"id": str(c.get("id") or ""), "type": "function", "function": {"name": fn["name"], "arguments": args}}


# ------------------------------------------------------------------------------ tools
@dataclass(frozen=True)
class ToolSpec:
    """A request's tools: `functions` ({"name", "description", "parameters"} each), `choice`
    ("none", "auto", "required" or "function": the one `name`d), `parallel` (several calls in
    one answer), `tagged`: the model's call format (`call_format`): Hermes' `<tool_call>` blocks
    with "arguments" (True), or one bare JSON object with "parameters" (False: Llama 3.1-3.3)."""

    functions: tuple
    choice: str = "auto"
    name: str | None = None
    parallel: bool = True
    tagged: bool = True

    @property
    def names(self) -> list[str]:
        return [f["name"] for f in self.functions]

    @property
    def offered(self) -> tuple:
        """The functions the prompt shows the model (none for tool_choice "none")."""
        return () if self.choice == "none" else self.functions

    def response_format(self) -> dict | None:
        """tool_choice "required" / a named function: the answer's grammar (a Lark grammar for
        runtime/structured.py): `<tool_call>` + a JSON object {"name": one of the functions,
        "arguments": its parameters' schema} + `</tool_call>`, repeated when parallel calls are
        allowed ("required"); untagged, the object alone with "parameters" (one call); None for
        "none" / "auto" (the model decides; `parse` reads it)."""
        if self.choice not in ("required", "function"):
            return None
        fns = [f for f in self.functions if self.choice == "required" or f["name"] == self.name]
        key = "arguments" if self.tagged else "parameters"
        schemas, defs = [], {}
        for i, f in enumerate(fns):
            params = hoisted(f.get("parameters") or EMPTY_PARAMETERS, f"f{i}_", defs)
            schemas.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": f["name"]}, key: params},
                    "required": ["name", key],
                    "additionalProperties": False,
                }
            )
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        if defs:
            schema = schema | {"$defs": defs}
        # the separators models write ({"name": "f", "arguments": {...}}), fixed: no runs of whitespace
        schema = schema | {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
        if not self.tagged:
            return {"type": "grammar", "grammar": f"start: %json{json.dumps(schema)}\n"}
        call = f"{json.dumps(OPEN + chr(10))} %json{json.dumps(schema)} {json.dumps(chr(10) + CLOSE)}"
        more = ' ("\\n" call)*' if self.parallel and self.choice == "required" else ""
        return {"type": "grammar", "grammar": f"start: call{more}\ncall: {call}\n"}

    def answer_format(self, given: dict | None) -> dict | None:
        """The response_format to decode with when the request also `given` one: this grammar for
        "required" / a named function (one ToolError line when both would constrain the answer),
        else the given one."""
        rf = self.response_format()
        if rf is None:
            return given
        if given is not None:
            raise ToolError(
                f"tool_choice {self.choice!r} and response_format both constrain the answer: give one", "tool_choice"
            )
        return rf

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """An answer -> (its text, its calls as OpenAI's tool_calls [{"id", "type": "function",
        "function": {"name", "arguments": JSON text}}]). The calls are the `<tool_call>` blocks
        from the first one on (the last may lack its `</tool_call>`: the answer ended there), each a
        JSON object naming an offered function with object arguments; the text is what comes
        before them (None when empty); a last block cut off (max_tokens) after whole calls is
        dropped. An answer that is only such a JSON object, untagged (what Llama 3.1's template
        asks for, with "parameters"), is one call too, and one that is only a JSON list of them
        (Mistral's `[TOOL_CALLS]` list, its special token dropped from the text) is those calls.
        Anything else, or any block that is not such a call (a first call cut by max_tokens), is
        text: (text, [])."""
        if self.choice == "none":
            return text, []
        start = text.find(OPEN)
        if start < 0:
            head = text.lstrip()[:1]
            calls = [self._call(text)] if head == "{" else self._calls(text) if head == "[" else [None]
            return (None, calls) if calls and None not in calls else (text, [])
        calls = []
        blocks = text[start:].split(OPEN)[1:]
        for i, block in enumerate(blocks):
            end = block.find(CLOSE)  # none: the answer ended inside this block
            call = self._call(block[: end if end >= 0 else len(block)])
            if call is None and calls and end < 0 and i == len(blocks) - 1:
                break  # a last call cut off (max_tokens) after whole ones: the whole ones stand
            if call is None:
                return text, []
            calls.append(call)
        if not self.parallel and len(calls) > 1:
            calls = calls[:1]
        return text[:start].strip() or None, calls

    def _calls(self, text: str) -> list:
        """A JSON list of calls -> OpenAI's tool calls ([None] when it is not one)."""
        try:
            items = json.loads(text.strip())
        except json.JSONDecodeError:
            return [None]
        if not isinstance(items, list) or not items:
            return [None]
        return [self._call(json.dumps(x)) for x in items]

    def _call(self, text: str) -> dict | None:
        """One call's JSON text -> OpenAI's tool call, or None when it is not a call of an offered
        (the named) function with object arguments."""
        try:
            obj = json.loads(text.strip())
        except json.JSONDecodeError:
            return None
        name = obj.get("name") if isinstance(obj, dict) else None
        args = _arguments(obj.get("arguments", obj.get("parameters", {}))) if isinstance(obj, dict) else None
        if name not in self.names or args is None or (self.choice == "function" and name != self.name):
            return None
        fn = {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": fn}


def hoisted(params: dict, prefix: str, defs: dict) -> dict:
    """A function's parameters schema placed inside the call's schema: its `$defs` /
    `definitions` (pydantic's nested models) move into `defs` under `prefix` + name, and every
    `$ref` to them, or into its root ("#", "#/properties/..."), is rewritten to point there (the
    refs are relative to the parameters' root, which is no longer the document's)."""
    local = {**(params.get("definitions") or {}), **(params.get("$defs") or {})}
    root = f"#/$defs/{prefix}root"
    to_root = []

    def ref(r: str) -> str:
        for kind in ("#/$defs/", "#/definitions/"):
            if r.startswith(kind) and r[len(kind) :].split("/")[0] in local:
                return "#/$defs/" + prefix + r[len(kind) :]
        if r == "#" or r.startswith("#/"):
            to_root.append(r)
            return root + r[1:]
        return r

    def walk(x):
        if isinstance(x, dict):
            return {k: (ref(v) if k == "$ref" and isinstance(v, str) else walk(v)) for k, v in x.items()}
        return [walk(v) for v in x] if isinstance(x, list) else x

    body = walk({k: v for k, v in params.items() if k not in ("$defs", "definitions")})
    defs.update({prefix + name: walk(d) for name, d in local.items()})
    if to_root:  # a recursive schema: its root by name too
        defs[prefix + "root"] = body
    return body


def tool_spec(tools, tool_choice=None, parallel_tool_calls=None, tokenizer=None) -> ToolSpec | None:
    """A request's `tools`, `tool_choice` and `parallel_tool_calls` checked -> a ToolSpec (None
    without tools), in the call format of `tokenizer`'s chat template (`call_format`; Hermes
    without one). One ToolError line naming the field for anything malformed."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ToolError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    shape = 'tools must be a list of {"type": "function", "function": {"name", "description", "parameters"}}'
    if not isinstance(tools, list):
        raise ToolError(shape, "tools")
    functions = []
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolError(shape, "tools")
        if not NAME.match(fn["name"]):
            raise ToolError(f"tool name {fn['name']!r}: letters, digits, _ . - only, at most 64", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolError(f"tool {fn['name']}: parameters must be a JSON schema object", "tools")
        if fn["name"] in (f["name"] for f in functions):
            raise ToolError(f"tool {fn['name']} is given twice", "tools")
        desc = fn.get("description")
        functions.append(
            {"name": fn["name"], "description": desc if isinstance(desc, str) else ""}
            | ({"parameters": params} if params is not None else {})
        )
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if tool_choice is None or tool_choice in CHOICES:
        return ToolSpec(tuple(functions), tool_choice or "auto", None, parallel, call_format(tokenizer))
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ToolError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name"}}',
            "tool_choice",
        )
    if name not in (f["name"] for f in functions):
        raise ToolError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return ToolSpec(tuple(functions), "function", name, parallel, call_format(tokenizer))


# ------------------------------------------------------------------------------ rendering
SYSTEM_TOOLS = (
    "# Tools\n\nYou may call one or more functions to help with the user's request. The functions "
    "you can call are described inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n\nTo call a "
    "function, answer with a JSON object holding its name and its arguments inside "
    '<tool_call></tool_call>:\n<tool_call>\n{{"name": <function name>, "arguments": <arguments as a '
    "JSON object>}}\n</tool_call>"
)


def knows_tools(tokenizer) -> bool:
    """Whether the model's chat template renders tools itself (it reads a `tools` variable)."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def call_format(tokenizer) -> bool:
    """The call format a model writes (ToolSpec.tagged): Hermes' `<tool_call>` blocks where its
    template asks for them (Qwen2.5, Qwen3, Hermes, SmolLM3) or renders no tools (we then ask for
    them: `hermes_messages`); a bare JSON object with "parameters" where the template renders tools
    without them (Llama 3.1-3.3's JSON tool calling)."""
    return not knows_tools(tokenizer) or OPEN in (getattr(tokenizer, "chat_template", None) or "")


def _call_text(call: dict) -> str:
    fn = call["function"]
    return f"{OPEN}\n{json.dumps({'name': fn['name'], 'arguments': fn['arguments']}, ensure_ascii=False)}\n{CLOSE}"


def hermes_messages(messages: list[dict], functions: tuple) -> list[dict]:
    """`chat_messages`' conversation for a template that knows no tools: the functions as a
    system message (after the conversation's own system text), an assistant's calls as its
    `<tool_call>` text, a tool result as a user message inside `<tool_response>`."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            text = "\n".join(([m["content"]] if m["content"] else []) + [_call_text(c) for c in m["tool_calls"]])
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if functions:
        listed = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)
        block = SYSTEM_TOOLS.format(tools=listed)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def render_chat(tokenizer, messages: list[dict], spec: ToolSpec | None = None) -> str:
    """The prompt text of `chat_messages`' conversation with the offered tools (see the module
    docstring); one InputError line for a template that refuses the conversation."""
    functions = spec.offered if spec is not None else ()
    try:
        if knows_tools(tokenizer):
            tools = [{"type": "function", "function": f} for f in functions] or None
            return tokenizer.apply_chat(messages, tools=tools)
        return tokenizer.apply_chat(hermes_messages(messages, functions))
    except (ValueError, TypeError) as e:
        raise InputError(f"the chat template refused the conversation: {e}") from None


# ------------------------------------------------------------------------------ streaming
class ToolCallStream:
    """A streamed answer's text pieces -> the text that is surely content: from `<tool_call>` on
    (or a tail that may begin it) it holds the text back, and all of an answer that begins with
    "{" (an untagged call); "required" / a named function holds all of it (the answer is calls).
    `held` is what it kept: content after all when the answer parses as no call."""

    def __init__(self, spec: ToolSpec):
        self.passing = spec.choice == "none"  # no calls to look for
        self.held, self.calling = "", spec.choice in ("required", "function")
        self.sent = False  # whether any content went out (an answer's start is held until it tells)

    def push(self, piece: str) -> str:
        if self.passing:
            return piece
        if self.calling:
            self.held += piece
            return ""
        s = self.held + piece
        if not self.sent and not s.strip():  # the answer's start: nothing to tell yet
            self.held = s
            return ""
        lead = s.lstrip()
        # an untagged call ({...}) or a list of them ([{...}]) may be coming: hold it all
        if not self.sent and (lead.startswith("{") or (lead.startswith("[") and lead[1:].lstrip()[:1] in ("", "{"))):
            if lead.startswith("{") or lead[1:].strip():
                self.calling = True
            self.held = s
            return ""
        self.sent = True
        i = s.find(OPEN)
        if i >= 0:
            self.calling, self.held = True, s[i:]
            return s[:i]
        keep = next((k for k in range(min(len(OPEN) - 1, len(s)), 0, -1) if OPEN.startswith(s[-k:])), 0)
        self.held = s[len(s) - keep :]
        return s[: len(s) - keep]
