"""`arborspec generate` end to end on tiny checkpoints, and one clear error per bad input."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import random_model, tiny_config

from arborspec.tools.commands.cli import main


def save_nanogpt(module, path):
    cfg = module.config
    torch.save(
        {
            "model_args": dict(
                n_layer=cfg.n_layers,
                n_head=cfg.n_heads,
                n_embd=cfg.hidden_size,
                block_size=cfg.max_position,
                bias=True,
                vocab_size=cfg.vocab_size,
            ),
            "model": module.state_dict(),
        },
        path,
    )
    return str(path)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    a = save_nanogpt(random_model(tiny_config("gpt2", layers=2), seed=1), d / "a.pt")
    b = save_nanogpt(random_model(tiny_config("gpt2", vocab=50, layers=1), seed=2), d / "b.pt")
    return a, b


def run_cli(args, capsys):
    rc = main(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_output_and_modes_agree(ckpts, capsys):
    a, _ = ckpts
    outs = {}
    for mode in ["vanilla", "chain", "tree"]:
        rc, out, err = run_cli(
            [
                "generate",
                "--model",
                a,
                "--draft",
                "layers:1",
                "--mode",
                mode,
                "--prompt-ids",
                "1,2,3",
                "--max-new-tokens",
                "16",
                "--json",
            ],
            capsys,
        )
        assert rc == 0, err
        res = json.loads(out)
        assert res["prompt_tokens"] == 3 and len(res["tokens"]) == 16
        assert {"mean_accepted", "target_calls", "tokens_per_s"} <= set(res["stats"])
        outs[mode] = res["tokens"]
    assert outs["vanilla"] == outs["chain"] == outs["tree"]


def test_n_completions(ckpts, capsys):
    a, _ = ckpts
    rc, out, err = run_cli(
        [
            "generate",
            "--model",
            a,
            "--draft",
            "layers:1",
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "8",
            "--temperature",
            "1.0",
            "--n",
            "3",
            "--seed",
            "5",
            "--json",
        ],
        capsys,
    )
    assert rc == 0, err
    res = json.loads(out)
    assert len(res["tokens"]) == 3 and all(len(t) == 8 for t in res["tokens"])
    # seeds seed..seed+N-1: completion i equals a single run with seed 5+i
    rc, out, _ = run_cli(
        [
            "generate",
            "--model",
            a,
            "--draft",
            "layers:1",
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "8",
            "--temperature",
            "1.0",
            "--seed",
            "6",
            "--json",
        ],
        capsys,
    )
    assert json.loads(out)["tokens"] == res["tokens"][1]


def test_json_logprobs_are_the_apis(ckpts, capsys):
    """--json --logprobs K: each token's log-prob and the K most likely, as Generator.generate's."""
    from arborspec.runtime.generator import Generator
    from arborspec.tools.engines import open_engines

    a, _ = ckpts
    args = ["generate", "--model", a, "--draft", "layers:1", "--tree", "full:2,2", "--prompt-ids", "1,2,3"]
    rc, out, err = run_cli(args + ["--max-new-tokens", "10", "--json", "--logprobs", "2"], capsys)
    assert rc == 0, err
    res = json.loads(out)
    with open_engines(model=a, draft="layers:1") as om:
        want = Generator(om.target, om.draft, tree="full:2,2").generate([1, 2, 3], 10, logprobs=2)
    assert [e["token"] for e in res["logprobs"]] == res["tokens"] == want.tokens
    assert [e["logprob"] for e in res["logprobs"]] == pytest.approx([lp for _, lp, _ in want.logprobs], abs=1e-5)
    assert [[a for a, _, _ in e["top"]] for e in res["logprobs"]] == [
        [a for a, _ in top] for _, _, top in want.logprobs
    ]
    for extra, msg in (
        (["--logprobs", "1"], "--logprobs is printed with --json"),
        (["--json", "--logprobs", "21"], "[0, 20]"),
    ):
        rc, _, err = run_cli(args + extra, capsys)
        assert rc == 2 and msg in err


def test_penalties_and_logit_bias_reach_the_decoder(ckpts, capsys):
    """--repetition-penalty, --presence-penalty, --frequency-penalty and --logit-bias: vanilla and
    tree give the decoder's penalised tokens (SamplingParams with the same values), which differ
    from the unpenalised ones."""
    from arborspec.runtime.decode import SpeculativeDecoder
    from arborspec.runtime.sampling import SamplingParams
    from arborspec.tools.engines import open_engines

    a, _ = ckpts
    base = ["generate", "--model", a, "--draft", "layers:1", "--prompt-ids", "1,2,3", "--max-new-tokens", "16"]
    pen = ["--repetition-penalty", "1.5", "--frequency-penalty", "0.5", "--logit-bias", "5=3", "--logit-bias", "3=-100"]
    got = {}
    for mode in ("vanilla", "tree"):
        rc, out, err = run_cli(base + pen + ["--mode", mode, "--json"], capsys)
        assert rc == 0, err
        got[mode] = json.loads(out)["tokens"]
    rc, out, _ = run_cli(base + ["--mode", "vanilla", "--json"], capsys)
    plain = json.loads(out)["tokens"]
    sp = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, logit_bias={5: 3.0, 3: -100.0})
    with open_engines(model=a, draft="layers:1") as om:
        want = SpeculativeDecoder(om.target, mode="vanilla", sampling=sp).generate([1, 2, 3], 16).tokens
    assert got["vanilla"] == got["tree"] == want != plain and 3 not in want
    # every flag lands in its field (this model's logits are too far apart for the penalties to
    # change its tokens; the bias above does)
    from arborspec.tools.commands.cli import build_parser, sampling_from_args

    more = ["--min-p", "0.1", "--presence-penalty", "-0.5", "--min-tokens", "3", "--ignore-eos"]
    args = build_parser().parse_args(base + pen + more)
    want = dataclasses.replace(sp, min_p=0.1, presence_penalty=-0.5, min_tokens=3, ignore_eos=True)
    assert sampling_from_args(args) == want


@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "empty",
        "too_long",
        "vocab",
        "tree",
        "no_tokenizer",
        "bad_ids",
        "temperature",
        "penalty",
        "bias",
        "bias_vocab",
    ],
)
def test_bad_input_one_clear_line(ckpts, capsys, tmp_path, case):
    a, b = ckpts
    base = ["generate", "--model", a, "--draft", "layers:1", "--max-new-tokens", "4"]
    args = {
        "missing": ["generate", "--model", str(tmp_path / "nope.pt"), "--prompt-ids", "1"],
        "empty": base + ["--prompt-ids", ""],
        "too_long": base + ["--prompt-ids", ",".join(["1"] * 600)],
        "vocab": ["generate", "--model", a, "--draft", b, "--prompt-ids", "1,2"],
        "tree": base + ["--tree", "full:3", "--prompt-ids", "1,2"],
        "no_tokenizer": base + ["--prompt", "hello"],
        "bad_ids": base + ["--prompt-ids", "1,x"],
        "temperature": base + ["--temperature", "-1", "--prompt-ids", "1"],
        "penalty": base + ["--presence-penalty", "3", "--prompt-ids", "1"],
        "bias": base + ["--logit-bias", "5", "--prompt-ids", "1"],
        "bias_vocab": base + ["--logit-bias", "9999=1", "--prompt-ids", "1"],
    }[case]
    rc, out, err = run_cli(args, capsys)
    assert rc == 2
    lines = [l for l in err.strip().splitlines() if l]
    assert len(lines) == 1 and lines[0].startswith("arborspec: error: "), err
    assert "Traceback" not in err
    expect = {
        "missing": "nope.pt",
        "empty": "empty prompt",
        "too_long": "max context",
        "vocab": "vocabulary",
        "tree": "malformed tree spec",
        "no_tokenizer": "--prompt-ids",
        "bad_ids": "integers",
        "temperature": "temperature",
        "penalty": "presence-penalty must be in [-2, 2]",
        "bias": "--logit-bias takes TOKEN=BIAS",
        "bias_vocab": "outside the vocabulary",
    }[case]
    assert expect in lines[0]


def test_help_has_an_example(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    assert "arborspec generate --model" in capsys.readouterr().out


def test_dtype_reaches_the_torch_engines_and_is_refused_for_an_export(ckpts, capsys, tmp_path):
    """--dtype bf16: the target's and the model draft's weights and cache in bfloat16 (what the
    GPU runs in fp16 use); greedy decoding through the CLI equals the engine's own vanilla
    decode in that dtype. An export folder's dtype is fixed: --dtype there is one error line."""
    from arborspec.models.registry import load_model
    from arborspec.runtime.backends.torch_backend import TorchEngine
    from arborspec.runtime.decode import SpeculativeDecoder
    from arborspec.tools.engines import open_engines

    a, _ = ckpts
    with open_engines(model=a, draft="layers:1", dtype="bf16") as m:
        assert m.target.info.cache.dtype == torch.bfloat16
        assert next(m.target.module.parameters()).dtype == torch.bfloat16
        assert next(getattr(m.draft, "engine", m.draft).module.parameters()).dtype == torch.bfloat16
    ref = SpeculativeDecoder(TorchEngine(load_model(a).module, dtype=torch.bfloat16), mode="vanilla")
    want = ref.generate([1, 2, 3], 12).tokens
    rc, out, err = run_cli(
        ["generate", "--model", a, "--draft", "layers:1", "--dtype", "bf16", "--mode", "tree"]
        + ["--tree", "full:2,2", "--prompt-ids", "1,2,3", "--max-new-tokens", "12", "--json"],
        capsys,
    )
    assert rc == 0, err
    assert len(json.loads(out)["tokens"]) == 12
    rc, out, err = run_cli(
        ["generate", "--model", a, "--dtype", "bf16", "--mode", "vanilla", "--prompt-ids", "1,2,3"]
        + ["--max-new-tokens", "12", "--json"],
        capsys,
    )
    assert rc == 0 and json.loads(out)["tokens"] == want, err
    rc, out, err = run_cli(
        ["generate", "--export-dir", str(tmp_path), "--dtype", "fp16", "--prompt-ids", "1", "--max-new-tokens", "2"],
        capsys,
    )
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "--dtype fp16 is for the torch backend" in lines[0], err


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "gpu"])
def test_a_device_that_is_not_there_is_one_line(ckpts, capsys, device):
    """--device cuda where torch sees no GPU (or a name torch does not know) is one error line,
    not torch's AssertionError traceback from moving the weights."""
    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible here")
    a, _ = ckpts
    rc, out, err = run_cli(
        ["generate", "--model", a, "--device", device, "--prompt-ids", "1,2", "--max-new-tokens", "2"], capsys
    )
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and f"device {device}" in lines[0].replace("'", ""), err
