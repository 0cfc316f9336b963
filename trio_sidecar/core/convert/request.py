"""``PreprocessedRequest`` → ``GenerateRequest`` (docs/reference/sidecar.md#request-conversion, docs/reference/sidecar.md#json-and-protobuf-struct, docs/reference/sidecar.md#data-parallel-rank, docs/reference/sidecar.md#multimodal-requests). PURE: no I/O, no Trio.

Validation runs first, in the order (docs/reference/sidecar.md#validation-order), so the error a caller sees is the one upstream reports; only
a request that passed every check is mapped. Nothing here touches the network: a rejected request never
reaches vLLM.
"""

from __future__ import annotations

import json
import math
import uuid as uuid_module
from typing import Any, TypeGuard

import attrs

from ..._proto.vllm import inference_pb2
from ..config import DisaggregationMode
from ..errors import InvalidArgument
from ..jsonstruct import json_to_struct
from ..multimodal import HANDOFF_KEY, MEDIA_EXTRA_ARGS_KEYS, build_media_items, check_encode_request, has_media
from ..protocol import PreprocessedRequest, RoutingHints
from ..routing import dp_rank_metadata, select_dp_rank
from ..sampling_checks import sampling_error

__all__ = ["BuiltRequest", "build_generate_request", "CACHE_SALT_PREFIX", "F32_EPSILON", "I32_MAX"]

# Dynamo's router constant: salts must agree with the router's block hashes.
CACHE_SALT_PREFIX = "dynamo-cache-salt:"
F32_EPSILON = 1.1920929e-07
I32_MAX = 2147483647

_BASE_EXTRA_ARGS = ("bypass_prefix_cache", "skip_reading_prefix_cache", "kv_transfer_params", "nvext")
_BYPASS_KEYS = ("bypass_prefix_cache", "skip_reading_prefix_cache")
_GUIDED_KEYS = ("json", "regex", "choice", "grammar", "structural_tag")


@attrs.frozen
class BuiltRequest:
    """A validated, mapped request.

    ``prompt_tokens`` counts the ids sent (multimodal decode: the expanded ids); ``has_media`` means media
    items are sent; ``metadata`` carries ``x-data-parallel-rank`` when a rank is selected.
    """

    message: inference_pb2.GenerateRequest = attrs.field(eq=False)
    metadata: tuple[tuple[str, str], ...]
    prompt_tokens: int
    has_media: bool
    dp_rank: int | None


@attrs.frozen
class _Extras:
    bypass_prefix_cache: bool
    kv_transfer_params: Any  # None when absent
    mm_hashes: Any


def build_generate_request(
    request: PreprocessedRequest,
    request_id: str,
    served_model_name: str,
    mode: DisaggregationMode,
    *,
    lora_supported: bool = False,
    text: str | None = None,
) -> BuiltRequest:
    """Validate (in the order of docs/reference/sidecar.md#validation-order) and map (docs/reference/sidecar.md#field-mapping) a request.

    Args:
        request: a structured request (see ``protocol.structure_request``).
        request_id: the context's id; empty → a fresh UUID4 string.
        served_model_name: the discovered name; always sent as ``model``.
        mode: the sidecar's disaggregation mode.
        lora_supported: the server advertises LoRA (``max_loras`` > 0): a ``routing.lora_name`` is then
            forwarded as ``lora_name`` (an adapter vLLM does not hold is vLLM's error, docs/lora.md).
        text: a text prompt, sent as ``GenerateRequest.text`` instead of ``request.token_ids`` (which may then
            be empty) for vLLM to tokenize (a server advertising ``supports_text_input``; docs/embedded.md).
            ``prompt_tokens`` is then 0 until vLLM's ``prompt_info`` reports the count.

    Returns:
        The ``GenerateRequest`` plus per-call metadata and bookkeeping for ``ResponseState``.

    Raises:
        InvalidArgument: with the exact texts of docs/reference/sidecar.md#request-conversion.
    """
    mode = DisaggregationMode.parse(mode)
    stop = request.stop_conditions
    sampling = request.sampling_options
    output = request.output_options
    routing = request.routing

    # docs/reference/sidecar.md#validation-order rows 1-14.
    if not request.token_ids and text is None:
        raise InvalidArgument("token_ids must not be empty")
    if request.prompt_embeds is not None:
        raise InvalidArgument("prompt embeddings are not supported by vLLM gRPC")
    if request.mm_processor_kwargs is not None:
        raise InvalidArgument("mm_processor_kwargs are not supported by vLLM gRPC")
    if mode is DisaggregationMode.ENCODE:
        check_encode_request(request.multi_modal_data, request.encoder_result)
    if routing.lora_name and not lora_supported:
        raise InvalidArgument("LoRA request selection is not supported by vLLM gRPC")
    if request.bootstrap_info is not None:
        raise InvalidArgument("Dynamo bootstrap handoff is not supported by the vLLM sidecar")
    if stop.stop_token_ids_visible:
        raise InvalidArgument("visible stop token IDs are not supported by vLLM gRPC")
    if stop.max_thinking_tokens is not None:
        raise InvalidArgument("max_thinking_tokens is not supported by vLLM gRPC")
    if (1 if sampling.n is None else sampling.n) != 1:
        raise InvalidArgument("n must be 1")
    if (1 if sampling.best_of is None else sampling.best_of) != 1:
        raise InvalidArgument("best_of must be 1")
    if sampling.use_beam_search:
        raise InvalidArgument("beam search is not supported")
    lp = sampling.length_penalty
    if lp is not None and not abs(lp - 1.0) <= F32_EPSILON:  # NaN is non-default too
        raise InvalidArgument("non-default length_penalty is not supported")
    top_k = sampling.top_k
    if top_k is not None and top_k < -1:
        raise InvalidArgument(f"top_k must be -1, 0, or positive; got {top_k}")
    for count in (output.logprobs, output.prompt_logprobs):
        if count is not None and count > I32_MAX:
            raise InvalidArgument(f"vLLM logprobs request must fit in i32; got {count}")

    # Rows 15-17.
    structured = _structured_output(request)
    media_present = has_media(request.multi_modal_data)
    extras = _extra_args(request, media_present)
    items = build_media_items(request.multi_modal_data, request.multi_modal_uuids, extras.mm_hashes)
    # Every mode sends the original prompt ids with the media: a decode engine rebuilds the expanded prompt
    # and its multimodal positions itself (docs/reference/sidecar.md#multimodal-requests).
    token_ids: list[int] = list(request.token_ids)
    send_media = bool(items)
    one_token = mode in (DisaggregationMode.PREFILL, DisaggregationMode.ENCODE)

    # Row 18.
    kv_params = _kv_transfer_params(request, extras, mode)
    cache_salt = _cache_salt(routing)

    message = inference_pb2.GenerateRequest(
        request_id=request_id or str(uuid_module.uuid4()),
        model=served_model_name,
        token_ids=inference_pb2.TokenIds(ids=token_ids),
        truncate_prompt_tokens=0,
        priority=routing.priority or 0,
        lora_name=routing.lora_name or "",
    )
    if sampling.temperature is not None:
        message.temperature = sampling.temperature

    s = message.sampling
    s.num_sequences = 1
    s.top_k = top_k if top_k is not None and top_k > 0 else 0
    s.top_p = _or_zero(sampling.top_p)
    s.min_p = _or_zero(sampling.min_p)
    if sampling.seed is not None:
        s.seed = sampling.seed

    d = message.decoding
    d.presence_penalty = _or_zero(sampling.presence_penalty)
    d.frequency_penalty = _or_zero(sampling.frequency_penalty)
    d.repetition_penalty = _or_zero(sampling.repetition_penalty)
    if structured is not None:
        field, value = structured
        if field == "choice":
            d.choice.choices.extend(value)
        else:
            setattr(d, field, value)
    message.decoding.SetInParent()

    st = message.stopping
    if one_token:
        st.max_new_tokens = 1
        st.min_new_tokens = 1
    else:
        st.max_new_tokens = stop.max_tokens or 0
        st.min_new_tokens = stop.min_tokens or 0
    st.stop_token_ids.extend(sorted(set(stop.stop_token_ids or ()) | set(stop.stop_token_ids_hidden or ())))
    st.stop_strings.extend(stop.stop or ())
    st.include_stop_strings = bool(sampling.include_stop_str_in_output)
    st.ignore_eos = bool(stop.ignore_eos)
    message.stopping.SetInParent()

    r = message.response
    r.prompt_token_ids = output.prompt_logprobs is not None or (mode is DisaggregationMode.PREFILL and send_media)
    r.prompt_logprobs = output.prompt_logprobs is not None
    if output.prompt_logprobs is not None:
        r.prompt_candidates.top_n = output.prompt_logprobs
    r.output_text = True
    r.output_token_ids = True
    r.output_logprobs = output.logprobs is not None
    if output.logprobs is not None:
        r.output_candidates.top_n = output.logprobs
    if output.skip_special_tokens is not None:
        r.skip_special_tokens = output.skip_special_tokens

    kv = message.kv
    kv.SetInParent()
    kv.bypass_prefix_cache = extras.bypass_prefix_cache
    kv.cache_salt = cache_salt
    if kv_params is not None:
        kv.kv_transfer_params.CopyFrom(kv_params)
    ec_params = _ec_transfer_params(request.encoder_result, mode)
    if ec_params is not None:
        kv.ec_transfer_params.CopyFrom(ec_params)

    if send_media:
        message.media.extend(items)
    if text is not None:
        message.text = text  # (the prompt oneof: replaces token_ids)
        token_ids = []

    # vLLM's float sampling checks, on the f32 values it will see, with its texts (docs/conformance.md).
    if not _vllm_rejects_stopping_first(st):
        problem = sampling_error(message)
        if problem is not None:
            raise InvalidArgument(problem)

    rank = None if mode is DisaggregationMode.ENCODE else select_dp_rank(routing, mode)
    return BuiltRequest(
        message=message,
        metadata=dp_rank_metadata(rank),
        prompt_tokens=len(token_ids),
        has_media=send_media,
        dp_rank=rank,
    )


def _vllm_rejects_stopping_first(stopping: inference_pb2.StoppingCriteria) -> bool:
    """Whether vLLM may reject the stopping criteria (an empty stop string, ``min_tokens`` above
    ``max_tokens``) before it checks the float sampling fields. Such a request is sent as it is, so the
    caller sees the error vLLM reports first, whichever it is."""
    if any(text == "" for text in stopping.stop_strings):
        return True
    return stopping.min_new_tokens > 0 and (
        stopping.max_new_tokens == 0 or stopping.min_new_tokens > stopping.max_new_tokens
    )


def _or_zero(value: float | None) -> float:
    return 0.0 if value is None else value


def _structured_output(request: PreprocessedRequest) -> tuple[str, Any] | None:
    """docs/reference/sidecar.md#guided-decoding: at most one constraint; ``backend``/``whitespace_pattern`` are rejected."""
    guided = request.sampling_options.guided_decoding
    if guided is None:
        return None
    if guided.backend is not None or guided.whitespace_pattern is not None:
        raise InvalidArgument("guided decoding backend and whitespace_pattern are not supported by vLLM gRPC")
    present = [key for key in _GUIDED_KEYS if getattr(guided, key) is not None]
    if len(present) > 1:
        raise InvalidArgument("only one structured output constraint may be set")
    if not present:
        return None
    key = present[0]
    value = getattr(guided, key)
    if key == "json":
        return "json", _compact_json(value, "guided_decoding.json")
    if key == "structural_tag" and not isinstance(value, str):
        return "structural_tag", _compact_json(value, "guided_decoding.structural_tag")
    return key, value


def _compact_json(value: Any, what: str) -> str:
    # serde_json's compact output: no spaces, non-ASCII kept as is.
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{what} must be a JSON value: {exc}") from None


def _extra_args(request: PreprocessedRequest, media_present: bool) -> _Extras:
    """The ``extra_args`` validation (docs/reference/sidecar.md#extra-args); returns the values the mapping needs."""
    extra = request.extra_args
    if extra is None:
        return _Extras(bypass_prefix_cache=False, kv_transfer_params=None, mm_hashes=None)
    if not isinstance(extra, dict):
        raise InvalidArgument("extra_args must be a JSON object")
    allowed = _BASE_EXTRA_ARGS + (MEDIA_EXTRA_ARGS_KEYS if media_present else ())
    for key, value in extra.items():
        if value is not None and key not in allowed:
            raise InvalidArgument(f"extra_args.{key} is not supported by vLLM gRPC")

    bypass = False
    for key in _BYPASS_KEYS:  # the first present key wins, even when it is false
        value = extra.get(key)
        if value is not None:
            if not isinstance(value, bool):
                raise InvalidArgument(f"extra_args.{key} must be a boolean")
            bypass = value
            break

    nvext = extra.get("nvext")
    if nvext is not None:
        if not isinstance(nvext, dict):
            raise InvalidArgument("extra_args.nvext must be a JSON object")
        token_in = nvext.get("token_in")
        if token_in is not None and token_in is not True:
            raise InvalidArgument("extra_args.nvext.token_in must be true when present")
        salt = nvext.get("cache_salt")
        if salt is not None:
            if not isinstance(salt, str) or not salt:
                raise InvalidArgument("extra_args.nvext.cache_salt must be a non-empty string")
            namespace = _cache_namespace(request.routing)
            if namespace is None:
                raise InvalidArgument("extra_args.nvext.cache_salt requires routing.cache_namespace")
            if salt != namespace:
                raise InvalidArgument(
                    f"extra_args.nvext.cache_salt `{salt}` does not match routing.cache_namespace `{namespace}`"
                )
        # Other nvext keys (e.g. extra_fields) belong to the frontend: ignored.

    return _Extras(
        bypass_prefix_cache=bypass,
        kv_transfer_params=extra.get("kv_transfer_params"),
        mm_hashes=extra.get("mm_hashes") if media_present else None,
    )


def _cache_namespace(routing: RoutingHints) -> str | None:
    # docs/reference/sidecar.md#extra-args: either routing name satisfies the checks; cache_namespace wins when both are set.
    if routing.cache_namespace is not None:
        return routing.cache_namespace
    return routing.cache_salt


def _cache_salt(routing: RoutingHints) -> str:
    namespace = _cache_namespace(routing)
    if namespace is None:
        return ""  # mdc_sum is never a salt
    if namespace.startswith(CACHE_SALT_PREFIX):
        return namespace
    return CACHE_SALT_PREFIX + namespace


def _kv_transfer_params(request: PreprocessedRequest, extras: _Extras, mode: DisaggregationMode) -> Any:
    """``kv_transfer_params`` by mode (docs/reference/sidecar.md#kv-transfer-parameters-by-mode), encoded as in docs/reference/sidecar.md#json-and-protobuf-struct (``None`` = field unset)."""
    caller = extras.kv_transfer_params
    if mode is DisaggregationMode.DECODE:
        prefill = request.prefill_result
        params = None if prefill is None else prefill.disaggregated_params
        if params is None:
            raise InvalidArgument("decode request is missing the prefill_result KV payload")
        if not isinstance(params, dict):
            raise InvalidArgument("kv_transfer_params must be a JSON object")
        forwarded = {k: v for k, v in params.items() if k != HANDOFF_KEY}
        port = forwarded.get("remote_port")
        if _is_whole_non_negative(port):
            try:
                forwarded["remote_port"] = str(int(port))
            except ValueError:  # beyond Python's 4300-digit limit: left as a number, which Struct refuses
                pass
        return json_to_struct(forwarded)
    if mode is DisaggregationMode.ENCODE:
        return None
    if mode is DisaggregationMode.PREFILL:
        if caller is None:
            caller = {}
        if not isinstance(caller, dict):
            raise InvalidArgument("extra_args.kv_transfer_params must be a JSON object")
        return json_to_struct({**caller, "do_remote_decode": True})
    if caller is None:
        return None
    if not isinstance(caller, dict):
        raise InvalidArgument("extra_args.kv_transfer_params must be a JSON object")
    return json_to_struct(caller)


def _ec_transfer_params(encoder_result: Any, mode: DisaggregationMode) -> Any:
    """The encoder handoff an encode worker produced (``encoder_result``), forwarded to vLLM as
    ``kv.ec_transfer_params`` by every mode but encode (docs/reference/sidecar.md#multimodal-requests)."""
    if encoder_result is None or mode is DisaggregationMode.ENCODE:
        return None
    if not isinstance(encoder_result, dict):
        raise InvalidArgument("encoder_result must be a JSON object")
    return json_to_struct(encoder_result)


def _is_whole_non_negative(value: Any) -> TypeGuard[int | float]:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 0
    if isinstance(value, float):
        return math.isfinite(value) and value >= 0 and value.is_integer()
    return False
