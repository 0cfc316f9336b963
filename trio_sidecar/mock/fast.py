"""The mock's fast path (pure: no I/O, no Trio): framed per-token messages, built once per token id.

A streamed token's ``GenerateResponse`` (no ``finish_info``) depends only on the token and on whether the
request asks for text and token ids, and the mock's tokens come from a fixed range of ``TOKEN_SPAN`` ids. So
its framed bytes are built once (``fill_sequence_output`` + ``SerializeToString``) and kept in a table per
option pair (a few MB at most when full). Requests with logprobs or candidates are built every time. What
it buys and its guard test: docs/performance.md#fast-paths.
"""

from __future__ import annotations

from collections.abc import Callable

from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.mock.generation import TOKEN_BASE, TOKEN_SPAN, OutputOptions, fill_sequence_output
from trio_sidecar.transport import FramedMessages

__all__ = ["framed_token_encoder", "token_message"]

# Framed per-token messages by (text, token_ids) option pair, indexed by token - TOKEN_BASE.
_FRAMED_TOKENS: dict[tuple[bool, bool], list[bytes | None]] = {}


def token_message(token: int, options: OutputOptions) -> bytes:
    """The serialized ``GenerateResponse`` of one streamed token (no ``finish_info``): the reference."""
    message = pb.GenerateResponse()
    fill_sequence_output(message.outputs, (token,), options)
    return message.SerializeToString()


def framed_token_encoder(options: OutputOptions) -> Callable[[int], bytes]:
    """``token -> framed GenerateResponse`` for one streamed token: ``frame(token_message(token, options))``,
    from the table for the plain text / token-id shapes."""
    frame = FramedMessages.frame
    if options.logprobs or options.candidates_requested:
        return lambda token: frame(token_message(token, options))
    table = _FRAMED_TOKENS.get((options.text, options.token_ids))
    if table is None:
        table = _FRAMED_TOKENS[(options.text, options.token_ids)] = [None] * TOKEN_SPAN

    def framed(token: int) -> bytes:
        index = token - TOKEN_BASE
        if 0 <= index < TOKEN_SPAN:
            data = table[index]
            if data is None:
                data = table[index] = frame(token_message(token, options))
            return data
        return frame(token_message(token, options))

    return framed
