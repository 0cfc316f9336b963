"""Request validation in the mock's fixed order (docs/reference/mock.md#request-validation, docs/reference/mock.md#multimodal, docs/reference/mock.md#scheduler). PURE.

The order of the table in docs/reference/mock.md#request-validation is the contract: the first failing row decides the status. Rows that need
server state stay in the server and bracket the pure part:

* rows 1–2 (``x-data-parallel-rank``): :func:`parse_dp_rank`;
* row 3 (concurrency permit): the server's non-blocking semaphore;
* rows 4–18 and the chunked-prefill budget: :func:`prepare_request`, which also plans the output;
* row 19 (duplicate in-flight id) and row 20 (KV capacity): the server's routes and the scheduler.

Differences from the upstream mocker's order, adopted for parity with vLLM (docs/reference/mock.md#request-validation): a wrong model is
``NOT_FOUND`` ``model `{name}` not found``; ``lora_name`` is ``FAILED_PRECONDITION`` without LoRA and
``NOT_FOUND`` for an adapter that is not loaded (docs/reference/mock.md#lora-adapters); an empty stop string
is rejected after row 11; vLLM's float sampling checks (``trio_sidecar.core.sampling_checks``: temperature,
top_p, min_p and the penalties, with vLLM's texts) run after row 18 (context length and ``min_new_tokens``),
where vLLM runs them (docs/conformance.md).
"""

from __future__ import annotations

import uuid as _uuid
from collections.abc import Callable, Sequence

import attrs

from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.core.sampling_checks import format_f32, sampling_error
from trio_sidecar.core.status import StatusCode
from trio_sidecar.mock import handoff, lora, multimodal
from trio_sidecar.mock.generation import (
    DEFAULT_MAX_NEW_TOKENS,
    MAX_NEW_TOKENS_LIMIT,
    OutputOptions,
    OutputPlan,
    RequestRejected,
    plan_output,
    prompt_token_seed,
    request_uuid,
    token_seed,
)
from trio_sidecar.mock.handoff import Role
from trio_sidecar.mock.kvcache import MmSpan
from trio_sidecar.mock.scripted import ScriptedOutput, Scripts

__all__ = [
    "DP_RANK_METADATA",
    "PreparedRequest",
    "RequestPolicy",
    "RequestRejected",
    "format_f32",
    "parse_dp_rank",
    "prepare_request",
]

DP_RANK_METADATA = "x-data-parallel-rank"


def _invalid(message: str) -> RequestRejected:
    return RequestRejected(StatusCode.INVALID_ARGUMENT, message)


def _parse_u32(text: str) -> int | None:
    # Rust's `str::trim` then `parse::<u32>()`: ASCII digits with an optional '+'.
    text = text.strip()
    digits = text[1:] if text.startswith("+") else text
    if not digits or not (digits.isascii() and digits.isdigit()):
        return None
    value = int(digits)
    return value if value < 2**32 else None


def parse_dp_rank(metadata: Sequence[tuple[str, str]], dp_size: int, first_rank: int = 0) -> int | None:
    """Rows 1–2: the ``x-data-parallel-rank`` metadata as a hosted rank, or ``None`` when absent.

    The server hosts the ``dp_size`` ranks from ``first_rank`` (one node of a hybrid data-parallel group).

    Raises:
        RequestRejected: ``INVALID_ARGUMENT`` for a value that is not a u32, or a rank not hosted.
    """
    raw = next((value for key, value in metadata if key.lower() == DP_RANK_METADATA), None)
    if raw is None:
        return None
    rank = _parse_u32(raw)
    if rank is None:
        raise _invalid("x-data-parallel-rank metadata must be an unsigned 32-bit integer")
    if not first_rank <= rank < first_rank + dp_size:
        ranks = ", ".join(str(r) for r in range(first_rank, first_rank + dp_size))
        raise _invalid(
            f"engine-core error: data parallel rank {rank} is not connected to this frontend; "
            f"connected ranks: [{ranks}]"
        )
    return rank


@attrs.frozen(kw_only=True)
class RequestPolicy:
    """What validation needs to know about the server (from ``MockConfig`` and the engine arguments)."""

    served_model_name: str
    seed: int = 42
    mode: Role = Role.AGGREGATED
    supports_multimodal: bool = False
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    token_seed_source: str = "request_id"
    image_token_id: int = multimodal.DEFAULT_IMAGE_TOKEN_ID
    tokens_per_image: int = multimodal.DEFAULT_TOKENS_PER_IMAGE
    #: The server's adapter table (mutable: Control.LoadLora changes it); ``None`` = LoRA disabled.
    lora: lora.LoraTable | None = None
    #: Scripted completions (docs/reference/mock.md#scripted-completions); ``None`` = synthetic tokens only.
    scripts: Scripts | None = None
    #: Text → prompt token ids (the model directory's tokenizer, special tokens added as vLLM adds them);
    #: ``None``: text prompts are refused (docs/reference/mock.md#request-validation).
    tokenize: Callable[[str], list[int]] | None = None


@attrs.frozen(kw_only=True)
class PreparedRequest:
    """A request that passed rows 4–18: its identity, effective prompt and the planned output."""

    request_id: str
    uuid: str
    prompt: tuple[int, ...]
    plan: OutputPlan
    role: Role
    output: OutputOptions
    cache_salt: str = ""
    bypass_prefix_cache: bool = False
    priority: int = 0
    mm_spans: tuple[MmSpan, ...] = ()
    #: Set when a scripted completion answers the request: it gives the messages' text.
    scripted: ScriptedOutput | None = None


def _new_request_id() -> str:
    return str(_uuid.uuid4())


def prepare_request(
    request: pb.GenerateRequest,
    policy: RequestPolicy,
    *,
    new_request_id: Callable[[], str] = _new_request_id,
) -> PreparedRequest:
    """Rows 4–18 of docs/reference/mock.md#request-validation in order, then plan the output (docs/reference/mock.md#deterministic-generation, docs/reference/mock.md#termination).

    Args:
        request: the decoded ``GenerateRequest``.
        policy: the server's configuration.
        new_request_id: replaces an empty ``request_id`` (a random UUID4 by default).

    Raises:
        RequestRejected: the first failing row's status and message.
    """
    # Row 4 (docs/reference/mock.md#request-validation: vLLM's status and wording).
    if request.model and request.model != policy.served_model_name:
        raise RequestRejected(StatusCode.NOT_FOUND, f"model `{request.model}` not found")
    # Rows 5–7.
    which = request.WhichOneof("prompt")
    if which == "text":
        if policy.tokenize is None:
            raise RequestRejected(
                StatusCode.UNIMPLEMENTED,
                "text tokenization is not available in the CPU-only Mocker server; send token_ids",
            )
        prompt = tuple(policy.tokenize(request.text))
    elif which is None:
        raise _invalid("prompt is required")
    else:
        prompt = tuple(request.token_ids.ids)
    if not prompt:
        raise _invalid("token_ids must not be empty")
    if 0 < request.truncate_prompt_tokens < len(prompt):
        prompt = prompt[-request.truncate_prompt_tokens :]
    # Row 8 (docs/reference/mock.md#request-validation).
    if request.lora_name:
        if policy.lora is None:
            raise lora.lora_disabled()
        policy.lora.check_request(request.lora_name)
    # Rows 9–10, then the placeholder expansion of docs/reference/mock.md#multimodal.
    multimodal.check_media(request.media, policy.supports_multimodal)
    mm_spans: tuple[MmSpan, ...] = ()
    if request.media:
        unexpanded = prompt
        prompt = multimodal.expand_image_placeholders(
            prompt, len(request.media), policy.image_token_id, policy.tokens_per_image
        )
        mm_spans = multimodal.image_spans(unexpanded, request.media, policy.image_token_id, policy.tokens_per_image)
    # Row 11, then vLLM's sampling checks (docs/reference/mock.md#request-validation).
    if request.sampling.num_sequences > 1:
        raise _invalid("num_sequences must be 0 or 1")
    if any(s == "" for s in request.stopping.stop_strings):
        raise _invalid("stop strings cannot be empty")
    # Rows 12–13 are accepted (docs/reference/mock.md#kv-cache-and-kv-events); rows 14–15.
    kv_params = request.kv.kv_transfer_params if request.kv.HasField("kv_transfer_params") else None
    role = handoff.classify_kv_transfer_params(kv_params)
    handoff.check_role(policy.mode, role)
    if policy.mode is Role.ENCODE and not request.media:
        raise _invalid(handoff.ENCODE_NEEDS_MEDIA)
    # Rows 16–18 and the context cap of docs/reference/mock.md#termination.
    stopping = request.stopping
    max_tokens = stopping.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    if max_tokens > MAX_NEW_TOKENS_LIMIT:
        raise _invalid(f"max_new_tokens must not exceed {MAX_NEW_TOKENS_LIMIT}")
    if policy.max_model_len is not None:
        if len(prompt) >= policy.max_model_len:
            raise _invalid(
                f"this model's maximum context length is {policy.max_model_len} tokens, "
                f"but the prompt contains {len(prompt)} input tokens"
            )
        max_tokens = min(max_tokens, policy.max_model_len - len(prompt))
    if stopping.min_new_tokens > max_tokens:
        raise _invalid(
            f"min_new_tokens ({stopping.min_new_tokens}) must not exceed effective max_new_tokens ({max_tokens})"
        )
    # vLLM's float sampling checks, with its texts; vLLM runs them after the context-length and
    # min_tokens checks (docs/conformance.md).
    sampling_problem = sampling_error(request)
    if sampling_problem is not None:
        raise _invalid(sampling_problem)
    # docs/reference/mock.md#scheduler: without chunked prefill a prompt must fit one pass.
    budget = policy.max_num_batched_tokens
    if not policy.enable_chunked_prefill and budget is not None and len(prompt) > budget:
        raise _invalid(
            f"prompt of {len(prompt)} tokens exceeds max_num_batched_tokens {budget} with chunked prefill disabled"
        )

    request_id = request.request_id or new_request_id()
    if policy.token_seed_source == "prompt":
        seed_value = prompt_token_seed(policy.seed, prompt)
    else:
        seed_value = token_seed(policy.seed, request_id)
    scripted = None
    if policy.scripts is not None:
        response = request.response
        scripted = policy.scripts.match(
            prompt,
            max_tokens=max_tokens,
            min_tokens=stopping.min_new_tokens,
            ignore_eos=stopping.ignore_eos,
            stop_token_ids=stopping.stop_token_ids,
            skip_special_tokens=response.skip_special_tokens if response.HasField("skip_special_tokens") else True,
        )
    if scripted is not None:
        plan = OutputPlan(scripted.tokens, scripted.finish_reason, scripted.stop_token_id, scripted.eos_token_id)
    else:
        plan = plan_output(seed_value, max_tokens, stopping.min_new_tokens, stopping.stop_token_ids)
    return PreparedRequest(
        request_id=request_id,
        uuid=request_uuid(policy.seed, request_id),
        prompt=prompt,
        plan=plan,
        role=role,
        output=OutputOptions.from_proto(request.response),
        cache_salt=request.kv.cache_salt,
        bypass_prefix_cache=request.kv.bypass_prefix_cache,
        priority=request.priority,
        mm_spans=mm_spans,
        scripted=scripted,
    )
