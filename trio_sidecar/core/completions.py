"""The typed request API's values: :class:`SamplingParams` in, :class:`Delta` and :class:`Completion` out
(docs/embedded.md). PURE: no I/O, no Trio.

Theory of operation
-------------------
The typed API is a face of the Dynamo-shaped one, not a second path: :meth:`SamplingParams.request` builds
the ``PreprocessedRequest`` the conversion (``convert.request.build_generate_request``) maps, and a
:class:`CompletionBuilder` turns the request's ``LLMEngineOutput`` chunks into deltas and one completion.
``SamplingParams`` is validated at construction by running that same conversion on a one-token prompt, so a
rejected value raises the conversion's ``InvalidArgument`` with the conversion's text, before anything is
sent, and never a second copy of its rules.

Names and defaults are vLLM's (``vllm.SamplingParams``, ``vllm.RequestOutput``/``CompletionOutput``), so a
vLLM user finds what they know: ``max_tokens=16``, ``temperature=1.0``, ``top_k=0`` (all tokens), finish
reasons ``"stop"``, ``"length"`` and ``"abort"``, logprobs as one ``{token_id: Logprob}`` dict per token.
"""

from __future__ import annotations

import json as _json
from collections.abc import Sequence
from typing import Any

import attrs

from .config import DisaggregationMode
from .convert.request import build_generate_request
from .errors import InvalidArgument
from .protocol import LLMEngineOutput, PreprocessedRequest, structure_request

__all__ = [
    "FINISH_REASONS",
    "Completion",
    "CompletionBuilder",
    "Delta",
    "Logprob",
    "SamplingParams",
    "StructuredOutputs",
    "Usage",
    "prompt_token_ids",
]

#: Dynamo's chunk finish reasons → vLLM's ``CompletionOutput.finish_reason``.
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort"}


def _strings(value: str | Sequence[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


def _ints(value: Sequence[int] | None) -> tuple[int, ...]:
    return () if value is None else tuple(value)


def _choices(value: Sequence[str] | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(value)


@attrs.frozen(kw_only=True)
class StructuredOutputs:
    """Constrained decoding, one constraint per request: vLLM's ``StructuredOutputsParams`` (the constraints
    vLLM's gRPC request carries).

    ``json`` is a JSON schema (a ``dict``, or its text); ``regex`` a regular expression; ``choice`` the
    allowed outputs; ``grammar`` an EBNF grammar; ``structural_tag`` vLLM's structural-tag JSON text.
    Setting more than one is refused when the ``SamplingParams`` holding it is built (the conversion's
    ``only one structured output constraint may be set``).
    """

    json: str | dict[str, Any] | None = attrs.field(default=None, hash=False)
    regex: str | None = None
    choice: tuple[str, ...] | None = attrs.field(default=None, converter=_choices)
    grammar: str | None = None
    structural_tag: str | None = None

    def guided_decoding(self) -> dict[str, Any]:
        """The Dynamo ``sampling_options.guided_decoding`` object.

        Raises:
            InvalidArgument: ``json`` is text that is not JSON.
        """
        schema: Any = self.json
        if isinstance(schema, str):
            try:
                schema = _json.loads(schema)
            except ValueError as exc:
                raise InvalidArgument(f"structured_outputs.json must be a JSON schema: {exc}") from None
        fields = {
            "json": schema,
            "regex": self.regex,
            "choice": None if self.choice is None else list(self.choice),
            "grammar": self.grammar,
            "structural_tag": self.structural_tag,
        }
        return {key: value for key, value in fields.items() if value is not None}


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to sample one completion: vLLM's ``SamplingParams`` names and defaults (the subset vLLM's gRPC
    ``GenerateRequest`` carries).

    ``stop`` takes a string or a list of strings, ``stop_token_ids`` a list (both kept as tuples).
    ``structured_outputs`` constrains the output (:class:`StructuredOutputs`).
    ``max_tokens=None`` means as many as the context allows. ``n`` and ``best_of`` exist for vLLM's
    signature; anything but one sequence is refused, as the conversion refuses it.

    Raises:
        InvalidArgument: a value the conversion rejects, with its text (``top_k must be -1, 0, or positive;
            got -2``, ``temperature must be in [0, 2], got 3``, ``n must be 1``, ...), or a value of the
            wrong type (``invalid PreprocessedRequest: ...``).
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = attrs.field(default=(), converter=_strings)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None

    def __attrs_post_init__(self) -> None:
        # The conversion is the one home of the rules; a one-token prompt stands in for the real one.
        build_generate_request(self.request([0]), "", "", DisaggregationMode.AGG)

    def request(self, token_ids: Sequence[int]) -> PreprocessedRequest:
        """The Dynamo-shaped request for ``token_ids`` (``[]`` with a text prompt) with these parameters.

        Raises:
            InvalidArgument: ``invalid PreprocessedRequest: ...`` (a value of the wrong type).
        """
        return structure_request(
            {
                "token_ids": list(token_ids),
                "stop_conditions": {
                    "max_tokens": self.max_tokens,
                    "min_tokens": self.min_tokens,
                    "stop": list(self.stop) or None,
                    "stop_token_ids": list(self.stop_token_ids) or None,
                    "ignore_eos": self.ignore_eos,
                },
                "sampling_options": {
                    "n": self.n,
                    "best_of": self.best_of,
                    "presence_penalty": self.presence_penalty,
                    "frequency_penalty": self.frequency_penalty,
                    "repetition_penalty": self.repetition_penalty,
                    "temperature": self.temperature,
                    "top_p": self.top_p,
                    "top_k": self.top_k,
                    "min_p": self.min_p,
                    "seed": self.seed,
                    "include_stop_str_in_output": self.include_stop_str_in_output,
                    "guided_decoding": None
                    if self.structured_outputs is None
                    else self.structured_outputs.guided_decoding(),
                },
                "output_options": {
                    "logprobs": self.logprobs,
                    "prompt_logprobs": self.prompt_logprobs,
                    "skip_special_tokens": self.skip_special_tokens,
                },
            }
        )


def prompt_token_ids(prompt: Sequence[int]) -> list[int]:
    """A token-id prompt as a list, checked the way the conversion checks ids.

    Raises:
        InvalidArgument: an id that is not a non-negative 32-bit integer (``invalid PreprocessedRequest:
            ...``), no ids (``token_ids must not be empty``), or ``bytes``.
    """
    if isinstance(prompt, bytes | bytearray):  # (a Sequence[int] too: its byte values are not token ids)
        raise InvalidArgument("a prompt is a str or token ids, not bytes")
    return list(structure_request({"token_ids": list(prompt)}).token_ids) or _empty()


def _empty() -> list[int]:
    raise InvalidArgument("token_ids must not be empty")


@attrs.frozen
class Logprob:
    """One token's log probability and its rank among the candidates (vLLM's ``Logprob``; ``rank`` is
    ``None`` where vLLM did not report it: the sampled token with ``logprobs=0``)."""

    logprob: float
    rank: int | None = None


@attrs.frozen
class Usage:
    """Token counts, as OpenAI's ``usage``."""

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen
class Delta:
    """What one streamed step added: ``text`` (vLLM's detokenized text, ``""`` while it holds back a partial
    UTF-8 sequence), ``token_ids`` and, with ``logprobs`` asked, one ``{token_id: Logprob}`` per token."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[dict[int, Logprob], ...] | None = None


@attrs.frozen
class Completion:
    """A finished request (vLLM's ``RequestOutput`` with its one ``CompletionOutput`` flattened).

    Attributes:
        request_id: the id vLLM knew the request by.
        text: the whole output text, exactly vLLM's detokenization (the deltas' texts joined).
        token_ids: the output token ids.
        finish_reason: ``"stop"`` (EOS, a stop token or string), ``"length"`` or ``"abort"`` (stopped).
        stop_reason: the stop token id or stop string that ended it (vLLM's ``stop_reason``), else ``None``.
        usage: prompt and completion token counts.
        prompt_token_ids: the prompt as token ids when the sidecar knows them (``None`` for a text prompt
            vLLM tokenized).
        logprobs: with ``SamplingParams.logprobs``, one ``{token_id: Logprob}`` per output token: the
            sampled token and its candidates.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, one dict per prompt token (``None`` first).
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    stop_reason: int | str | None
    usage: Usage
    prompt_token_ids: tuple[int, ...] | None = None
    logprobs: tuple[dict[int, Logprob], ...] | None = None
    prompt_logprobs: tuple[dict[int, Logprob] | None, ...] | None = None


def _logprobs(chunk: LLMEngineOutput) -> tuple[dict[int, Logprob], ...] | None:
    if chunk.log_probs is None:
        return None
    positions = chunk.top_logprobs
    out = []
    for i, (token_id, logprob) in enumerate(zip(chunk.token_ids, chunk.log_probs, strict=True)):
        entry = {token_id: Logprob(logprob)}
        if positions is not None:
            for candidate in positions[i]:
                entry[candidate.token_id] = Logprob(candidate.logprob, candidate.rank)
        out.append(entry)
    return tuple(out)


def _prompt_logprobs(engine_data: dict[str, Any] | None) -> tuple[dict[int, Logprob] | None, ...] | None:
    if not engine_data or "prompt_logprobs" not in engine_data:
        return None
    return tuple(
        None if position is None else {int(k): Logprob(v["logprob"], v["rank"]) for k, v in position.items()}
        for position in engine_data["prompt_logprobs"]
    )


class CompletionBuilder:
    """Turns one request's chunks into :class:`Delta` values and, at the terminal (or cancelled) chunk, the
    :class:`Completion`. Feed every chunk in order to :meth:`add`."""

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int] | None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = None if prompt_token_ids is None else tuple(prompt_token_ids)
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = None
        self.completion: Completion | None = None

    def add(self, chunk: LLMEngineOutput) -> Delta | None:
        """Record ``chunk``; returns its delta (``None`` for a chunk that adds no token and no text)."""
        text = chunk.text or ""
        logprobs = _logprobs(chunk)
        if logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(logprobs)
        self.texts.append(text)
        self.token_ids.extend(chunk.token_ids)
        if chunk.finish_reason is not None:
            usage = chunk.completion_usage
            self.completion = Completion(
                request_id=self.request_id,
                text="".join(self.texts),
                token_ids=tuple(self.token_ids),
                finish_reason=FINISH_REASONS.get(chunk.finish_reason, chunk.finish_reason),
                stop_reason=chunk.stop_reason,
                usage=Usage(usage.prompt_tokens, usage.completion_tokens)
                if usage is not None
                else Usage(0, len(self.token_ids)),
                prompt_token_ids=self.prompt_token_ids,
                logprobs=None if self.logprobs is None else tuple(self.logprobs),
                prompt_logprobs=_prompt_logprobs(chunk.engine_data),
            )
        if not chunk.token_ids and not text:
            return None
        return Delta(text=text, token_ids=tuple(chunk.token_ids), logprobs=logprobs)
