"""The mock's ``vllm.Inference`` servicer: a call's tokens as ``GenerateResponse`` messages
(docs/reference/mock.md#stream-shape-and-buffering)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from trio_sidecar._proto.vllm import inference_grpc
from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.mock.fast import framed_token_encoder
from trio_sidecar.mock.generation import (
    FinishReason,
    OutputOptions,
    build_prompt_info,
    build_sequence_output,
    fill_sequence_output,
)
from trio_sidecar.transport import FramedMessages

if TYPE_CHECKING:
    from trio_sidecar.mock.server import MockServer

__all__ = ["InferenceServicer", "finished_reason"]


class InferenceServicer(inference_grpc.InferenceServicer):
    """Inference: ``Generate`` and ``GenerateStream`` on the server's calls (docs/reference/mock.md#stream-shape-and-buffering)."""

    def __init__(self, server: MockServer) -> None:
        self._server = server

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> pb.GenerateResponse:  # noqa: N802
        call = self._server.begin("Generate", request, context)
        try:
            rejection = self._server.submit(call)
            if rejection is not None:
                raise rejection
            tokens: list[int] = []
            while True:
                chunk, terminal = await call.next_output()
                call.timer.delivered(len(chunk), finished_reason(terminal))
                tokens.extend(chunk)
                if terminal is not None:
                    break
            text = None
            detokenizer = self._server.detokenizer(call)
            if detokenizer is not None:
                text = detokenizer.step(tokens)
                if terminal.finish_reason != FinishReason.ABORTED:
                    text += detokenizer.finish()
            outputs = build_sequence_output(tokens, call.prepared.output, text)
            outputs.finish_info.CopyFrom(terminal)
            return pb.GenerateResponse(
                prompt_info=build_prompt_info(call.prepared.prompt, request.response), outputs=outputs
            )
        finally:
            call.release()

    async def GenerateStream(
        self, request: pb.GenerateRequest, context: Any
    ) -> AsyncIterator[pb.GenerateResponse | FramedMessages]:  # noqa: N802
        call = self._server.begin("GenerateStream", request, context)
        try:
            rejection = self._server.submit(call)
            yield pb.GenerateResponse(prompt_info=build_prompt_info(call.prepared.prompt, request.response))
            if rejection is not None:
                raise rejection
            options = call.prepared.output
            detokenizer = self._server.detokenizer(call)
            encode = framed_token_encoder(options) if detokenizer is None else _byte_text_encoder(options, detokenizer)
            while True:
                tokens, terminal = await call.next_output()
                call.timer.delivered(len(tokens), finished_reason(terminal))
                if terminal is None or terminal.finish_reason == FinishReason.ABORTED or not tokens:
                    plain, last_token = tokens, None
                else:
                    plain, last_token = tokens[:-1], tokens[-1]
                # One message per token, all that are ready written in one send (docs/reference/mock.md#stream-shape-and-buffering).
                framed = [encode(token) for token in plain]
                if terminal is not None:
                    message = pb.GenerateResponse()
                    if last_token is None:
                        message.outputs.SetInParent()  # the ABORTED (or an encode) terminal carries no token
                    elif detokenizer is None:
                        fill_sequence_output(message.outputs, (last_token,), options)
                    else:  # the finish flushes what the detokenizer holds back
                        text = detokenizer.step((last_token,)) + detokenizer.finish()
                        fill_sequence_output(message.outputs, (last_token,), options, text)
                    message.outputs.finish_info.CopyFrom(terminal)
                    framed.append(FramedMessages.frame(message.SerializeToString()))
                if framed:
                    yield FramedMessages(b"".join(framed))
                if terminal is not None:
                    return
        finally:
            call.release()


def finished_reason(terminal: pb.FinishInfo | None) -> str | None:
    """vLLM's ``finished_reason`` metric label of a terminal (``None``: no terminal yet)."""
    if terminal is None:
        return None
    return {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}.get(terminal.finish_reason, "abort")


def _byte_text_encoder(options: OutputOptions, detokenizer: Any) -> Callable[[int], bytes]:
    """``token -> framed GenerateResponse`` in ``text_mode = "bytes"``: the text is the request's
    detokenizer's, so nothing is cached."""
    frame = FramedMessages.frame

    def framed(token: int) -> bytes:
        message = pb.GenerateResponse()
        fill_sequence_output(message.outputs, (token,), options, detokenizer.step((token,)))
        return frame(message.SerializeToString())

    return framed
