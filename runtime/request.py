"""What a caller asks of one generation, and what a step and a generation give back.

Role in one decode step: none of its own. A `GenerationRequest` carries what the caller asks
(prompt, token budget, the ids that end the answer, seed, sampling with its penalties and grammar,
log-probs, stop strings) from `Generator` (runtime/generator.py) to either decoder
(runtime/decode.py, runtime/batch_decode.py) and the batch scheduler; step 4 (`step.settle`)
returns a `StepResult` that both decoders commit the same way; a generation ends as a
`GenerationResult`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .sampling import SamplingParams
from .stats import GenerationStats


@dataclass(frozen=True)
class GenerationRequest:
    """One generation's request. The decoders read the first seven fields (`prompt` as token ids);
    `Generator` also takes a text prompt and the text-level ones (stop strings, response_format).
    The decoders' short form `decoder.generate(prompt_ids, max_new_tokens, eos_token_ids, seed)`
    is this dataclass's positional order (`as_request`)."""

    prompt: str | Sequence[int]  # token ids (a Generator with a tokenizer takes text too)
    max_new_tokens: int = 64
    # the ids that end the answer: None: a Generator's tokenizer's EOS (its sampling's
    # end_ids), none for a decoder
    eos_token_ids: Sequence[int] | None = None
    seed: int = 0  # the request's random generator (sampled draws, accept coins)
    logprobs: int | None = None  # k: each new token's log-prob and the k most likely there
    prompt_logprobs: int | None = None  # k: the same for the prompt's tokens (from the prefill)
    # temperature, top-k/p, min-p, penalties, logit bias, min_tokens, stop_token_ids, ignore_eos,
    # grammar (runtime/sampling.py); None: greedy (a SpeculativeDecoder: its own `sampling`)
    sampling: SamplingParams | None = None
    # Generator only: the text ends before the first stop string (kept with include_stop_str_in_output)
    stop: str | Sequence[str] | None = None
    include_stop_str_in_output: bool = False
    response_format: dict | None = None  # OpenAI's: the answer's grammar (runtime/structured.py)


def as_request(request, *args, **kw) -> GenerationRequest:
    """`request` itself when it is a GenerationRequest (nothing else given), else
    GenerationRequest(request, *args, **kw): the decoders' short form."""
    if isinstance(request, GenerationRequest):
        if args or kw:
            raise TypeError("a GenerationRequest takes no further arguments")
        return request
    return GenerationRequest(request, *args, **kw)


@dataclass
class StepResult:
    """Step 4's outcome for one sequence (`step.settle`), committed by step 5."""

    tokens: list[int]  # the tokens this step commits (the last is the next root); [] once done
    path: torch.Tensor  # the accepted path: node indices, root excluded, the last token left out
    stop_reason: str | None = None  # "eos" / "length" when the step ends the answer, else None
    logprobs: list = field(default_factory=list)  # with logprobs=k: step.token_logprobs' entries

    @property
    def keep(self) -> list[int]:
        """The verify rows that predicted the new tokens (the root's and the accepted nodes')."""
        return [0] + [i + 1 for i in self.path.tolist()]


@dataclass
class GenerationResult:
    """A generation's outcome (a decoder's `generate`, a stream's `result`)."""

    tokens: list[int]
    stats: GenerationStats
    stop_reason: str = "length"  # "eos", "length", "context" (or "cancelled", "error" in a batch)
    logprobs: list | None = None  # with logprobs=k: per token (id, log-prob, [(id, log-prob)] * k)
    prompt_logprobs: list | None = None  # with prompt_logprobs=k: the prompt's (the first: None, [])
