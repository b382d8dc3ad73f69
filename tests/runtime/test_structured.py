"""Structured output (runtime/structured.py): the answer follows a JSON schema under speculation.

The reference is written without the runtime's code: a plain loop that, each token, runs the
target over the whole sequence and masks its row with a fresh llguidance matcher fed every token
so far (the library's own matcher, built here from the export's tokenizer.json). Vanilla, tree
and batched decoding must give its tokens exactly; sampled answers must parse and follow the
schema; the server and the CLI take OpenAI's `response_format` and `--json-schema`."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from conftest import tiny_text_export

from arborspec.runtime.batch_decode import BatchDecoder
from arborspec.runtime.decode import SpeculativeDecoder
from arborspec.runtime.drafts.model import ModelDraft
from arborspec.runtime.errors import InputError
from arborspec.runtime.generator import Generator
from arborspec.runtime.sampling import SamplingParams
from arborspec.tools.commands.cli import main

lg = pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"enum": ["x", "y", "zz"]}},
    "required": ["a", "b"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},  # compact: every answer ends within ~16 tokens
}
RF = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    return tiny_text_export(tmp_path_factory.mktemp("structured") / "export", seed=9)


def follows_schema(text: str) -> bool:
    obj = json.loads(text)
    return set(obj) == {"a", "b"} and isinstance(obj["a"], int) and 0 <= obj["a"] <= 9 and obj["b"] in ("x", "y", "zz")


def reference(gen: Generator, prompt: list[int], n: int, grammar: str | None = None) -> list[int]:
    """Greedy decoding under `grammar` (llguidance's; default: SCHEMA's), plainly: a full forward
    and a fresh matcher per token."""
    tok = lg.LLTokenizer(
        gen.tokenizer.tokenizer.to_str(), n_vocab=gen.target.info.vocab_size, eos_token=gen.eos_token_ids
    )
    grammar = grammar or lg.LLMatcher.grammar_from_json_schema(SCHEMA)
    from lossless_util import plain_next_logits

    out: list[int] = []
    for _ in range(n):
        m = lg.LLMatcher(tok, grammar, log_level=0)
        assert m.consume_tokens(out) and not m.is_error()
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")
        row = plain_next_logits(gen.target, prompt + out).float()
        row[torch.from_numpy(bits[: row.numel()] == 0)] = float("-inf")
        out.append(int(row.argmax()))
        if out[-1] in gen.eos_token_ids:
            break
    return out


def test_greedy_under_a_schema_is_the_reference_in_every_mode(export_dir):
    """Vanilla, a layer draft's tree, the target as its own draft (every constrained chain
    accepted: the draft's rows are masked along their paths too) and a batch of two all give the
    plain loop's tokens; the answer parses and follows the schema; unconstrained it does not."""
    with Generator.from_export(export_dir, tree="full:2,2") as g:
        prompt = g.encode_prompt("hello there")
        want = reference(g, prompt, 40)
        text = g.tokenizer.decode(want, skip_special_tokens=True)
        assert want[-1] in g.eos_token_ids and follows_schema(text), text
        free = g.generate(prompt, len(want))
        assert free.tokens != want  # the grammar changes the answer: the test can see it
        sp = SamplingParams(grammar=g.grammar(RF))
        eng = g.target
        for draft, tree in (
            (None, None),
            (g.draft, "full:2,2"),
            (ModelDraft(eng), "chain:3"),
            (ModelDraft(eng), "full:2,2"),
        ):
            mode = "vanilla" if draft is None else "tree"
            dec = SpeculativeDecoder(eng, draft, mode=mode, tree=tree or "full:3,2", sampling=sp)
            res = dec.generate(prompt, 40, g.eos_token_ids)
            assert res.tokens == want, (mode, tree)
            if isinstance(draft, ModelDraft) and tree == "chain:3":
                assert res.stats.mean_accepted > 3.0, res.stats.mean_accepted
        bd = BatchDecoder(eng, g.draft, tree="full:2,2", max_batch=2)
        other = g.encode_prompt("a b c")
        rows = bd.generate_many([prompt, other], 40, g.eos_token_ids, sampling=[sp, sp])
        assert rows[0].tokens == want and rows[1].tokens == reference(g, other, 40)
        assert g.generate(prompt, 40, response_format=RF).tokens == want  # the API's keyword


def test_sampled_answers_follow_the_schema(export_dir):
    """Hot sampling (T = 2), tree and batched: every answer is valid and ends with EOS, and the
    answers differ (the constraint cuts, it does not fix one answer)."""
    with (
        Generator.from_export(export_dir, tree="full:2,2") as g,
        Generator.from_export(export_dir, tree="full:2,2", max_batch=4) as gb,
    ):
        texts = set()
        for gen in (g, gb):
            for seed in range(12):
                c = gen.generate("hello", 40, temperature=2.0, seed=seed, response_format=RF)
                assert c.stop_reason == "eos" and follows_schema(c.text), c.text
                texts.add(c.text)
        assert len(texts) >= 2, texts
        c = g.generate("hello", 40, response_format={"type": "json_object"})  # any object: may not close in 40
        assert c.text.startswith("{") and (c.stop_reason != "eos" or isinstance(json.loads(c.text), dict)), c.text


def test_regex_and_choice_formats(export_dir):
    """The extensions vLLM calls guided_regex / guided_choice / guided_grammar: the answer matches
    the pattern, is one of the choices, or is in the grammar's language, greedy and sampled, under
    the tree."""
    import re

    with Generator.from_export(export_dir, tree="full:2,2") as g:
        for seed in range(6):
            kw = {"temperature": 1.5, "seed": seed} if seed else {}
            c = g.generate("hello", 30, response_format={"type": "regex", "regex": "[a-c]{2,4}-[0-9]"}, **kw)
            assert re.fullmatch("[a-c]{2,4}-[0-9]", c.text) and c.stop_reason == "eos", c.text
            c = g.generate("hello", 30, response_format={"type": "choice", "choices": ["yes", "no", "maybe so"]}, **kw)
            assert c.text in ("yes", "no", "maybe so") and c.stop_reason == "eos", c.text
            # a grammar (vLLM's guided_grammar): Lark, or GBNF as llama.cpp writes it
            for grammar in (
                'start: "id-" DIGIT DIGIT ("!" | "?")\n%import common.DIGIT',
                'root ::= "id-" [0-9] [0-9] ("!" | "?")',
            ):
                c = g.generate("hello", 30, response_format={"type": "grammar", "grammar": grammar}, **kw)
                assert re.fullmatch(r"id-[0-9]{2}[!?]", c.text) and c.stop_reason == "eos", (grammar, c.text)


def test_bad_formats_are_one_line(export_dir, monkeypatch):
    with Generator.from_export(export_dir, tree="full:2,2") as g:
        for rf, msg in (
            ({"type": "xml"}, "response_format type must be text, json_object, json_schema, regex, choice or grammar"),
            ({"type": "grammar", "grammar": "start: ((("}, "does not compile"),
            ({"type": "grammar", "grammar": " "}, 'grammar needs {"grammar"'),
            ({"type": "regex", "regex": "("}, "does not compile"),
            ({"type": "choice", "choices": []}, 'choice needs {"choices"'),
            ({"type": "json_schema"}, 'json_schema needs {"json_schema"'),
            ("json", 'response_format must be an object with a "type"'),
            ({"type": "json_schema", "json_schema": {"schema": {"type": "nosuch"}}}, "response_format"),
        ):
            with pytest.raises(InputError, match="response_format") as e:
                g.generate("hi", 4, response_format=rf)
            assert msg in str(e.value), (msg, str(e.value))
        assert g.generate("hi", 4, response_format={"type": "text"}).tokens == g.generate("hi", 4).tokens
        monkeypatch.setitem(sys.modules, "llguidance", None)  # as if not installed
        g._grammars = None
        with pytest.raises(InputError, match=r"needs llguidance: pip install 'arborspec\[structured\]'"):
            g.generate("hi", 4, response_format={"type": "json_object"})


def test_the_compiled_grammars_are_bounded(export_dir, monkeypatch):
    """A server compiles whatever schemas its clients send: one compiler keeps the newest
    MAX_GRAMMARS, and one asked again is the same object (not compiled twice)."""
    import arborspec.runtime.structured as st

    monkeypatch.setattr(st, "MAX_GRAMMARS", 3)
    with Generator.from_export(export_dir, tree="full:2,2") as g:
        first = g.grammar(RF)
        assert g.grammar(RF) is first
        for i in range(4):
            g.grammar({"type": "json_schema", "json_schema": {"schema": {"type": "object", "title": str(i)}}})
        assert len(g._grammars._grammars) == 3 and g.grammar(RF) is not first


def test_cli_json_schema(export_dir, tmp_path, capsys):
    import re

    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    base = ["generate", "--export-dir", str(export_dir), "--prompt", "hello", "--max-new-tokens", "40", "--json"]
    assert main(base + ["--json-schema", str(path)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert follows_schema(res["text"]) and res["stats"]["stop_reason"] == "eos", res["text"]
    assert main(base + ["--json-schema", json.dumps(SCHEMA), "--mode", "vanilla"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == res["tokens"]
    for extra, msg in (
        (["--json-schema", "{nope"], "--json-schema is not valid JSON"),
        (["--json-schema", str(tmp_path / "none.json")], "--json-schema: no such file"),
        (["--json-schema", "[1]"], "--json-schema must be a JSON object"),
        (["--json-object", "--json-schema", str(path)], "not both"),
        (["--grammar", str(tmp_path / "none.gbnf")], "--grammar: no such file"),
        (["--grammar", "start: ((("], "the grammar does not compile"),
        (["--grammar", 'start: "a"', "--json-object"], "give one of --grammar, --json-schema, --json-object"),
    ):
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], err
    # --grammar: a GBNF file, or Lark text; the answer is in the grammar's language
    gbnf = tmp_path / "id.gbnf"
    gbnf.write_text('root ::= "id-" [0-9] [0-9]\n')
    for g in (str(gbnf), 'start: "id-" DIGIT DIGIT\n%import common.DIGIT'):
        assert main(base + ["--grammar", g]) == 0
        res = json.loads(capsys.readouterr().out)
        assert re.fullmatch("id-[0-9]{2}", res["text"]) and res["stats"]["stop_reason"] == "eos", (g, res["text"])


def test_bench_json_schema(export_dir, tmp_path):
    """`bench --json-schema`: every configuration decodes under the schema (each answer follows
    it, the tree's tokens are vanilla's), a baseline without structured output is skipped with its
    reason, and the format is recorded in the results."""
    from test_bench import PROMPTS

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    out = tmp_path / "bench.json"
    args = ["bench", "--export-dir", str(export_dir), "--modes", "vanilla,tree", "--tree", "full:2,2"]
    args += ["--prompts", str(prompts), "--limit-prompts", "3", "--max-new-tokens", "40", "--warmup", "0"]
    args += ["--no-progress", "--baselines", "hf-greedy", "--json-out", str(out)]
    assert main(args + ["--json-schema", str(tmp_path / "schema.json")]) == 0
    res = json.loads(out.read_text())
    assert res["meta"]["response_format"]["json_schema"]["schema"] == SCHEMA
    assert "hf-greedy" in res["meta"]["skipped"] and res["aggregate"]["greedy_match"] is True
    tok = Generator.from_export(export_dir, mode="vanilla").tokenizer
    for p in res["per_prompt"]:
        for name, run in p["runs"].items():
            assert follows_schema(tok.decode(run["tokens"], skip_special_tokens=True)), (name, p["id"])
    # --grammar: ours under it; llama.cpp (not asked for here) would read the GBNF as it is
    import re

    (tmp_path / "id.gbnf").write_text('root ::= "id-" [0-9] [0-9]\n')
    assert main(args + ["--grammar", str(tmp_path / "id.gbnf")]) == 0
    res = json.loads(out.read_text())
    assert res["meta"]["response_format"]["type"] == "grammar" and "hf-greedy" in res["meta"]["skipped"]
    for p in res["per_prompt"]:
        for name, run in p["runs"].items():
            assert re.fullmatch("id-[0-9]{2}", tok.decode(run["tokens"], skip_special_tokens=True)), (name, p["id"])


def test_forced_tokens_are_verified_as_one_chain(export_dir, monkeypatch):
    """Where the schema allows one string only (`{"a":`, `,"b":"`), the grammar's forced tokens are
    verified as one chain in place of the drafted tree: the same tokens as without, in fewer target
    calls (the layer draft, a tree; the target as its own draft accepts them anyway)."""
    import arborspec.runtime.step as step

    with Generator.from_export(export_dir, tree="full:2,2") as g:
        state = g.grammar(RF).state(g.target.info.vocab_size)
        assert len(state.forced()) >= step.MIN_FORCED  # the schema's opening is forced
        on = [g.generate(p, 40, response_format=RF) for p in ("hello there", "a b c", "one two")]
        monkeypatch.setattr(step, "MIN_FORCED", 10**9)  # never a forced chain
        off = [g.generate(p, 40, response_format=RF) for p in ("hello there", "a b c", "one two")]
    assert [c.tokens for c in on] == [c.tokens for c in off]
    assert sum(c.stats.steps for c in on) < sum(c.stats.steps for c in off), (
        [c.stats.steps for c in on],
        [c.stats.steps for c in off],
    )


def test_forced_chains_in_a_batch(export_dir, monkeypatch):
    """The batched decoder takes a grammar's forced tokens as a chain too (PyTorch, whose engine
    verifies a batch's trees in one call): each row's tokens are the reference's, in fewer steps
    than without."""
    from conftest import random_model, tiny_config, truncated
    from test_tokenizer import synthetic_meta

    import arborspec.runtime.step as step
    from arborspec.models.tokenizer_build import text_tokenizer_from_gguf_meta
    from arborspec.runtime.backends.torch_backend import TorchEngine

    tok = text_tokenizer_from_gguf_meta(synthetic_meta())
    m = random_model(tiny_config("llama", vocab=tok.vocab_size, layers=2, hidden=64, heads=4, kv=2), seed=9)
    with Generator(TorchEngine(m), TorchEngine(truncated(m, 1)), tok, tree="full:2,2") as g:
        assert g.target.caps.batched_trees
        sp = SamplingParams(grammar=g.grammar(RF))
        prompts = [g.encode_prompt(p) for p in ("hello there", "a b c")]
        with torch.inference_mode():  # (the torch engine's cache tensors are inference tensors)
            want = [reference(g, p, 40) for p in prompts]

        def run():
            bd = BatchDecoder(g.target, g.draft, tree="full:2,2", max_batch=2)
            rows = bd.generate_many(prompts, 40, g.eos_token_ids, sampling=[sp, sp])
            return [r.tokens for r in rows], sum(r.stats.steps for r in rows)

        on, steps_on = run()
        monkeypatch.setattr(step, "MIN_FORCED", 10**9)
        off, steps_off = run()
    assert on == off == want and steps_on < steps_off, (steps_on, steps_off)
