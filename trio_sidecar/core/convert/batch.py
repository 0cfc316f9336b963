"""The request task's decisions, message by message, and the batches it hands over (docs/reference/sidecar.md#response-conversion, docs/reference/sidecar.md#decode-deferral).
PURE: no I/O, no Trio.

Theory of operation
-------------------
The engine's request task (``request_task.RequestTask``) listens to ``GenerateStream`` and feeds every
message, as received (serialized), to :meth:`BatchBuilder.add`, which converts it (:class:`~.response.ResponseState`,
with every check of docs/reference/sidecar.md#response-conversion) and answers one question: does the request
go on after this message?

* :data:`MORE`: the message's chunk, if it has one, joined the open batch. At the end of each run of
  messages read together the task takes the open batch (:meth:`BatchBuilder.take_items`) and hands it to its
  sink: :func:`deliver_items` (plain token chunks merged, ``submit()``) or a :class:`ChunkBatch` returned one
  chunk at a time (``generate()``).
* :data:`END`: the request ends with this message. The task hands the open batch over (this message's
  chunk is never in it), then applies :attr:`BatchBuilder.ending`: the terminal chunk; the conversion error,
  or the transport's error for a message that does not parse (either, once a deferred cancellation was
  recorded, the cancelled chunk instead); or, in decode mode with a cancellation recorded, the cancelled
  chunk in place of the message that completed the KV transfer.

The stream ending without a terminal is :meth:`BatchBuilder.eof`.

Decode deferral (docs/reference/sidecar.md#decode-deferral): until a message completes the KV transfer (``ResponseState.completes_transfer``:
a token or the finish) no message has a chunk, so the open batch is still empty when that message comes.
Its chunk starts the batch, unless the client's cancellation was recorded meanwhile: then the request ends
with the cancelled chunk, whose usage counts the replaced chunk (docs/reference/sidecar.md#decode-deferral).

The common message (tokens and text only) is read straight from its bytes (``ResponseState.convert_plain``);
any other is parsed and converted in full. A :class:`ChunkBatch` keeps such a plain chunk as its token ids
and text, and builds the ``LLMEngineOutput`` when the caller takes it. A batch can hold hundreds of messages
while its caller catches up; kept as attrs objects and lists they would outlive young-generation garbage
collections and be promoted, and the full collections that follow cost more than the conversion itself
(``bench/sidecar.py`` at 64 streams: ~1 of ~6 CPU µs per token). The token id of a one-token chunk is
stored as the int itself, so the request task allocates no collected object for it at all.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import attrs
from google.protobuf.message import DecodeError

from ..._proto.vllm import inference_pb2
from ..errors import ProtocolError, SidecarError, status_to_error
from ..protocol import LLMEngineOutput, token_chunk
from ..status import StatusCode
from .response import ResponseState

__all__ = [
    "BatchBuilder",
    "ChunkBatch",
    "END",
    "EOF_BEFORE_TERMINAL",
    "Ending",
    "MORE",
    "PARSE_ERROR",
    "Step",
    "WARN_CONVERSION_AFTER_CANCEL",
    "WARN_EOF_AFTER_CANCEL",
    "WARN_ERROR_AFTER_CANCEL",
    "deliver_items",
]

WARN_EOF_AFTER_CANCEL = "vLLM GenerateStream ended before transfer completion after request cancellation"
WARN_ERROR_AFTER_CANCEL = "vLLM GenerateStream failed before transfer completion after request cancellation"
WARN_CONVERSION_AFTER_CANCEL = "vLLM response conversion failed after request cancellation"
EOF_BEFORE_TERMINAL = "GenerateStream ended before a terminal response"
#: A message that does not parse: reported as the transport's ``RpcError`` for it (INTERNAL); the stream is
#: abandoned (the server did not end it), so an ``Abort`` follows (docs/reference/sidecar.md#abort-after-abandoning-a-stream).
PARSE_ERROR = "failed to parse a response message of /vllm.Inference/GenerateStream"

_parse = inference_pb2.GenerateResponse.FromString


class Step(enum.Enum):
    """What the request task does after :meth:`BatchBuilder.add`."""

    MORE = "more"
    END = "end"


MORE = Step.MORE
END = Step.END


@attrs.frozen(kw_only=True)
class Ending:
    """How a request ends, for the request task to apply (after handing the open batch over).

    Attributes:
        server_ended: the server ended the stream (its terminal or EOF): no ``Abort`` is needed. False for
            every ending the sidecar chooses (cancellation, a conversion error, a message that does not
            parse): the stream is abandoned and, with ``abort_on_cancel``, its id is aborted.
        final: the last chunk (the terminal or the cancelled chunk), when there is no ``error``.
        error: raised to the caller after the chunks already handed over.
        warning: to be logged (WARNING).
    """

    server_ended: bool
    final: LLMEngineOutput | None = None
    error: SidecarError | None = None
    warning: str | None = None


def _item_tokens(ids: Any) -> int:
    kind = type(ids)
    if kind is int:
        return 1
    if kind is list:
        return len(ids)
    return len(ids.token_ids)


class ChunkBatch:
    """The chunks of one hand-over, returned one at a time by :meth:`take`.

    ``items`` is one flat list of pairs: ``(token_id, text)`` (a plain one-token chunk), ``(token_ids,
    text)`` (a plain chunk, ``token_ids`` a list), or ``(chunk, None)`` (an ``LLMEngineOutput`` that
    ``ResponseState.convert`` built).
    """

    __slots__ = ("_items", "_next")

    def __init__(self, items: list[Any]) -> None:
        self._items = items
        self._next = 0  # index in _items of the next pair

    def __repr__(self) -> str:
        return f"<ChunkBatch {len(self)} of {len(self._items) >> 1} chunks left>"

    def __len__(self) -> int:
        """The chunks not taken yet."""
        return (len(self._items) - self._next) >> 1

    def take(self) -> LLMEngineOutput | None:
        """The next chunk (built now if plain), or ``None`` once all were taken."""
        index = self._next
        items = self._items
        if index >= len(items):
            return None
        self._next = index + 2
        ids = items[index]
        kind = type(ids)
        if kind is int:
            return token_chunk([ids], items[index + 1])
        if kind is list:
            return token_chunk(ids, items[index + 1])
        return ids  # type: ignore[no-any-return]

    def tokens(self) -> int:
        """The completion tokens of the chunks not taken yet."""
        return sum(_item_tokens(ids) for ids in self._items[self._next :: 2])

    def drop(self) -> int:
        """Forget the chunks not taken yet; returns their completion tokens."""
        tokens = self.tokens()
        self._items = []
        self._next = 0
        return tokens


def deliver_items(
    items: list[Any],
    tokens: Callable[[list[int], str], None],
    chunk: Callable[[LLMEngineOutput], None],
    *,
    merge: bool = True,
) -> None:
    """Hand every chunk of a batch's pairs (:meth:`BatchBuilder.take_items`) over in order: a plain one as
    ``tokens(token_ids, text)`` (a fresh list), any other as ``chunk(chunk)``; what :class:`ChunkBatch` would
    return one at a time, without building the plain chunks. Consecutive plain chunks go over as one
    ``tokens`` call: their ids in order, their texts concatenated exactly (``""`` when all are empty), as
    the Dynamo bridge would merge the deltas anyway. This is the one place the engine merges tokens.
    ``merge=False`` hands every message's chunk over on its own (see ``Sidecar.submit``)."""
    index = 0
    size = len(items)
    while index < size:
        ids = items[index]
        kind = type(ids)
        if kind is not int and kind is not list:
            chunk(ids)
            index += 2
            continue
        text = items[index + 1]
        index += 2
        if merge and index < size and type(items[index]) in _PLAIN_KINDS:  # a run: merged
            merged = [ids] if kind is int else ids
            texts = [text]
            while index < size and type(items[index]) in _PLAIN_KINDS:
                more = items[index]
                if type(more) is int:
                    merged.append(more)
                else:
                    merged += more
                texts.append(items[index + 1])
                index += 2
            tokens(merged, "".join(texts))
        else:
            tokens([ids] if kind is int else ids, text)


_PLAIN_KINDS = (int, list)


class BatchBuilder:
    """The request task's per-message decisions and its open batch (theory of operation above).

    Args:
        state: the request's conversion state; :meth:`add` converts with it.
        decode: decode mode (docs/reference/sidecar.md#decode-deferral): cancellation is deferred until the KV transfer completed.

    Attributes:
        transfer_completed: decode mode: a message completed the KV transfer (the engine's
            ``client_cancel`` reads it to choose between deferring and cancelling at once).
        ending: after :data:`END`, how the request ends.
    """

    __slots__ = ("_deferring", "_items", "decode", "ending", "state", "transfer_completed")

    def __init__(self, state: ResponseState, *, decode: bool) -> None:
        self.state = state
        self.decode = decode
        self.transfer_completed = False
        self.ending: Ending | None = None
        self._deferring = decode  # decode mode and the transfer not completed yet
        self._items: list[Any] = []

    def __repr__(self) -> str:
        return (
            f"<BatchBuilder {len(self._items) >> 1} chunks open{' deferring' if self._deferring else ''}"
            f"{' ended' if self.ending is not None else ''}>"
        )

    def add(self, data: bytes, request_cancelled: bool) -> Step:
        """Convert one received message (serialized); returns :data:`MORE` or :data:`END` (then see
        :attr:`ending`).

        Args:
            request_cancelled: decode mode: the client's cancellation was recorded (deferred).
        """
        state = self.state
        if not self._deferring:
            plain = state.convert_plain(data)
            if plain is not None:
                self._items += plain
                return MORE
        try:
            response = _parse(data)
        except DecodeError:
            # Reported as the transport's RpcError for it (INTERNAL) always read; but the server has not
            # ended the stream, so the sidecar abandons it and sends an Abort (docs/reference/sidecar.md#abort-after-abandoning-a-stream).
            if request_cancelled:
                final = state.cancelled_chunk()
                self.ending = Ending(server_ended=False, final=final, warning=WARN_ERROR_AFTER_CANCEL)
            else:
                error = status_to_error("GenerateStream", StatusCode.INTERNAL, PARSE_ERROR)
                self.ending = Ending(server_ended=False, error=error)
            return END
        try:
            chunk = state.convert(response)
        except ProtocolError as exc:
            if request_cancelled:
                warning = WARN_CONVERSION_AFTER_CANCEL
                self.ending = Ending(server_ended=False, final=state.cancelled_chunk(), warning=warning)
            else:
                self.ending = Ending(server_ended=False, error=exc)
            return END
        completing = self._deferring and state.completes_transfer(response)
        if completing:
            self._deferring = False
            self.transfer_completed = True
        if chunk is None:
            return MORE
        if completing and request_cancelled:
            # docs/reference/sidecar.md#decode-deferral, step 3: the chunk with the first token is replaced by the cancelled
            # chunk, whose usage counts it.
            self.ending = Ending(server_ended=state.finished, final=state.cancelled_chunk())
            return END
        if state.finished:
            self.ending = Ending(server_ended=True, final=chunk)
            return END
        self._items += (chunk, None)
        return MORE

    def take_items(self) -> list[Any] | None:
        """The open batch's pairs, as :class:`ChunkBatch` holds them (``None`` when it has no chunk); a new
        batch is opened. A sink hands them on with :func:`deliver_items` or returns them one at a time
        through a :class:`ChunkBatch`."""
        items = self._items
        if not items:
            return None
        self._items = []
        return items

    def eof(self, request_cancelled: bool) -> Ending:
        """The stream ended (OK trailers) without a terminal message."""
        if request_cancelled:
            return Ending(server_ended=True, final=self.state.cancelled_chunk(), warning=WARN_EOF_AFTER_CANCEL)
        return Ending(server_ended=True, error=ProtocolError(EOF_BEFORE_TERMINAL))
