"""``GenerateResponse`` stream → ``LLMEngineOutput`` chunks (docs/reference/sidecar.md#response-conversion, docs/reference/sidecar.md#multimodal-requests). PURE: no I/O, no Trio.

Theory of operation: :class:`ResponseState` is fed each received message in order (``convert``) and
returns at most one chunk per message; it never reads a socket. It checks every message against the
request and the running token count (upstream ``convert.rs`` ``ResponseState``). A violation raises
:class:`ProtocolError`; the owner then drops the stream. After the terminal chunk ``finished`` is true and
any further message is ignored.
"""

from __future__ import annotations

import math
from typing import Any

from ..._proto.vllm import inference_pb2
from ..config import DisaggregationMode
from ..errors import ProtocolError
from ..jsonstruct import struct_to_json
from ..multimodal import HANDOFF_KEY, prefill_handoff_ids
from ..protocol import CompletionUsage, LLMEngineOutput, PreprocessedRequest, TopLogprob, cancelled_chunk
from .request import BuiltRequest

__all__ = ["ResponseState", "normalize_logprob", "plain_token_fields", "LOGPROB_FLOOR"]

LOGPROB_FLOOR = -9999.0

_FinishReason = inference_pb2.FinishInfo.FinishReason
_FINISH_REASONS = {
    _FinishReason.LENGTH: "length",
    _FinishReason.STOP: "stop",
    _FinishReason.ABORTED: "cancelled",
}


def normalize_logprob(value: float) -> float:
    """The −9999 floor: finite values are clamped below; NaN and ±infinity become −9999.0."""
    if not math.isfinite(value):
        return LOGPROB_FLOOR
    return max(value, LOGPROB_FLOOR)


_U32_LIMIT = 1 << 32


def plain_token_fields(data: bytes) -> tuple[int | list[int], str | None] | None:
    """The token ids and text of a serialized ``GenerateResponse`` that carries only those, else ``None``.

    Reads protobuf's canonical encoding of ``GenerateResponse{outputs: SequenceOutput{text, num_tokens,
    token_ids}}`` and nothing else: outputs the only field; in it, optionally ``text`` (field 2), then
    ``num_tokens`` (field 3, 1–127), then ``token_ids`` (field 4, packed) to the end, ``num_tokens`` of
    them, each below 2**32; lengths of at most two bytes. Protobuf itself parses the other messages (any
    other field, order or encoding, and anything malformed or not UTF-8): for the bytes accepted here it
    gives exactly these values (``test_property.py`` checks it, with random messages and random bytes).
    It skips the ``GenerateResponse`` objects that parsing and reading fields of (~1 µs) cost per token.

    Returns:
        ``(token_ids, text)``: ``token_ids`` the id itself for one token, else a list; ``text`` the
        message's text, ``""`` when it has none.
    """
    try:
        size = len(data)
        if data[0] != 0x12:  # GenerateResponse.outputs (field 2, length-delimited)
            return None
        length = data[1]
        pos = 2
        if length > 0x7F:
            if data[2] > 0x7F:
                return None
            length = (length & 0x7F) | (data[2] << 7)
            pos = 3
        if pos + length != size:
            return None
        text = ""
        if data[pos] == 0x12:  # SequenceOutput.text (field 2)
            length = data[pos + 1]
            pos += 2
            if length > 0x7F:
                if data[pos] > 0x7F:
                    return None
                length = (length & 0x7F) | (data[pos] << 7)
                pos += 1
            end = pos + length
            text = data[pos:end].decode()  # (beyond the end: the reads below fail)
            pos = end
        # num_tokens (field 3, varint), then token_ids (field 4, packed): their length reaches the end.
        if data[pos] != 0x18 or data[pos + 2] != 0x22:
            return None
        count = data[pos + 1]
        length = data[pos + 3]
        pos += 4
        if pos + length != size or not 0 < count <= 0x7F or length > 0x7F:
            return None
        if count == 1:  # the usual message: one id of one to three bytes (below 2**21)
            last = data[-1]
            if last > 0x7F:
                return None
            if length == 1:
                return last, text
            first = data[pos]
            if first < 0x80:
                return None
            if length == 2:
                return (first & 0x7F) | (last << 7), text
            if length == 3:
                middle = data[pos + 1]
                if middle > 0x7F:
                    return (first & 0x7F) | ((middle & 0x7F) << 7) | (last << 14), text
                return None
        ids = []
        value = shift = 0
        for byte in data[pos:]:
            if byte > 0x7F:
                value |= (byte & 0x7F) << shift
                shift += 7
                if shift > 28:  # longer than a uint32's five bytes
                    return None
            else:
                value |= byte << shift
                if value >= _U32_LIMIT:
                    return None
                ids.append(value)
                value = shift = 0
        if shift or len(ids) != count:
            return None
        return (ids[0] if count == 1 else ids), text
    except (IndexError, UnicodeDecodeError):
        return None


def _length_error(
    kind: str, expected: int, token_ids: int, logprobs: int, ranks: int, candidates: int
) -> ProtocolError:
    return ProtocolError(
        f"{kind} logprob array lengths do not match expected count {expected}: token_ids={token_ids}, "
        f"logprobs={logprobs}, ranks={ranks}, candidate_tokens={candidates}"
    )


class ResponseState:
    """Per-request response conversion state (docs/reference/sidecar.md#per-message-checks).

    Attributes:
        prompt_tokens: usage prompt count (with media: vLLM's ``num_prompt_tokens``, once seen).
        completion_tokens: tokens streamed so far (the usage counts; :meth:`retract` takes back those
            never delivered).
        finished: a terminal chunk was converted.
    """

    def __init__(self, request: PreprocessedRequest, built: BuiltRequest, mode: DisaggregationMode) -> None:
        mode = DisaggregationMode.parse(mode)
        self.prompt_tokens: int = built.prompt_tokens
        self.completion_tokens: int = 0
        self.finished: bool = False
        self.is_prefill: bool = mode is DisaggregationMode.PREFILL
        self.is_encode: bool = mode is DisaggregationMode.ENCODE
        # Prefill and encode chunks carry no tokens and no text (their one token is not the client's).
        self._no_output: bool = self.is_prefill or self.is_encode
        self.has_media: bool = built.has_media
        #: vLLM's ``num_prompt_tokens`` is the count (a text prompt, or media it expanded), not the request's.
        self._server_counts_prompt: bool = built.has_media or built.message.WhichOneof("prompt") == "text"
        self.output_logprobs: int | None = request.output_options.logprobs
        self.expect_prompt_logprobs: bool = request.output_options.prompt_logprobs is not None
        self.prompt_info: inference_pb2.PromptInfo | None = None
        #: ``convert_plain`` applies: the chunks carry token ids and text (not prefill), and no logprobs.
        self._plain_chunks: bool = not self._no_output and self.output_logprobs is None

    def __repr__(self) -> str:
        return (
            f"<ResponseState prompt_tokens={self.prompt_tokens} completion_tokens={self.completion_tokens} "
            f"finished={self.finished}>"
        )

    def reported_completion_tokens(self) -> int:
        """Usage's completion count: 0 for prefill (its one token is decode's to report) and encode."""
        return 0 if self._no_output else self.completion_tokens

    def retract(self, tokens: int) -> None:
        """``tokens`` were converted but never delivered (the caller dropped them after its cancellation):
        usage no longer counts them, as if their messages had not been read."""
        self.completion_tokens -= tokens

    def cancelled_chunk(self) -> LLMEngineOutput:
        """The cancelled chunk (docs/reference/sidecar.md#output-chunks) with the usage accumulated so far
        (``text`` ``""`` unless prefill, like every other output chunk)."""
        chunk = cancelled_chunk(self.prompt_tokens, self.reported_completion_tokens())
        if not self._no_output:
            chunk.text = ""
        return chunk

    @staticmethod
    def completes_transfer(response: inference_pb2.GenerateResponse) -> bool:
        """Decode deferral (docs/reference/sidecar.md#decode-deferral): a token arrived or the request finished."""
        if not response.HasField("outputs"):
            return False
        outputs = response.outputs
        return outputs.num_tokens > 0 or outputs.HasField("finish_info")

    def convert_plain(self, data: bytes) -> tuple[int | list[int], str | None] | None:
        """:meth:`convert`'s fast path for the common message, read from its serialized form.

        A *plain* message carries outputs with token ids, a matching ``num_tokens`` and optionally text,
        and nothing else (:func:`plain_token_fields`), in a request whose chunks carry tokens and text
        without logprobs (aggregated or decode mode). For it every check (docs/reference/sidecar.md#per-message-checks) passes and :meth:`convert`
        would return ``LLMEngineOutput(token_ids=..., text=...)`` with nothing else set.

        Returns:
            ``(token_ids, text)`` after counting the tokens, ``token_ids`` being the id itself for a single
            token (no list to allocate; see ``convert.batch``) and ``text`` ``""`` when the message has none,
            as in :meth:`convert`; or ``None``, counting nothing, for any other message: parse and
            :meth:`convert` it then (it runs the checks and raises where one fails).
        """
        if self.finished or not self._plain_chunks:
            return None
        fields = plain_token_fields(data)
        if fields is not None:
            ids = fields[0]
            self.completion_tokens += 1 if type(ids) is int else len(ids)  # type: ignore[arg-type]
        return fields

    def convert(self, response: inference_pb2.GenerateResponse) -> LLMEngineOutput | None:
        """Convert one message (docs/reference/sidecar.md#per-message-checks); ``None`` when it yields no chunk.

        Raises:
            ProtocolError: a consistency check failed (docs/reference/sidecar.md#per-message-checks, docs/reference/sidecar.md#multimodal-requests).
        """
        if self.finished:
            return None  # anything after the terminal is ignored
        if response.HasField("prompt_info"):
            self._prompt_info(response.prompt_info)
        if not response.HasField("outputs"):
            return None
        outputs = response.outputs
        if outputs.index != 0:
            raise ProtocolError(f"received unsupported sequence index {outputs.index}")
        token_ids = outputs.token_ids
        num_tokens = outputs.num_tokens
        if num_tokens != len(token_ids):
            raise ProtocolError(f"num_tokens {num_tokens} does not match {len(token_ids)} token IDs")
        if self.is_encode and num_tokens > 0:
            raise ProtocolError("encode response produced output tokens")

        if self._no_output:
            chunk = LLMEngineOutput()
        else:
            # (built with its fields at once: cheaper than assigning them after construction)
            # ``text`` is always a string, ``""`` when vLLM sent none (its incremental detokenizer holds back
            # an incomplete UTF-8 sequence): without it Dynamo's frontend would detokenize the chunk's tokens
            # itself and a partial multi-byte character would come out as U+FFFD (docs/dynamo.md).
            chunk = LLMEngineOutput(token_ids=list(token_ids), text=outputs.text)
            if self.output_logprobs is not None:
                self._output_logprobs(outputs, chunk)

        self.completion_tokens += num_tokens

        if not outputs.HasField("finish_info"):
            if self._no_output or num_tokens == 0:
                return None
            return chunk
        self._terminal(outputs.finish_info, chunk)
        self.finished = True
        if self.is_encode:
            return _encode_terminal(outputs.finish_info, chunk)
        return chunk

    # -- helpers --------------------------------------------------------------------------------------

    def _prompt_info(self, info: inference_pb2.PromptInfo) -> None:
        if self._server_counts_prompt:
            # vLLM's tokenized or expanded prompt is authoritative (docs/reference/sidecar.md#multimodal-requests).
            self.prompt_tokens = info.num_prompt_tokens
        elif info.num_prompt_tokens != self.prompt_tokens:
            raise ProtocolError(
                f"prompt token count {info.num_prompt_tokens} does not match request count {self.prompt_tokens}"
            )
        if self.expect_prompt_logprobs:
            n = info.num_prompt_tokens
            lengths = (len(info.token_ids), len(info.logprobs), len(info.ranks), len(info.candidate_tokens))
            if any(length != n for length in lengths):
                raise _length_error("prompt", n, *lengths)
        self.prompt_info = info

    def _output_logprobs(self, outputs: inference_pb2.SequenceOutput, chunk: LLMEngineOutput) -> None:
        n = len(outputs.token_ids)
        lengths = (n, len(outputs.logprobs), len(outputs.ranks), len(outputs.candidate_tokens))
        if any(length != n for length in lengths[1:]):
            raise _length_error("output", n, *lengths)
        chunk.log_probs = [normalize_logprob(lp) for lp in outputs.logprobs]
        if not self.output_logprobs:
            return
        top: list[list[TopLogprob]] = []
        for token_id, logprob, rank, candidates in zip(  # lengths checked above
            outputs.token_ids, outputs.logprobs, outputs.ranks, outputs.candidate_tokens, strict=True
        ):
            # docs/reference/sidecar.md#per-message-checks: the server's candidates in its order; the sampled token first only if absent.
            position = [
                TopLogprob(rank=c.rank, token_id=c.id, logprob=normalize_logprob(c.logprob)) for c in candidates.tokens
            ]
            if all(c.id != token_id for c in candidates.tokens):
                position.insert(0, TopLogprob(rank=rank, token_id=token_id, logprob=normalize_logprob(logprob)))
            top.append(position)
        chunk.top_logprobs = top

    def _terminal(self, finish: inference_pb2.FinishInfo, chunk: LLMEngineOutput) -> None:
        if finish.num_output_tokens != self.completion_tokens:
            raise ProtocolError(
                f"terminal num_output_tokens {finish.num_output_tokens} does not match streamed count "
                f"{self.completion_tokens}"
            )
        reason = finish.finish_reason
        if reason == _FinishReason.NOT_FINISHED:
            raise ProtocolError("terminal response has NOT_FINISHED finish reason")
        if reason not in _FINISH_REASONS:
            raise ProtocolError(f"unknown finish reason {int(reason)}")
        chunk.finish_reason = _FINISH_REASONS[reason]

        which = finish.WhichOneof("stop_reason")
        if which == "stop_token_id":
            chunk.stop_reason = finish.stop_token_id
        elif which == "eos_token_id":
            chunk.stop_reason = finish.eos_token_id
        elif which == "stop_string":
            chunk.stop_reason = finish.stop_string

        chunk.completion_usage = CompletionUsage.of(self.prompt_tokens, self.reported_completion_tokens())

        if finish.HasField("kv_transfer_params"):
            params: dict[str, Any] = struct_to_json(finish.kv_transfer_params)
            if self.is_prefill and self.has_media:
                params[HANDOFF_KEY] = prefill_handoff_ids(self.prompt_info)
            chunk.disaggregated_params = params
        elif self.is_prefill:
            raise ProtocolError("prefill terminal is missing kv_transfer_params")

        if self.expect_prompt_logprobs and self.prompt_info is not None:
            chunk.engine_data = {"prompt_logprobs": _prompt_logprobs(self.prompt_info)}


def _encode_terminal(finish: inference_pb2.FinishInfo, chunk: LLMEngineOutput) -> LLMEngineOutput:
    """An encode worker's terminal (native 1.6.1): a cancelled chunk as it is; otherwise a ``stop`` that
    carries vLLM's ``ec_transfer_params`` as ``encoder_result``, the handoff the next worker forwards.

    Raises:
        ProtocolError: a finish other than stop or cancelled, or no ``ec_transfer_params`` (native's texts).
    """
    if chunk.finish_reason == "cancelled":
        return chunk
    if chunk.finish_reason != "stop":
        name = _FinishReason.Name(finish.finish_reason).capitalize()
        raise ProtocolError(f"encode terminal has invalid finish reason Some({name}); expected stop or cancelled")
    if not finish.HasField("ec_transfer_params"):
        raise ProtocolError("encode terminal is missing valid ec_transfer_params")
    return LLMEngineOutput(finish_reason="stop", encoder_result=struct_to_json(finish.ec_transfer_params))


def _prompt_logprobs(info: inference_pb2.PromptInfo) -> list[dict[str, dict[str, Any]] | None]:
    """``engine_data.prompt_logprobs``: position 0 ``None``; then the prompt token, then its candidates."""
    n = info.num_prompt_tokens
    if n == 0:
        return []
    result: list[dict[str, dict[str, Any]] | None] = [None]
    for i in range(1, n):
        entry = {str(info.token_ids[i]): {"logprob": normalize_logprob(info.logprobs[i]), "rank": info.ranks[i]}}
        for c in info.candidate_tokens[i].tokens:
            entry.setdefault(str(c.id), {"logprob": normalize_logprob(c.logprob), "rank": c.rank})
        result.append(entry)
    return result
