"""The one-call embedding API: text (or ids) in, text out, with tree speculative decoding.

Role in one decode step: none of its own; it owns a `SpeculativeDecoder` (runtime/decode.py)
per sampling configuration, the tokenizer and the engines, and turns each call into one
generation. Typical use in a production app:

    from arborspec import Generator
    with Generator.from_export("exports/smollm2", backend="onnxruntime", draft="lookup",
                               tree="full:3,2") as gen:
        c = gen.generate("Write a haiku about trees.", max_new_tokens=64)
        print(c.text, c.stats.tokens_per_s)
        for chunk in gen.stream("Once upon a time", temperature=0.8, seed=1):
            print(chunk, end="")
        c = gen.chat([{"role": "user", "content": "Hello!"}], stop=["\n\n"])  # c.stop_reason "stop"

Thread safety: one Generator may be shared by several threads. With `max_batch=1` (the
default) its calls are serialised by a lock (a `stream()` holds it until the iterator is
exhausted or closed). With `max_batch=N > 1` a background thread decodes up to N concurrent
calls together, one verify call per step for all of them (runtime/batch_scheduler.py):

    gen = Generator.from_export("exports/smollm2", draft="lookup", max_batch=8)
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda p: gen.generate(p).text, prompts))

`last_stats` / `last_stop_reason` are the calling thread's last generation's.
"""

from __future__ import annotations

import re
import threading
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

from .decode import SpeculativeDecoder, check_logprobs
from .decoder_config import DEFAULT_TREE, DecoderConfig, with_options
from .errors import EmptyCompletionWarning, InputError, MissingFileError
from .penalties import check_bias
from .request import GenerationRequest, GenerationResult
from .sampling import SamplingParams
from .stats import GenerationStats
from .stats import GenerationStats as _Stats
from .stop_strings import StopStrings, decode_until_stop, parse_stop

if TYPE_CHECKING:
    from .export_dir import OpenOptions

AUTO_TREE_FILE = "tree_auto.json"  # written by `arborspec tune --export-dir DIR`


@dataclass
class Completion:
    text: str
    tokens: list[int]
    prompt_tokens: int
    stop_reason: str  # "eos", "length", "context" or "stop" (a stop string)
    stats: GenerationStats = field(repr=False, default_factory=GenerationStats)
    # with generate(logprobs=k): per token (id, log-prob, [(id, log-prob)] of the k most likely)
    logprobs: list | None = field(repr=False, default=None)
    # with generate(prompt_logprobs=k): the prompt's, the same shape (the first token's log-prob None)
    prompt_logprobs: list | None = field(repr=False, default=None)
    # with chat(tools=...): the answer's calls, OpenAI's tool_calls (runtime/chat.py); `text` is then
    # the text before them
    tool_calls: list | None = None


class Generator:
    """target: an Engine; draft: a DraftSource, an Engine or None; tokenizer: a TextTokenizer
    (needed for text prompts and `chat`). config: how its decoders speculate and batch
    (runtime/decoder_config.py; mode None: "tree" with a draft, else "vanilla"; max_batch None:
    1), options its fields as keywords over it: Generator(t, d, tok, tree="chain:4").
    eos_token_ids: None: the tokenizer's. An opened export (`from_export`) is closed by close()."""

    def __init__(
        self,
        target,
        draft=None,
        tokenizer=None,
        config: DecoderConfig | None = None,
        *,
        eos_token_ids: Sequence[int] | None = None,
        **options,
    ):
        cfg = DecoderConfig.of(config, options, "Generator")
        mode = cfg.mode or ("tree" if draft is not None else "vanilla")
        self.config = cfg = replace(cfg, mode=mode, tree=cfg.tree_spec, max_batch=cfg.max_batch or 1)
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        if eos_token_ids is None:
            eos_token_ids = list(getattr(tokenizer, "eos_token_ids", []) or [])
        self.eos_token_ids = [int(e) for e in eos_token_ids]
        self._owns: list = []  # closed by close(): from_export's opened export
        self._grammars = None  # structured.GrammarCompiler, made at the first response_format
        self._lock = threading.RLock()
        # two decoders at most: greedy calls' and sampled calls' (their trees may differ); each
        # call sets its own SamplingParams on the one it uses (under the lock)
        self._decoders: dict[bool, SpeculativeDecoder] = {}
        self._decoder(SamplingParams())  # validates mode / tree / draft now, not at the first call
        if cfg.sampled_tree:
            self._decoder(SamplingParams(temperature=1.0))  # and the sampled calls' tree
        self._last = _LastCall()
        self._busy = 0
        self._batch = None
        if cfg.max_batch > 1:
            from .batch_decode import BatchDecoder
            from .batch_scheduler import BatchScheduler

            self._batch = BatchScheduler(BatchDecoder(target, draft, cfg))
        self.closed = False

    # the config's fields that callers read from a generator
    mode = property(lambda self: self.config.mode)
    tree = property(lambda self: self.config.tree)
    sampled_tree = property(lambda self: self.config.sampled_tree)  # unbatched calls' at temperature > 0
    max_batch = property(lambda self: self.config.max_batch)

    @property
    def last_stats(self) -> _Stats | None:
        """Statistics of this thread's last generation."""
        return self._last.result.stats if self._last.result is not None else None

    @property
    def reuses_prefix(self) -> bool:
        """Whether a prompt that starts like the previous one reuses its K/V (`prefix_cache`)."""
        return self._decoder(SamplingParams()).prefix_cache

    def cached_prefix(self, ids: list[int]) -> int:
        """How many of `ids`' first tokens this generator's caches hold (its next prompt that
        starts with them prefills only the rest); 0 where prefix reuse is off. A router's hint:
        read without the lock, it may be a step stale."""
        decs = [self._batch.decoder] if self._batch is not None else self._decoders.values()
        return max(d.cached_prefix(ids) for d in decs)

    @property
    def last_stop_reason(self) -> str | None:
        return self._last.result.stop_reason if self._last.result is not None else None

    @property
    def active(self) -> int:
        """Sequences being decoded now (batched) or 0/1."""
        return self._batch.active if self._batch else self._busy

    @property
    def waiting(self) -> int:
        """Requests waiting to join the batch (0 unbatched: callers wait on the lock)."""
        return self._batch.waiting if self._batch else 0

    @classmethod
    def from_export(
        cls,
        dir,
        backend: str = "onnxruntime",
        device: str = "cpu",
        config: DecoderConfig | None = None,
        opening: OpenOptions | None = None,
        **options,
    ) -> "Generator":
        """Open an export folder (runtime/export_dir.open_export; opening: its OpenOptions) and
        wrap it. options: OpenOptions' fields (draft, verify, engine_dir, providers) and
        DecoderConfig's, as keywords over `opening` and `config`. tree: a spec, "auto" (the tree
        `arborspec tune --export-dir DIR` chose; for unbatched calls at a temperature above 0 the
        one `tune --temperature T` chose, when it ran), or None: "auto" when `tune` ran for this
        draft, else the export's default tree (OpenedExport.tree_default). prefix_cache: reuse the
        K/V of a prompt's start that the previous prompt shared (a chat's earlier turns, a system
        prompt): None where that is exact (the int4 export), True / False."""
        from .export_dir import OPEN_FIELDS, OpenOptions, open_export

        opened_as = {k: options.pop(k) for k in OPEN_FIELDS if k in options}
        opening = with_options(opening or OpenOptions(), opened_as, "Generator.from_export")
        cfg = DecoderConfig.of(config, options, "Generator.from_export")
        ex = open_export(dir, backend, device, opening)
        try:
            draft, tree, sampled_tree = opening.draft, cfg.tree, cfg.sampled_tree
            if tree is None and auto_tree_file(dir, draft).is_file():
                tree = "auto"  # `arborspec tune` chose one for this export and draft
            tree = tree or ex.tree_default or DEFAULT_TREE
            if str(tree).strip().lower() == "auto":
                tree = auto_tree_spec(dir, draft)
                sampled = auto_tree_file(dir, draft, sampled=True)  # `tune --temperature T` wrote it
                sampled_tree = f"static:{sampled}" if sampled.is_file() else None
            limits = [n for n in (ex.limits.get("max_tree_nodes"), cfg.max_tree_nodes) if n is not None]
            cfg = replace(
                cfg,
                mode=cfg.mode or ("tree" if ex.draft is not None else "vanilla"),
                tree=tree,
                sampled_tree=sampled_tree,
                max_tree_nodes=min(limits) if limits else None,
            )
            gen = cls(ex.target, ex.draft, ex.tokenizer, cfg)
            gen._owns.append(ex)
            return gen
        except BaseException:
            ex.close()
            raise

    # ------------------------------------------------------------------ calls
    def _decoder(self, sp: SamplingParams) -> SpeculativeDecoder:
        """The decoder for `sp`'s kind of call (greedy or sampled; one each, whatever the
        temperature or penalties: each holds a KV cache); each call's request carries its own
        SamplingParams."""
        dec = self._decoders.get(sp.greedy)
        if dec is None:
            cfg = self.config
            if cfg.sampled_tree and not sp.greedy:
                cfg = replace(cfg, tree=cfg.sampled_tree)
            dec = SpeculativeDecoder(self.target, self.draft, cfg, sampling=sp)
            if self._decoders:  # share one draft wrapper between sampling configurations
                dec.draft = next(iter(self._decoders.values())).draft
            self._decoders[sp.greedy] = dec
        return dec

    def request(self, prompt, max_new_tokens: int = 64, **options) -> GenerationRequest:
        """The GenerationRequest of generate()'s and stream()'s keyword form (runtime/request.py):
        temperature, top_k, top_p and the PENALTIES keywords make its SamplingParams; seed, stop,
        logprobs, prompt_logprobs, response_format and include_stop_str_in_output are its own
        fields. One InputError line for a keyword that is none of them or a value out of range."""
        fields = {k: options.pop(k) for k in REQUEST_KEYWORDS if k in options}
        warp = {k: options.pop(k) for k in ("temperature", "top_k", "top_p") if k in options}
        sp = sampling_params(**warp, penalties=options)
        return GenerationRequest(prompt, max_new_tokens, sampling=sp, **fields)

    def _request(self, prompt, max_new_tokens: int, options: dict) -> GenerationRequest:
        """A call's request: `prompt` itself when it is one (nothing else given), else `request()`'s."""
        if not isinstance(prompt, GenerationRequest):
            return self.request(prompt, max_new_tokens, **options)
        if options or max_new_tokens != 64:
            raise InputError("a GenerationRequest takes no other arguments: set them in the request")
        return prompt

    def _decoding(self, req: GenerationRequest) -> GenerationRequest:
        """The request as a decoder takes it: token ids, its response_format's grammar in its
        sampling, the ids that end it (its own or the tokenizer's EOS: SamplingParams.end_ids),
        its log-probs checked."""
        sp = req.sampling or SamplingParams()
        check_bias(sp, self.target.info.vocab_size)
        grammar = self.grammar(req.response_format)
        if grammar is not None:
            sp = replace(sp, grammar=grammar)
        eos = self.eos_token_ids if req.eos_token_ids is None else req.eos_token_ids
        return replace(
            req,
            prompt=self._ids(req.prompt),
            sampling=sp,
            eos_token_ids=sp.end_ids(eos),
            logprobs=check_logprobs(req.logprobs),
            prompt_logprobs=check_logprobs(req.prompt_logprobs),
        )

    def grammar(self, response_format):
        """The compiled grammar of an OpenAI `response_format` for this generator's tokenizer
        (runtime/structured.py; cached per schema), None for text; one InputError line for a
        malformed one, a schema that does not compile, no tokenizer or no llguidance."""
        if response_format is None:
            return None
        if self._grammars is None:
            if self.tokenizer is None:
                raise InputError("structured output (response_format) needs a tokenizer: this generator has none")
            from .structured import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.target.info.vocab_size, self.eos_token_ids)
        return self._grammars.grammar(response_format)

    def encode_prompt(self, prompt) -> list[int]:
        """Token ids of a text or id prompt (one InputError line for anything else)."""
        return self._ids(prompt)

    def _ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InputError("this generator has no tokenizer: give prompt token ids")
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise InputError("empty prompt: give at least one token")
            return ids
        if isinstance(prompt, (bytes, dict)) or not hasattr(prompt, "__iter__"):
            raise InputError(f"prompt must be text or a sequence of token ids, not {type(prompt).__name__}")
        return list(prompt)

    def _text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, prompt, max_new_tokens: int = 64, *, chat: bool = False, **options) -> Completion:
        """One completion of a text or token-id prompt, or of a GenerationRequest (runtime/request.py;
        then nothing else: the request says all). chat=True: a text prompt is one user
        message through the model's chat template (what an instruct model expects; without it
        such a model often answers '' at once, and an EmptyCompletionWarning says so).
        options (keywords; `request()` makes them a GenerationRequest): temperature=0, top_k=0,
        top_p=1, seed=0; stop: a string or a list of strings: the text ends before the first of
        them (stop_reason "stop"; `tokens` then end with the one that completed it; the text ends
        with the stop string itself with include_stop_str_in_output=True, vLLM's). logprobs=k
        (0..20): `Completion.logprobs`, each token's log-prob under the target (the verify call's
        row that predicted it, before temperature and top-k/p) and the k most likely tokens there.
        prompt_logprobs=k: `Completion.prompt_logprobs`, the same for each prompt token from the
        prefill's rows (the first token has none: None and []); what scoring a text needs.
        penalties: min_p, repetition_penalty, presence_penalty, frequency_penalty, logit_bias
        ({token id: bias}), min_tokens, stop_token_ids, ignore_eos, as `SamplingParams`
        (runtime/penalties.py: greedy speculation stays the penalised greedy decoding token for
        token, sampling lossless). response_format: OpenAI's ({"type": "json_object"}, or
        "json_schema" with {"json_schema": {"schema": {...}}}; extensions "regex" and "choice"):
        the answer is JSON of that shape (runtime/structured.py; llguidance)."""
        if chat:
            if not isinstance(prompt, str):
                raise InputError("chat=True takes a text prompt (for messages use chat())")
            return self.chat([{"role": "user", "content": prompt}], max_new_tokens, **options)
        req = self._request(prompt, max_new_tokens, options)  # (chat: in the call chat() makes)
        dreq = self._decoding(req)
        stops = self._stops(req.stop)
        out: list[int] = []
        if stops:
            text = "".join(self._text_until_stop(dreq, stops, out))
        else:
            for chunk in self._token_stream(dreq):
                out += chunk
            text = self._text(out)
        if isinstance(req.prompt, str):
            warn_if_empty_answer(self.tokenizer, len(out), self.last_stop_reason, "generate(prompt, chat=True)")
        res = self._last.result
        lps = None if dreq.logprobs is None else list(res.logprobs or [])[: len(out)]
        plps = None if dreq.prompt_logprobs is None else list(res.prompt_logprobs or [])
        return Completion(text, out, len(dreq.prompt), res.stop_reason, res.stats, lps, plps)

    def _stops(self, stop, ids: bool = False) -> list[str]:
        stops = parse_stop(stop)
        if stops and (ids or self.tokenizer is None):
            raise InputError("stop strings need text output (a tokenizer, and ids=False)")
        return stops

    def _text_until_stop(self, req: GenerationRequest, stops: list[str], tokens: list):
        """Text pieces of one generation that ends at the first stop string (left out of the
        text but with the request's include_stop_str_in_output; stop_reason "stop"); `tokens`
        collects the ids read, up to the one that completed it."""
        match = StopStrings(stops, req.include_stop_str_in_output)
        chunks = self._token_stream(req)
        yield from decode_until_stop(chunks, self.tokenizer.stream_decoder(skip_special_tokens=True), match, tokens)
        if match.hit:
            self._last.result.stop_reason = "stop"

    def _token_stream(self, req: GenerationRequest):
        """Token-id chunks of one generation (a decoder's request: `_decoding`), batched or under
        the lock; this thread's `_last.result` is its GenerationResult (live: the log-probs grow
        with it; final when it ends)."""
        self._last.result = None
        if self._batch is not None:
            self._check_open()
            s = self._batch.submit(req)
            try:
                for chunk in s:
                    self._last.result = s.result  # live: the chunk's log-probs are in it (stream(logprobs=k))
                    yield chunk
            finally:
                s.cancel()  # a caller that stops early frees its row
                self._last.result = s.result  # its stats so far (live until the scheduler drops the row)
            return
        with self._lock:
            self._check_open()
            self._busy = 1
            steps = self._decoder(req.sampling).stream(req)
            try:
                for chunk in steps:
                    self._last.result = steps.result  # live, as above
                    yield chunk
            finally:
                steps.close()  # a caller that stops early ends the decoder's sequence here
                self._busy = 0
                self._last.result = steps.result

    def stream(self, prompt, max_new_tokens: int = 64, *, ids: bool = False, **options) -> Iterator:
        """Text chunks as they become final (or lists of token ids with ids=True) of a prompt
        with generate()'s options, or of a GenerationRequest. Stats and stop reason of the last
        stream: `last_stats`, `last_stop_reason`. stop: as in generate (a chunk that might begin
        a stop string is held back until it cannot). logprobs=k: yields (chunk, entries) pairs
        instead, entries as generate's `Completion.logprobs` for the tokens read since the
        previous pair (a token whose text is held back comes with the chunk that releases it; a
        last pair may carry an empty chunk). prompt_logprobs: generate's only."""
        req = self._request(prompt, max_new_tokens, options)
        if req.prompt_logprobs is not None:
            raise InputError("prompt_logprobs are generate()'s (a Completion), not stream()'s")
        dreq = self._decoding(req)
        stops = self._stops(req.stop, ids)
        read: list[int] = []  # the tokens read so far
        pieces = self._text_until_stop(dreq, stops, read) if stops else self._pieces(dreq, ids, read)
        if dreq.logprobs is None:
            yield from pieces
            return
        sent = 0
        for piece in pieces:
            entries, sent = self._last.result.logprobs[sent : len(read)], len(read)
            yield piece, entries
        rest = self._last.result.logprobs[sent : len(read)] if self._last.result is not None else []
        if rest:
            yield ([] if ids else ""), rest

    def _pieces(self, req: GenerationRequest, ids: bool, read: list):
        """stream's chunks without stop strings: text as it becomes final (ids: the token lists);
        `read` collects the ids."""
        sd = self.tokenizer.stream_decoder(skip_special_tokens=True) if (self.tokenizer and not ids) else None
        for chunk in self._token_stream(req):
            read += chunk
            if sd is None:
                yield chunk
            else:
                text = sd.push(chunk)
                if text:
                    yield text
        if sd is not None:
            rest = sd.finish()
            if rest:
                yield rest

    def chat(
        self,
        messages: list[dict],
        max_new_tokens: int = 256,
        *,
        tools: list[dict] | None = None,
        tool_choice=None,
        parallel_tool_calls: bool | None = None,
        **kw,
    ) -> Completion:
        """A completion of a conversation [{"role", "content"}, ...] through the chat template.
        tools: OpenAI's function tools ([{"type": "function", "function": {"name", "description",
        "parameters"}}]); tool_choice "auto" (the default with tools: the model decides), "none",
        "required" or {"type": "function", "function": {"name"}} (the answer is then calls whose
        arguments follow the functions' JSON schemas); the answer's calls come back as
        `Completion.tool_calls` (runtime/chat.py). Assistant messages may carry `tool_calls`,
        and "tool" messages give their results back."""
        from .chat import chat_messages, render_chat, tool_spec

        if self.tokenizer is None:
            raise InputError("chat needs a tokenizer (this generator has none)")
        msgs = chat_messages(messages)
        spec = tool_spec(tools, tool_choice, parallel_tool_calls, self.tokenizer)
        if spec is not None:
            kw["response_format"] = spec.answer_format(kw.get("response_format"))
        out = self.generate(render_chat(self.tokenizer, msgs, spec), max_new_tokens, **kw)
        if spec is not None:
            content, calls = spec.parse(out.text)
            if calls:
                out.text, out.tool_calls = content or "", calls
        return out

    # ------------------------------------------------------------------ lifecycle
    def _check_open(self) -> None:
        if self.closed:
            raise InputError("this Generator is closed")

    def close(self) -> None:
        if self._batch is not None:
            self._batch.close()  # ends every in-flight stream with one error line
        with self._lock:
            for o in self._owns:
                o.close()
            self._owns = []
            self.closed = True

    def __enter__(self) -> "Generator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _LastCall(threading.local):
    """This thread's last generation (Generator.last_stats / last_stop_reason)."""

    result: GenerationResult | None = None


# generate()'s / stream()'s keywords that are GenerationRequest fields (the others make its sampling)
REQUEST_KEYWORDS = ("seed", "stop", "logprobs", "prompt_logprobs", "response_format", "include_stop_str_in_output")

PENALTIES = (
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
)


def sampling_params(
    temperature=0.0, top_k=0, top_p=1.0, penalties: dict | None = None, vocab_size: int | None = None
) -> SamplingParams:
    """A call's SamplingParams from its keyword arguments (one InputError line for a keyword
    that is none of them, a value out of range, or a biased token outside `vocab_size`)."""
    penalties = penalties or {}
    unknown = sorted(set(penalties) - set(PENALTIES))
    if unknown:
        raise InputError(f"unexpected keyword argument {unknown[0]!r} (sampling takes {', '.join(PENALTIES)})")
    sp = SamplingParams(temperature, top_k, top_p, **{k: v for k, v in penalties.items() if v is not None})
    if vocab_size is not None:
        check_bias(sp, vocab_size)
    return sp


def warn_if_empty_answer(tokenizer, n_tokens: int, stop_reason: str | None, fix: str) -> None:
    """EmptyCompletionWarning when a text prompt got EOS as its first token (n_tokens: those
    generated, the EOS included) from a model with a chat template (an instruct model asked
    without it); `fix`: how the caller adds the template."""
    if n_tokens <= 1 and stop_reason == "eos" and getattr(tokenizer, "chat_template", None):
        warnings.warn(
            "the model answered with end-of-sequence at once: an instruct/chat model expects its chat "
            f"template: use {fix}",
            EmptyCompletionWarning,
            stacklevel=3,
        )


def auto_tree_file(export_dir, draft: str | None = None, sampled: bool = False) -> Path:
    """Where `arborspec tune --export-dir DIR [--draft SPEC]` writes its tree: DIR/tree_auto.json
    for the export's own draft, DIR/tree_auto.SPEC.json for another (`lookup`, `export+lookup`:
    each draft gets the tree tuned for it); `tree_auto[.SPEC].sampled.json` for the tree tuned
    for sampled decoding (`tune --temperature T`)."""
    d = (draft or "export").strip().lower()
    if "suffix" in d:  # the suffix draft proposes its own nodes: BASE+suffix runs BASE's tree (suffix alone: any)
        d = d.split("+")[0] if "+" in d else "export"
    tail = ".sampled.json" if sampled else ".json"
    if d in ("export", "eagle3"):
        return Path(export_dir) / (AUTO_TREE_FILE[: -len(".json")] + tail)
    return Path(export_dir) / f"tree_auto.{re.sub(r'[^a-z0-9_.-]+', '_', d)}{tail}"


def auto_tree_spec(export_dir, draft: str | None = None) -> str:
    """`static:PATH` of the tree `arborspec tune` chose for this export and draft, or one line
    saying how to make it."""
    path = auto_tree_file(export_dir, draft)
    if not path.is_file():
        how = f"arborspec tune --export-dir {export_dir}" + (f" --draft {draft}" if path.name != AUTO_TREE_FILE else "")
        raise MissingFileError(f"tree auto: no tuned tree {path.name} in {export_dir} (run `{how}` first)")
    return f"static:{path}"
