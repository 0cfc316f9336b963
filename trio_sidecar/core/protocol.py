"""Dynamo's request and output shapes as attrs models (docs/reference/sidecar.md#input, docs/reference/sidecar.md#output-chunks). PURE: no I/O, no Trio.

``PreprocessedRequest`` is structured from the request dict with a strict cattrs converter: unknown keys
are ignored (the 1.6.1 dict carries many fields the sidecar does not read), ``null`` equals absent, and a
value of the wrong type is an ``InvalidArgument`` ``invalid PreprocessedRequest: {detail}`` instead of
being coerced (cattrs' default would turn ``"3"`` or ``3.7`` into ``3``).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, Union

import attrs
import cattrs
from cattrs.errors import ClassValidationError, IterableValidationError

from .errors import InvalidArgument
from .jsonstruct import int_text

__all__ = [
    "EMBEDDINGS_UNSUPPORTED",
    "StopConditions",
    "GuidedDecoding",
    "SamplingOptions",
    "OutputOptions",
    "RoutingHints",
    "PrefillResult",
    "PreprocessedRequest",
    "structure_request",
    "TopLogprob",
    "CompletionUsage",
    "LLMEngineOutput",
    "cancelled_chunk",
    "token_chunk",
    "token_chunk_dict",
    "converter",
    "U32",
    "I32",
    "I64",
]


# Marker integer types for the converter's range checks (the Rust side deserializes into u32/i32/i64).
class U32(int):
    """Structured as an ``int`` in ``0..=u32::MAX``."""


class I32(int):
    """Structured as an ``int`` in ``i32`` range."""


class I64(int):
    """Structured as an ``int`` in ``i64`` range."""


@attrs.define(kw_only=True)
class StopConditions:
    max_tokens: U32 | None = None
    min_tokens: U32 | None = None
    stop: list[str] | None = None
    stop_token_ids: list[U32] | None = None
    stop_token_ids_hidden: list[U32] | None = None
    stop_token_ids_visible: list[U32] | None = None
    ignore_eos: bool | None = None
    max_thinking_tokens: Any = None


@attrs.define(kw_only=True)
class GuidedDecoding:
    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: Any = None
    backend: str | None = None
    whitespace_pattern: str | None = None


@attrs.define(kw_only=True)
class SamplingOptions:
    n: U32 | None = None
    best_of: U32 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: I32 | None = None
    min_p: float | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    seed: I64 | None = None
    include_stop_str_in_output: bool | None = None
    guided_decoding: GuidedDecoding | None = None


@attrs.define(kw_only=True)
class OutputOptions:
    logprobs: U32 | None = None
    prompt_logprobs: U32 | None = None
    skip_special_tokens: bool | None = None


@attrs.define(kw_only=True)
class RoutingHints:
    priority: I32 | None = None
    cache_namespace: str | None = None
    cache_salt: str | None = None
    lora_name: str | None = None
    dp_rank: U32 | None = None
    prefill_dp_rank: U32 | None = None


@attrs.define(kw_only=True)
class PrefillResult:
    disaggregated_params: Any = None
    prompt_tokens_details: Any = None


@attrs.define(kw_only=True)
class PreprocessedRequest:
    """The fields of Dynamo's ``PreprocessedRequest`` the sidecar reads (docs/reference/sidecar.md#input); opaque ones stay JSON."""

    token_ids: list[U32] = attrs.field(factory=list)
    prompt_embeds: Any = None
    multi_modal_data: Any = None
    multi_modal_uuids: Any = None
    mm_routing_info: Any = None
    mm_processor_kwargs: Any = None
    encoder_result: Any = None
    bootstrap_info: Any = None
    extra_args: Any = None
    prefill_result: PrefillResult | None = None
    stop_conditions: StopConditions = attrs.field(factory=StopConditions)
    sampling_options: SamplingOptions = attrs.field(factory=SamplingOptions)
    output_options: OutputOptions = attrs.field(factory=OutputOptions)
    routing: RoutingHints = attrs.field(factory=RoutingHints)


converter = cattrs.Converter(forbid_extra_keys=False, detailed_validation=True)


def _int_hook(lo: int, hi: int, name: str) -> Callable[[Any, Any], int]:
    def hook(value: Any, _type: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"expected an integer ({name}), got {type(value).__name__}")
        if not lo <= value <= hi:
            raise ValueError(f"{int_text(value)} is outside the {name} range")
        return int(value)

    return hook


converter.register_structure_hook(U32, _int_hook(0, 2**32 - 1, "u32"))
converter.register_structure_hook(I32, _int_hook(-(2**31), 2**31 - 1, "i32"))
converter.register_structure_hook(I64, _int_hook(-(2**63), 2**63 - 1, "i64"))


def _float_hook(value: Any, _type: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:  # an int beyond the f64 range (JSON allows any length of digits)
        raise ValueError("integer too large to convert to a float") from None


def _bool_hook(value: Any, _type: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected a boolean, got {type(value).__name__}")
    return value


def _str_hook(value: Any, _type: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _int_strict(value: Any, _type: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {type(value).__name__}")
    return value


converter.register_structure_hook(float, _float_hook)
converter.register_structure_hook(bool, _bool_hook)
converter.register_structure_hook(str, _str_hook)
converter.register_structure_hook(int, _int_strict)


def _list_guard(value: Any) -> None:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"expected an array, got {type(value).__name__}")


# cattrs happily iterates a string or a dict into a list; the JSON shapes here are strict.
def _strict_list(elem: type) -> Any:
    def hook(value: Any, _type: Any) -> list[Any]:
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"expected an array, got {type(value).__name__}")
        result: list[Any] = []
        for i, item in enumerate(value):
            try:
                result.append(converter.structure(item, elem))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{exc} at index {i}") from None
        return result

    return hook


def _is_list_of(elem: type) -> Callable[[Any], bool]:
    alias = types.GenericAlias(list, (elem,))  # list[elem], with elem a value
    return lambda t: bool(t == alias)


for _elem in (U32, str):
    converter.register_structure_hook_func(_is_list_of(_elem), _strict_list(_elem))


def _options_hook(cls: type) -> None:
    """Options objects must be JSON objects; ``null`` equals absent (the empty options object)."""
    inner: Callable[[Any, Any], Any] = cattrs.gen.make_dict_structure_fn(
        cls, converter, _cattrs_forbid_extra_keys=False
    )

    def hook(value: Any, _type: Any) -> Any:
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"expected an object, got {type(value).__name__}")
        return inner(value, _type)

    converter.register_structure_hook(cls, hook)


for _cls in (StopConditions, GuidedDecoding, SamplingOptions, OutputOptions, RoutingHints, PrefillResult):
    _options_hook(_cls)

_request_inner = cattrs.gen.make_dict_structure_fn(PreprocessedRequest, converter, _cattrs_forbid_extra_keys=False)


def _format_leaf(exc: BaseException, _type: Any) -> str:
    if isinstance(exc, KeyError):
        return f"required field missing ({exc})"
    return str(exc) or type(exc).__name__


def _detail(exc: BaseException) -> str:
    if isinstance(exc, (ClassValidationError, IterableValidationError)):
        return "; ".join(cattrs.transform_error(exc, path="$", format_exception=_format_leaf))
    return str(exc) or type(exc).__name__


def structure_request(obj: dict[str, Any] | PreprocessedRequest) -> PreprocessedRequest:
    """Structure a Dynamo request dict (or re-validate an attrs request).

    Raises:
        InvalidArgument: ``invalid PreprocessedRequest: {detail}`` (never an ``ExceptionGroup``).
    """
    if isinstance(obj, PreprocessedRequest):
        # Embedded callers build the attrs object directly: re-check it with the same strict rules, so a
        # wrong-typed attribute is an InvalidArgument here rather than a TypeError deep in the mapping.
        obj = attrs.asdict(obj, recurse=True)
    if not isinstance(obj, dict):
        raise InvalidArgument(f"invalid PreprocessedRequest: expected an object, got {type(obj).__name__}")
    if _is_embedding_request(obj):
        raise InvalidArgument(EMBEDDINGS_UNSUPPORTED)
    # null equals absent: drop top-level nulls so attribute defaults apply.
    data = {k: v for k, v in obj.items() if v is not None}
    try:
        return _request_inner(data, PreprocessedRequest)
    except Exception as exc:  # cattrs raises ExceptionGroup subclasses; translate once, here.
        raise InvalidArgument(f"invalid PreprocessedRequest: {_detail(exc)}") from None


EMBEDDINGS_UNSUPPORTED = "embeddings are not supported by vLLM gRPC (its Inference service only generates)"


def _is_embedding_request(obj: dict[str, Any]) -> bool:
    """Dynamo's ``PreprocessedEmbeddingRequest`` (``--endpoint-types embeddings``): one token list per input."""
    token_ids = obj.get("token_ids")
    return isinstance(token_ids, list) and bool(token_ids) and all(isinstance(t, list) for t in token_ids)


# ---------------------------------------------------------------------------------------------- outputs


@attrs.define(kw_only=True)
class TopLogprob:
    rank: int
    token_id: int
    logprob: float
    token: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "token_id": self.token_id, "token": self.token, "logprob": self.logprob}


@attrs.define(kw_only=True)
class CompletionUsage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> CompletionUsage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )

    def to_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }


@attrs.define(kw_only=True)
class LLMEngineOutput:
    """One output chunk (docs/reference/sidecar.md#output-chunks). ``to_dict()`` gives the Dynamo dict with ``None`` keys omitted.

    ``text`` is a string on every chunk except prefill's (``""`` when vLLM sent no text for the message):
    Dynamo's frontend detokenizes a chunk without ``text`` itself, which corrupts partial UTF-8 sequences.
    """

    token_ids: list[int] = attrs.field(factory=list)
    index: int = 0
    text: str | None = None
    log_probs: list[float] | None = None
    top_logprobs: list[list[TopLogprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    completion_usage: CompletionUsage | None = None
    disaggregated_params: dict[str, Any] | None = None
    engine_data: dict[str, Any] | None = None
    #: An encode worker's terminal: the encoder handoff the next worker forwards to vLLM.
    encoder_result: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The Dynamo chunk dict (``None`` fields omitted); a plain token chunk's is
        :func:`token_chunk_dict`'s."""
        out: dict[str, Any] = {"token_ids": list(self.token_ids), "index": self.index}
        if self.text is not None:
            out["text"] = self.text
        if self.log_probs is not None:
            out["log_probs"] = list(self.log_probs)
        if self.top_logprobs is not None:
            out["top_logprobs"] = [[entry.to_dict() for entry in position] for position in self.top_logprobs]
        if self.finish_reason is not None:
            out["finish_reason"] = self.finish_reason
        if self.stop_reason is not None:
            out["stop_reason"] = self.stop_reason
        if self.completion_usage is not None:
            out["completion_usage"] = self.completion_usage.to_dict()
        if self.disaggregated_params is not None:
            out["disaggregated_params"] = self.disaggregated_params
        if self.engine_data is not None:
            out["engine_data"] = self.engine_data
        if self.encoder_result is not None:
            out["encoder_result"] = self.encoder_result
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LLMEngineOutput:
        """Structure a chunk dict (the inverse of :meth:`to_dict`)."""
        return _output_converter.structure(data, cls)


_output_converter = cattrs.Converter()
_output_converter.register_structure_hook(Union[int, str, None], lambda v, _t: v)  # noqa: UP007 - the typing object cattrs dispatches on

_new_object = object.__new__


def token_chunk(token_ids: list[int], text: str) -> LLMEngineOutput:
    """``LLMEngineOutput(token_ids=token_ids, text=text)``, the streaming hot path (one per token).

    Built field by field: calling the class with keywords costs twice as much. Every field is set here
    (``tests/unit/test_batch.py`` compares the two, field by field).
    """
    chunk = _new_object(LLMEngineOutput)
    chunk.token_ids = token_ids
    chunk.index = 0
    chunk.text = text
    chunk.log_probs = None
    chunk.top_logprobs = None
    chunk.finish_reason = None
    chunk.stop_reason = None
    chunk.completion_usage = None
    chunk.disaggregated_params = None
    chunk.engine_data = None
    chunk.encoder_result = None
    return chunk


def token_chunk_dict(token_ids: list[int], text: str) -> dict[str, Any]:
    """``token_chunk(token_ids, text).to_dict()`` without building the chunk (the Dynamo bridge's hot path,
    for ``ChunkSink.tokens``): ``text`` is always present, ``""`` included (see :class:`LLMEngineOutput`);
    ``token_ids`` is taken as it is, not copied. ``tests/unit/test_batch.py`` checks the two agree."""
    return {"token_ids": token_ids, "index": 0, "text": text}


def cancelled_chunk(prompt_tokens: int, completion_tokens: int) -> LLMEngineOutput:
    """The cancelled chunk (docs/reference/sidecar.md#output-chunks): no tokens, ``finish_reason "cancelled"``, usage."""
    return LLMEngineOutput(
        token_ids=[],
        finish_reason="cancelled",
        completion_usage=CompletionUsage.of(prompt_tokens, completion_tokens),
    )
