"""DecoderConfig (runtime/decoder_config.py): one object for how SpeculativeDecoder, BatchDecoder
and Generator speculate; its fields as keywords are the same decoder; a bad field is one line."""

from __future__ import annotations

import pytest

from arborspec.runtime.batch_decode import BatchDecoder
from arborspec.runtime.decode import SpeculativeDecoder
from arborspec.runtime.decoder_config import DecoderConfig
from arborspec.runtime.errors import InputError
from arborspec.runtime.generator import Generator
from arborspec.runtime.sampling import SamplingParams

PROMPT = [1, 5, 7, 9, 3, 11]


def _setup(dec) -> tuple:
    """What a decoder made of its configuration."""
    return dec.mode, dec.policy.spec if dec.policy else None, dec.candidates, dec.prefix_cache, dec.cold


def test_config_and_keywords_make_the_same_decoder(llama_pair):
    target, draft = llama_pair
    kw = dict(mode="chain", tree="chain:3", candidates="sample", max_tree_nodes=3, prefix_cache=False)
    by_config = SpeculativeDecoder(target, draft, DecoderConfig(**kw))
    by_keywords = SpeculativeDecoder(target, draft, **kw)
    assert _setup(by_config) == _setup(by_keywords) == ("chain", "chain:3", "sample", False, True)
    assert by_config.generate(PROMPT, 8).tokens == by_keywords.generate(PROMPT, 8).tokens
    # keywords over a config: the keyword wins, the config's other fields stay
    over = SpeculativeDecoder(target, draft, DecoderConfig(**kw), tree="chain:2")
    assert _setup(over) == ("chain", "chain:2", "sample", False, True)
    b1 = BatchDecoder(target, draft, DecoderConfig(tree="full:2,2", max_batch=3, speculate_max_batch=2))
    b2 = BatchDecoder(target, draft, tree="full:2,2", max_batch=3, speculate_max_batch=2)
    assert (b1.policy.spec, b1.max_batch, b1.speculate_max_batch) == (b2.policy.spec, 3, 2) == ("full:2,2", 3, 2)
    assert BatchDecoder(target, draft).max_batch == 8  # a BatchDecoder's own default


def test_defaults_are_the_decoders_own(llama_pair):
    target, draft = llama_pair
    dec = SpeculativeDecoder(target, draft)
    assert (dec.mode, dec.policy.spec, dec.candidates) == ("tree", "full:3,2", "topk")
    gen = Generator(target, None)
    assert (gen.mode, gen.tree, gen.max_batch) == ("vanilla", "full:3,2", 1)
    # no mode: tree with a draft, else vanilla, as the resolver says for every entry point
    assert SpeculativeDecoder(target, None).mode == "vanilla"
    with pytest.raises(InputError, match="needs a draft"):
        SpeculativeDecoder(target, None, mode="tree")


@pytest.mark.parametrize(
    "field,value,line",
    [
        ("mode", "fast", "unknown mode 'fast' (expected one of vanilla, chain, tree)"),
        ("candidates", "best", "unknown candidate mode 'best' (expected one of topk, sample, sample-unique)"),
        ("max_batch", 0, "max_batch must be an integer >= 1, got 0"),
        ("max_batch", True, "max_batch must be an integer >= 1, got True"),
        ("speculate_max_batch", -1, "speculate_max_batch must be an integer >= 1, got -1"),
    ],
)
def test_a_bad_field_is_one_line(llama_pair, field, value, line):
    target, draft = llama_pair
    with pytest.raises(InputError) as e:
        DecoderConfig(**{field: value})
    assert str(e.value) == line
    for make in (SpeculativeDecoder, BatchDecoder, Generator):  # the keyword form: the same line
        with pytest.raises(InputError) as e:
            make(target, draft, **{field: value})
        assert str(e.value) == line


def test_an_unknown_keyword_is_a_type_error(llama_pair):
    target, draft = llama_pair
    for make, name in ((SpeculativeDecoder, "SpeculativeDecoder"), (BatchDecoder, "BatchDecoder"), (Generator, "Generator")):
        with pytest.raises(TypeError, match=rf"^{name}\(\) got an unexpected keyword argument 'tre'$"):
            make(target, draft, tre="full:2,2")


def test_a_generators_config_reaches_both_decoders(llama_pair):
    """The one config builds the greedy and the sampled decoder (the sampled one with
    sampled_tree) and the batch decoder."""
    target, draft = llama_pair
    cfg = DecoderConfig(tree="full:2,2", sampled_tree="chain:2", candidates="sample-unique", prefix_cache=False)
    with Generator(target, draft, config=cfg) as gen:
        greedy, sampled = gen._decoder(SamplingParams()), gen._decoder(SamplingParams(0.8))
        assert _setup(greedy) == ("tree", "full:2,2", "sample-unique", False, True)
        assert _setup(sampled) == ("tree", "chain:2", "sample-unique", False, True)
        assert gen.config.max_batch == 1 and gen.tree == "full:2,2" and gen.sampled_tree == "chain:2"
    with Generator(target, draft, config=cfg, max_batch=2, speculate_max_batch=1) as gen:
        bd = gen._batch.decoder
        assert (bd.policy.spec, bd.candidates, bd.max_batch, bd.speculate_max_batch) == ("full:2,2", "sample-unique", 2, 1)
        assert not bd._solo.prefix_cache
        assert gen.generate(PROMPT, 6).tokens == SpeculativeDecoder(target, draft, cfg).generate(PROMPT, 6).tokens


def test_resolve_config_defaults_and_limits(tmp_path):
    """The one resolver: mode tree with a draft else vanilla; the tree named, else chain mode's
    DEFAULT_CHAIN, else the export's default, else DEFAULT_TREE; the lower node limit."""
    from arborspec.runtime.decoder_config import DEFAULT_CHAIN, DEFAULT_TREE, Opened, resolve_config

    def got(asked=None, opened=None, key=None, temperature=0.0):
        c = resolve_config(asked, opened, key, temperature)
        return c.mode, c.tree, c.sampled_tree, c.max_tree_nodes

    assert got(None, Opened(has_draft=True)) == ("tree", DEFAULT_TREE, None, None)
    assert got(None, None) == ("vanilla", DEFAULT_TREE, None, None)
    assert got(None, Opened(True, "chain:2", 40)) == ("tree", "chain:2", None, 40)
    assert got(DecoderConfig(mode="chain"), Opened(True, "chain:2")) == ("chain", DEFAULT_CHAIN, None, None)
    assert got(DecoderConfig(tree="beam:2,2", max_tree_nodes=50), Opened(True, "chain:2", 40))[1:] == (
        "beam:2,2",
        None,
        40,
    )
    assert got(DecoderConfig(max_tree_nodes=8), Opened(True, None, 40))[3] == 8
    once = resolve_config(DecoderConfig(candidates="sample"), Opened(True, "full:2,2", 30))
    assert resolve_config(once, Opened(True, "full:2,2", 30)) == once  # resolving twice changes nothing
    # what was opened, read from any object with draft / tree_default / limits (an OpenedExport)
    from types import SimpleNamespace

    ex = SimpleNamespace(draft=object(), tree_default="full:2,1", limits={"max_tree_nodes": 12})
    assert got(None, ex) == ("tree", "full:2,1", None, 12)
    assert DecoderConfig().tree_spec == DEFAULT_TREE  # the decoders' own fallback: the same constant


def test_resolve_config_auto_and_the_tuned_file(tmp_path):
    """"auto" reads the file runtime/tuned_tree.py names; without one it is one line naming the
    `tune` command, while no tree at all falls back to the export's default (documented in
    docs/embedding-api.md); with one, no tree in tree mode is the tuned tree too; at temperature
    > 0 the sampled file wins where `tune --temperature` wrote it; chain + auto is refused and
    vanilla ignores auto."""
    import json

    from arborspec.runtime.decoder_config import Opened, resolve_config
    from arborspec.runtime.errors import MissingFileError
    from arborspec.runtime.tuned_tree import ModelsKey, auto_tree_file

    key, opened = ModelsKey(export_dir=tmp_path), Opened(True, "full:2,2")
    assert key.path() == auto_tree_file(tmp_path) == tmp_path / "tree_auto.json"
    with pytest.raises(MissingFileError, match=r"no tuned tree .*tree_auto.json.*arborspec tune --export-dir"):
        resolve_config(DecoderConfig(tree="auto"), opened, key)
    assert resolve_config(DecoderConfig(), opened, key).tree == "full:2,2"  # no file: the export's default
    assert resolve_config(DecoderConfig(mode="vanilla", tree="auto"), opened, key).mode == "vanilla"
    with pytest.raises(InputError, match="--tree auto picks a static tree: use it with --mode tree"):
        resolve_config(DecoderConfig(mode="chain", tree="auto"), opened, key)
    (tmp_path / "tree_auto.json").write_text(json.dumps({"format": 1, "paths": [[0], [0, 0]]}))
    greedy = f"static:{tmp_path / 'tree_auto.json'}"
    for asked in (DecoderConfig(), DecoderConfig(tree="AUTO")):
        assert (resolve_config(asked, opened, key).tree, resolve_config(asked, opened, key).sampled_tree) == (greedy, None)
    assert resolve_config(DecoderConfig(tree="full:3,1"), opened, key).tree == "full:3,1"  # named: kept
    (tmp_path / "tree_auto.sampled.json").write_text(json.dumps({"format": 1, "paths": [[0]]}))
    sampled = f"static:{tmp_path / 'tree_auto.sampled.json'}"
    assert resolve_config(DecoderConfig(), opened, key).sampled_tree == sampled
    assert resolve_config(DecoderConfig(), opened, key, temperature=0.7).tree == sampled
    (tmp_path / "tree_auto.json").write_text("{not json")
    with pytest.raises(InputError, match="is not valid JSON; re-run `arborspec tune`"):
        resolve_config(DecoderConfig(tree="auto"), opened, key)
