"""`arborspec serve`: a real uvicorn server on 127.0.0.1 over a tiny export. Concurrent greedy
requests equal the single-sequence output, one sequence per generator and batched (one verify
call for several requests); streamed chunks concatenate to the full text; bad
requests get an OpenAI-style 4xx and the server keeps serving; a client that disconnects
mid-stream frees its generator; the API key guards every route but /health; /metrics speaks
Prometheus."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from conftest import tiny_text_export  # noqa: E402

from arborspec.runtime.generator import Generator  # noqa: E402
from arborspec.tools.serve.app import GeneratorPool, create_app  # noqa: E402

KEY = "sekrit"


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    return tiny_text_export(tmp_path_factory.mktemp("serve") / "export", seed=9)


@contextlib.contextmanager
def serving(pool, max_context: int = 512, **app_kw):
    """The app over `pool` on a free 127.0.0.1 port, in a thread -> its base URL; stopped and the
    pool closed on exit."""
    app = create_app(pool, "tiny", max_context=max_context, **app_kw)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    assert srv.started
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        t.join(timeout=30)
        pool.close()


@pytest.fixture(scope="module", params=[1, 4], ids=["one-at-a-time", "batched"])
def server(export_dir, request):
    """max_batch 1: two generators, one sequence each; 4: one generator batching 4 sequences."""
    mb = request.param
    pool = GeneratorPool(
        lambda: Generator.from_export(export_dir, tree="full:2,2", max_batch=mb), 2 if mb == 1 else 1, slots=mb
    )
    with serving(pool, api_key=KEY) as base:
        yield base, pool


def client(base):
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def test_health_models_and_auth(server):
    base, _ = server
    assert httpx.get(base + "/health").json()["status"] == "ok"  # no key needed
    r = httpx.get(base + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with client(base) as c:
        assert c.get("/v1/models").json()["data"][0]["id"] == "tiny"
        assert c.get("/v1/models/tiny").json() == c.get("/v1/models").json()["data"][0]  # retrieve
        r = c.get("/v1/models/other")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(base + "/v1/models/tiny").status_code == 401


def test_concurrent_greedy_requests_equal_single(server, export_dir):
    base, pool = server
    prompts = ["hello", "the world", "hell the", "12 the", "hello hello", "w"]
    ref = {}
    with Generator.from_export(export_dir, tree="full:2,2") as g:
        for p in prompts:
            ref[p] = g.generate(p, 12).text

    def one(p):
        with client(base) as c:
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 0})
            assert r.status_code == 200, r.text
            return p, r.json()["choices"][0]["text"], r.json()["usage"]

    with ThreadPoolExecutor(6) as ex:
        got = list(ex.map(one, prompts * 2))
    for p, text, usage in got:
        assert text == ref[p], p
        assert usage["completion_tokens"] >= 1
    if pool.slots > 1:  # batched: concurrent requests shared verify calls
        assert pool.mean_batch > 1.2
        with client(base) as c:
            m = c.get("/metrics").text
        line = next(x for x in m.splitlines() if x.startswith("arborspec_mean_batch_size "))
        assert float(line.split()[1]) > 1.2


def test_stream_concatenates_to_the_full_text(server):
    base, _ = server
    with client(base) as c:
        full = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 16, "temperature": 0},
        ).json()
        text = full["choices"][0]["message"]["content"]
        parts, done = [], False
        with c.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 16,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                obj = json.loads(line[6:])
                for ch in obj["choices"]:
                    parts.append(ch["delta"].get("content", ""))
        assert done and "".join(parts) == text


@pytest.mark.parametrize(
    "body,status,param",
    [
        ("{not json", 400, None),
        ({"prompt": "hi", "model": "other"}, 404, "model"),
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": "hi", "n": 0}, 400, "n"),
        ({"prompt": ["hi", 3]}, 400, "prompt"),
        ({"prompt": [[1, 2], []]}, 400, "prompt"),
        ({"prompt": ["hi"] * 9, "n": 8}, 400, "prompt"),
        ({"prompt": "hi", "n": 17}, 400, "n"),
        ({"prompt": "hi", "n": "2"}, 400, "n"),
        ({"prompt": [10**7]}, 400, None),
        ({"prompt": "hi", "stop": ""}, 400, "stop"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            400,
            "messages",
        ),
        ({"messages": [{"role": "user", "content": 3}]}, 400, "messages"),
        ({"messages": []}, 400, "messages"),
        ({"prompt": "hi", "stop": ["a", 1]}, 400, "stop"),
        ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"prompt": "hi", "top_k": -2}, 400, "top_k"),
        # penalties out of range or of the wrong type, a bias on a token outside the vocabulary
        ({"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ({"prompt": "hi", "frequency_penalty": "1"}, 400, "frequency_penalty"),
        ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
        ({"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
        ({"prompt": "hi", "logit_bias": {"x": 10}}, 400, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"100000": 1}}, 400, "logit_bias"),
        ({"prompt": "hi", "logit_bias": [5, 1]}, 400, "logit_bias"),
        # fields that would change the answer and are not implemented: refused, never ignored
        ({"prompt": "hi", "best_of": 2}, 400, "best_of"),
        ({"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
        ({"prompt": "hi", "logprobs": "x"}, 400, "logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "echo": True}, 400, "echo"),
        ({"prompt": "hi", "echo": 1}, 400, "echo"),
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "hi", "response_format": {"type": "xml"}}, 400, "response_format"),
        ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {}}}, 400, "response_format"),
    ],
)
def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, body, status, param):
    base, _ = server
    with client(base) as c:
        data = body if isinstance(body, str) else json.dumps(body)
        route = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
        r = c.post(route, content=data, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["message"] and "type" in err and (param is None or err["param"] == param)
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_penalties_and_logit_bias_are_the_generators(server, export_dir):
    """presence / frequency / repetition penalties, min_p and logit_bias (OpenAI's string token
    ids) reach the generator: the server's tokens are Generator.generate's with the same
    keywords, and differ from the unpenalised answer (greedy and sampled, completions and chat)."""
    base, _ = server
    pen = {"presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3, "logit_bias": {"7": 5.0}}
    with Generator.from_export(export_dir, tree="full:2,2") as g:
        ids = g.encode_prompt("one two one two")
        kw = {**pen, "logit_bias": {7: 5.0}}
        want = g.generate(ids, 12, **kw).tokens
        plain = g.generate(ids, 12).tokens
        sampled = g.generate(ids, 12, temperature=0.9, seed=4, min_p=0.05, **kw).tokens
    assert want != plain
    with client(base) as c:
        for extra, tokens in (({"temperature": 0}, want), ({"temperature": 0.9, "seed": 4, "min_p": 0.05}, sampled)):
            r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 12, **pen, **extra, "logprobs": 0})
            assert r.status_code == 200, r.text
            got = r.json()["choices"][0]
            assert got["logprobs"]["tokens"] == [g.tokenizer.decode([t]) for t in tokens]
        r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 12, "temperature": 0, "presence_penalty": 0})
        assert r.json()["choices"][0]["logprobs"] is None and r.status_code == 200


def test_response_format_json_schema_is_followed(server, export_dir):
    """OpenAI's structured output: a json_schema answer parses and follows the schema, plain and
    streamed, completions and chat, and equals Generator.generate's with the same format."""
    pytest.importorskip("llguidance")
    from test_structured import RF, follows_schema

    base, _ = server
    with Generator.from_export(export_dir, tree="full:2,2") as g:
        want = g.generate("hello", 40, response_format=RF).text
    with client(base) as c:
        r = c.post(
            "/v1/completions", json={"prompt": "hello", "max_tokens": 40, "temperature": 0, "response_format": RF}
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == want and follows_schema(want) and choice["finish_reason"] == "stop"
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "response_format": RF}
        r = c.post("/v1/chat/completions", json={**body, "temperature": 1.5, "seed": 3})
        assert r.status_code == 200 and follows_schema(r.json()["choices"][0]["message"]["content"]), r.text
        parts = []
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True, "temperature": 0}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    parts += [ch["delta"].get("content", "") for ch in json.loads(line[6:])["choices"]]
        assert follows_schema("".join(parts)), parts


def test_vllm_fields_reach_the_generator(server, export_dir):
    """vLLM's request fields clients and benchmarks send: guided_json / guided_regex /
    guided_choice (structured output), min_tokens, stop_token_ids and ignore_eos (a fixed-length
    benchmark), include_stop_str_in_output, truncate_prompt_tokens: each answer is
    Generator.generate's with the same request; use_beam_search and length_penalty are refused,
    never ignored."""
    pytest.importorskip("llguidance")
    import re

    from test_structured import SCHEMA, follows_schema

    base, _ = server
    with Generator.from_export(export_dir, tree="full:2,2") as g:
        ids = g.encode_prompt("one two one two")
        free = g.generate(ids, 24, ignore_eos=True).tokens
        stop_id = free[3]
        want = {
            "stop_token_ids": g.generate(ids, 24, stop_token_ids=[stop_id]).tokens,
            "min_tokens": g.generate(ids, 24, min_tokens=20, logit_bias={g.eos_token_ids[0]: 8}).tokens,
            "truncated": g.generate(ids[-3:], 8).text,
        }
    with client(base) as c:

        def post(**kw):
            r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 24, "temperature": 0, "logprobs": 0, **kw})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        def tokens(choice):
            return choice["logprobs"]["tokens"]

        assert len(tokens(post(ignore_eos=True))) == 24
        got = post(stop_token_ids=[stop_id])
        assert (
            tokens(got) == [g.tokenizer.decode([t]) for t in want["stop_token_ids"]] and got["finish_reason"] == "stop"
        )
        got = post(min_tokens=20, logit_bias={str(g.eos_token_ids[0]): 8})
        assert tokens(got) == [g.tokenizer.decode([t]) for t in want["min_tokens"]] and len(tokens(got)) >= 20
        assert follows_schema(post(guided_json=SCHEMA)["text"])
        assert follows_schema(post(guided_json=json.dumps(SCHEMA))["text"])
        assert re.fullmatch("[ab]{3}", post(guided_regex="[ab]{3}")["text"])
        assert post(guided_choice=["left", "right"])["text"] in ("left", "right")
        # the prompt's last 3 tokens only: the answer of those 3 tokens, and 3 prompt tokens counted
        r = c.post(
            "/v1/completions", json={"prompt": ids, "max_tokens": 8, "temperature": 0, "truncate_prompt_tokens": 3}
        )
        assert r.json()["usage"]["prompt_tokens"] == 3 and r.json()["choices"][0]["text"] == want["truncated"]
        full = post()["text"]
        stop = full[3:5]
        cut, kept = post(stop=stop)["text"], post(stop=stop, include_stop_str_in_output=True)["text"]
        assert (cut, kept) == (full[: full.find(stop)], full[: full.find(stop) + 2]), (full, stop)
        for body, param in (
            ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
            ({"guided_json": "{nope"}, "guided_json"),
            ({"guided_choice": []}, "guided_choice"),
            ({"min_tokens": -1}, "min_tokens"),
            ({"stop_token_ids": [10**7]}, "stop_token_ids"),
            ({"use_beam_search": True}, "use_beam_search"),
            ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
            ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
            ({"length_penalty": 2}, "length_penalty"),
        ):
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_stop_strings_end_the_answer(server):
    base, _ = server
    req = {"prompt": "hello hello", "max_tokens": 24, "temperature": 0}
    with client(base) as c:
        full = c.post("/v1/completions", json=req).json()["choices"][0]
        text = full["text"]
        assert full["finish_reason"] == "length" and "ok" in text and "ohe" in text, text
        for stop, at in (("ok", text.find("ok")), (["zz", "ohe"], text.find("ohe"))):
            r = c.post("/v1/completions", json={**req, "stop": stop}).json()["choices"][0]
            assert (r["text"], r["finish_reason"]) == (text[:at], "stop"), stop
        # the "off" values of unimplemented fields are accepted, and top_k is honoured
        off = {"presence_penalty": 0, "logprobs": None, "echo": False, "response_format": {"type": "text"}}
        hot = {**req, **off, "temperature": 2.0, "seed": 1}
        assert c.post("/v1/completions", json=hot).json()["choices"][0]["text"] != text  # the control
        r = c.post("/v1/completions", json={**hot, "top_k": 1}).json()
        assert r["choices"][0]["text"] == text  # top-k 1 samples the greedy token
        parts, finish = [], None
        with c.stream("POST", "/v1/completions", json={**req, "stop": "ok", "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for ch in json.loads(line[6:])["choices"]:
                        parts.append(ch["text"])
                        finish = ch["finish_reason"] or finish
        assert "".join(parts) == text[: text.find("ok")] and finish == "stop"


def test_content_parts_of_text_are_the_same_message(server):
    base, _ = server  # OpenAI's newer clients send content as a list of parts
    req = {"max_tokens": 12, "temperature": 0}
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    with client(base) as c:
        a = c.post("/v1/chat/completions", json={**req, "messages": [{"role": "user", "content": "hello"}]})
        b = c.post("/v1/chat/completions", json={**req, "messages": [{"role": "user", "content": parts}]})
        assert a.status_code == b.status_code == 200, b.text
        assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"]
        assert a.json()["usage"] == b.json()["usage"]


def test_n_choices_are_the_samples_of_seeds_seed_to_seed_plus_n(server):
    """One sequence per generator: choice i is exactly the request with seed + i. Batched, the n
    choices decode together and a sampled output depends on the batch it ran in (serving.md), so
    there the shape is checked (and a greedy n gives n equal choices)."""
    base, pool = server
    alone = pool.slots == 1
    req = {"prompt": "hello hello", "max_tokens": 8, "temperature": 2.0, "seed": 1}
    with client(base) as c:
        one = [c.post("/v1/completions", json={**req, "seed": 1 + i}).json() for i in range(3)]
        r = c.post("/v1/completions", json={**req, "n": 3}).json()
        assert [ch["index"] for ch in r["choices"]] == [0, 1, 2] and r["seed"] == 1
        if alone:
            assert [ch["text"] for ch in r["choices"]] == [o["choices"][0]["text"] for o in one]
            assert len({ch["text"] for ch in r["choices"]}) > 1  # seeds 1..3 draw different samples here
            assert r["usage"]["completion_tokens"] == sum(o["usage"]["completion_tokens"] for o in one)
        assert r["usage"]["prompt_tokens"] == one[0]["usage"]["prompt_tokens"]
        greedy = c.post("/v1/completions", json={**req, "temperature": 0, "n": 2}).json()["choices"]
        assert (
            greedy[0]["text"]
            == greedy[1]["text"]
            == c.post("/v1/completions", json={**req, "temperature": 0}).json()["choices"][0]["text"]
        )
        # streamed: each choice's chunks, in its own index, end with its own finish_reason
        texts, finishes, usage = {}, {}, None
        chat = {"messages": [{"role": "user", "content": "hello hello"}], "max_tokens": 8, "temperature": 2.0}
        full = c.post("/v1/chat/completions", json={**chat, "seed": 1, "n": 2}).json()
        body = {**chat, "seed": 1, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
        with c.stream("POST", "/v1/chat/completions", json=body) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                usage = obj.get("usage") or usage
                for ch in obj["choices"]:
                    texts[ch["index"]] = texts.get(ch["index"], "") + ch["delta"].get("content", "")
                    if ch["finish_reason"]:
                        finishes[ch["index"]] = ch["finish_reason"]
        assert set(texts) == set(finishes) == {0, 1} and usage["prompt_tokens"] == full["usage"]["prompt_tokens"]
        if alone:
            assert texts == {i: ch["message"]["content"] for i, ch in enumerate(full["choices"])}
            assert usage == full["usage"]


def test_a_list_of_prompts_gets_n_choices_each(server):
    base, _ = server
    req = {"max_tokens": 6, "temperature": 0}
    with client(base) as c:
        single = [c.post("/v1/completions", json={**req, "prompt": p}).json() for p in ("hello", "the")]
        r = c.post("/v1/completions", json={**req, "prompt": ["hello", "the"], "n": 2}).json()
        assert [ch["index"] for ch in r["choices"]] == [0, 1, 2, 3]
        want = [single[k]["choices"][0]["text"] for k in (0, 0, 1, 1)]  # prompt k's choices: k*n .. k*n+n-1
        assert [ch["text"] for ch in r["choices"]] == want
        assert r["usage"]["prompt_tokens"] == sum(x["usage"]["prompt_tokens"] for x in single)
        ids = c.post("/v1/completions", json={**req, "prompt": [[5, 6, 7], [8]]}).json()
        assert len(ids["choices"]) == 2 and ids["usage"]["prompt_tokens"] == 4


def test_logprobs_are_the_generators_in_openais_shapes(server, export_dir):
    base, _ = server
    with Generator.from_export(export_dir, tree="full:2,2") as g:
        want = g.generate("hello hello", 6, logprobs=2)
        word = [g.tokenizer.decode([t]) for t in want.tokens]
    req = {"prompt": "hello hello", "max_tokens": 6, "temperature": 0}
    with client(base) as c:
        r = c.post("/v1/completions", json={**req, "logprobs": 2}).json()["choices"][0]
        lp = r["logprobs"]
        assert lp["tokens"] == word and "".join(word) == r["text"]
        assert lp["token_logprobs"] == pytest.approx([x for _, x, _ in want.logprobs], abs=1e-5)
        assert [len(t) for t in lp["top_logprobs"]] == [2] * 6
        assert lp["text_offset"] == [sum(len(w) for w in word[:i]) for i in range(6)]
        assert c.post("/v1/completions", json=req).json()["choices"][0]["logprobs"] is None
        zero = c.post("/v1/completions", json={**req, "logprobs": 0}).json()["choices"][0]["logprobs"]
        assert zero["top_logprobs"] == [{}] * 6 and zero["token_logprobs"] == lp["token_logprobs"]  # 0 is not "off"
        chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}
        r = c.post("/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 3}).json()
        content = r["choices"][0]["logprobs"]["content"]
        assert len(content) == 4 and all(len(e["top_logprobs"]) == 3 for e in content)
        assert "".join(e["token"] for e in content) == r["choices"][0]["message"]["content"]
        assert all(e["logprob"] <= 0 and e["bytes"] == list(e["token"].encode()) for e in content)
        assert "logprobs" not in c.post("/v1/chat/completions", json=chat).json()["choices"][0]


def test_echo_scores_a_continuation_as_lm_evaluation_harness_asks(server, export_dir):
    """lm-evaluation-harness's loglikelihood requests (`local-completions`): token ids, echo,
    logprobs 1, max_tokens 1, then sum(token_logprobs[ctxlen:-1]) and is_greedy from
    top_logprobs. The prompt's log-probs (the prefill's rows) must equal the log-probs the same
    tokens had when decoded (the verify calls' rows): a greedy continuation scores as greedy with
    its generated log-probs, and a changed one is not greedy."""
    base, _ = server
    with Generator.from_export(export_dir, tree="full:2,2") as g:
        ctx = g.encode_prompt("hello hello")
        want = g.generate(ctx, 6, logprobs=1)
    cont = want.tokens

    def score(c, tokens):
        body = {"prompt": [ctx + tokens], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
        choice = c.post("/v1/completions", json=body).json()["choices"][0]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ctx) + len(tokens) + 1  # the prompt, then the one new token
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # the first token has no row
        part = lp["token_logprobs"][len(ctx) : -1]
        greedy = all(x == max(top.values()) for x, top in zip(part, lp["top_logprobs"][len(ctx) : -1]))
        return part, greedy, choice

    with client(base) as c:
        part, greedy, choice = score(c, cont)
        assert part == pytest.approx([x for _, x, _ in want.logprobs], abs=1e-4) and greedy
        assert choice["text"].startswith("hello hello")  # echo: the prompt's text first
        other = cont[:3] + [(cont[3] + 1) % 90] + cont[4:]
        part2, greedy2, _ = score(c, other)
        assert not greedy2 and part2[:3] == pytest.approx(part[:3], abs=1e-5) and part2[3] < part[3]
        # max_tokens 0 with echo: the prompt alone, nothing decoded for the client
        r = c.post("/v1/completions", json={"prompt": "hello hello", "echo": True, "max_tokens": 0, "logprobs": 0})
        r = r.json()
        ch = r["choices"][0]
        assert ch["text"] == "hello hello" and r["usage"]["completion_tokens"] == 0
        assert len(ch["logprobs"]["tokens"]) == len(ctx) and ch["logprobs"]["top_logprobs"][1] == {}
        # streamed echo: the prompt's text is the first chunk
        parts = []
        body = {"prompt": "hello hello", "echo": True, "max_tokens": 4, "temperature": 0, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    parts += [ch["text"] for ch in json.loads(line[6:])["choices"]]
        plain = c.post("/v1/completions", json={**body, "stream": False, "echo": False}).json()
        assert parts[0] == "hello hello" and "".join(parts) == "hello hello" + plain["choices"][0]["text"]


def test_no_seed_draws_another_sample_each_time(server):
    base, _ = server  # a fixed default seed answered every unseeded sampled request the same way
    req = {"prompt": "hello hello", "max_tokens": 8, "temperature": 2.0}
    with client(base) as c:
        seeds = {c.post("/v1/completions", json=req).json()["seed"] for _ in range(3)}
        assert len(seeds) == 3
        a, b = (c.post("/v1/completions", json={**req, "seed": 77}).json() for _ in range(2))
        assert a["seed"] == b["seed"] == 77 and a["choices"] == b["choices"]


def test_no_max_tokens_decodes_to_the_end_of_the_context(server):
    base, _ = server  # OpenAI's and vLLM's default (it was 64 tokens, cut silently)
    with client(base) as c:
        r = c.post("/v1/completions", json={"prompt": "hello", "temperature": 0}).json()
        u = r["usage"]
        assert r["choices"][0]["finish_reason"] == "length" and u["total_tokens"] == 512, u
        long = {"prompt": [5] * 512, "temperature": 0}
        r = c.post("/v1/completions", json=long)
        assert r.status_code == 400 and "fills the model's context of 512" in r.json()["error"]["message"]


def test_disconnect_mid_stream_frees_the_generator(server):
    base, pool = server
    with client(base) as c:
        with c.stream(
            "POST", "/v1/completions", json={"prompt": "hello", "max_tokens": 400, "stream": True, "temperature": 0}
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # one chunk, then hang up
    for _ in range(100):
        if pool.busy == 0:
            break
        time.sleep(0.1)
    assert pool.busy == 0
    with client(base) as c:
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        m = c.get("/metrics").text
    assert "arborspec_generated_tokens_total" in m and "arborspec_queue_depth" in m and "arborspec_mean_accepted" in m


def test_loadtest_against_the_server(server, tmp_path, capsys):
    from arborspec.tools.commands.cli import main

    base, _ = server
    out = tmp_path / "lt.json"
    rc = main(
        [
            "loadtest",
            "--url",
            base,
            "--concurrency",
            "3",
            "--requests",
            "6",
            "--max-tokens",
            "6",
            "--stream",
            "--api-key",
            KEY,
            "--json-out",
            str(out),
        ]
    )
    res = json.loads(out.read_text())
    assert rc == 0 and res["ok"] == 6 and res["errors"] == 0 and res["all_answered_once"]
    assert res["tokens"] > 0 and res["ttft_p50_s"] is not None and res["latency_p99_s"] >= res["latency_p50_s"]
    # --ignore-eos: a fixed-length load, every answer max_tokens long
    args = ["loadtest", "--url", base, "--requests", "4", "--max-tokens", "9", "--api-key", KEY, "--json-out", str(out)]
    assert main(args + ["--ignore-eos", "--chat"]) == 0
    res = json.loads(out.read_text())
    assert res["ok"] == 4 and res["tokens"] == 4 * 9, res
    sent = []  # the body loadtest sends (this tiny model rarely ends early: the field itself is checked)

    class Capture:
        def post(self, route, json):
            sent.append(json)
            raise OSError("captured")

    from arborspec.tools.commands.loadtest import one_request

    for extra in (None, {"ignore_eos": True}):
        one_request(Capture(), 0, True, False, 9, 0.0, extra=extra)
    assert "ignore_eos" not in sent[0] and sent[1]["ignore_eos"] is True
    rc = main(["loadtest", "--url", base, "--requests", "2", "--max-tokens", "2"])  # no key: 401s counted
    assert rc == 1
    assert main(["loadtest", "--url", "ftp://x", "--requests", "1"]) == 2


class Held:
    """A generator whose answers wait until `go` is set (a slot kept busy, deterministically)."""

    def __init__(self, g, go: threading.Event):
        self._g, self._go = g, go

    def __getattr__(self, name):
        return getattr(self._g, name)

    def stream(self, *a, **kw):
        self._go.wait(30)
        return self._g.stream(*a, **kw)


def test_a_full_queue_answers_503_at_once_and_admits_again(export_dir):
    """One slot, --max-queue 1: a second request waits, a third is refused at once with 503 +
    Retry-After (not left waiting without bound); once they finish, requests are admitted again;
    a request asking for more sequences than can ever be admitted is a 400."""
    go = threading.Event()
    pool = GeneratorPool(lambda: Held(Generator.from_export(export_dir, tree="full:2,2"), go), 1, slots=1)
    with serving(pool, max_queue=1) as base:
        try:
            req = {"prompt": "hello", "max_tokens": 4, "temperature": 0}
            with ThreadPoolExecutor(2) as ex:
                held = [ex.submit(httpx.post, base + "/v1/completions", json=req, timeout=60) for _ in range(2)]
                for _ in range(100):  # both admitted (one decoding, one waiting)
                    if pool.waiting + pool.busy >= 2:
                        break
                    time.sleep(0.05)
                r = httpx.post(base + "/v1/completions", json=req, timeout=10)
                assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
                assert r.json()["error"]["code"] == "overloaded"
                go.set()
                assert [f.result().status_code for f in held] == [200, 200]
            assert httpx.post(base + "/v1/completions", json=req, timeout=60).status_code == 200
            r = httpx.post(base + "/v1/completions", json={**req, "n": 3}, timeout=10)
            assert r.status_code == 400 and "more than this server admits (2)" in r.json()["error"]["message"]
        finally:
            go.set()  # never leave the held requests waiting


def test_a_chats_next_turn_goes_to_the_generator_that_keeps_its_start(tmp_path_factory):
    """Two generators, one sequence each, on a row-invariant (int4) export: each turn of a chat
    is routed to the free generator whose cache holds most of its prompt, so the next turn
    reuses it (a FIFO pool sent it to the other generator, which had nothing: 0 cached)."""
    pytest.importorskip("onnxruntime")
    from conftest import tiny_text_export as export

    int4 = export(tmp_path_factory.mktemp("int4") / "e", seed=9, quantize="int4", max_tree_nodes=32)
    pool = GeneratorPool(lambda: Generator.from_export(int4, tree="chain:2"), 2, slots=1)
    with serving(pool) as base:
        msgs = [{"role": "user", "content": "hello hello hello the hell"}]
        cached = []
        for _ in range(3):
            r = httpx.post(base + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "temperature": 0})
            body = r.json()
            cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
            msgs += [body["choices"][0]["message"], {"role": "user", "content": "the hell"}]
        assert cached[0] == 0 and all(c > 10 for c in cached[1:]), cached
        # loadtest's conversations: each turn the whole chat so far, the reuse reported
        from arborspec.tools.commands.cli import main

        out = tmp_path_factory.mktemp("lt") / "lt.json"
        args = ["loadtest", "--url", base, "--chat", "--turns", "3", "--requests", "2", "--concurrency", "2"]
        assert main(args + ["--max-tokens", "6", "--stream", "--json-out", str(out)]) == 0
        res = json.loads(out.read_text())
        assert res["ok"] == res["requests"] == 6 and res["all_answered_once"] and res["turns"] == 3
        assert len(res["ttft_p50_s_by_turn"]) == 3 and res["cached_tokens"] > 20, res
        assert main(["loadtest", "--url", base, "--turns", "2"]) == 2  # conversations need --chat


def test_tokenize_and_detokenize(server, export_dir):
    """vLLM's /tokenize (a prompt, or messages through the chat template) and /detokenize: the
    generator's own ids and text; bad bodies are 400s naming the field."""
    base, _ = server
    msgs = [{"role": "user", "content": "hello there"}]
    with Generator.from_export(export_dir) as g:
        ids = g.encode_prompt("hello there")
        chat_ids = g.encode_prompt(g.tokenizer.apply_chat(msgs))
        text = g.tokenizer.decode(chat_ids)
    with client(base) as c:
        assert c.post("/tokenize", json={"prompt": "hello there"}).json() == {
            "count": len(ids),
            "max_model_len": 512,
            "tokens": ids,
        }
        assert c.post("/tokenize", json={"messages": msgs}).json()["tokens"] == chat_ids
        assert c.post("/detokenize", json={"tokens": chat_ids}).json() == {"prompt": text}
        for path, body, param in (
            ("/tokenize", {"prompt": 3}, "prompt"),
            ("/tokenize", {"messages": []}, "messages"),
            ("/tokenize", {"messages": msgs, "tools": "x"}, "tools"),
            ("/detokenize", {"tokens": [-1]}, "tokens"),
            ("/detokenize", {"tokens": "1 2"}, "tokens"),
        ):
            r = c.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
        assert httpx.post(base + "/tokenize", json={"prompt": "x"}).status_code == 401  # the key guards it
