"""Pure conversion between Dynamo's shapes and vLLM's ``vllm.Inference`` messages (docs/reference/sidecar.md#request-conversion, docs/reference/sidecar.md#response-conversion).

No I/O and no Trio: ``build_generate_request`` validates and maps a request; ``ResponseState`` turns the
response stream into output chunks one message at a time (events in, values out, like h11).
"""

from __future__ import annotations

from .request import BuiltRequest, build_generate_request
from .response import ResponseState

__all__ = ["BuiltRequest", "build_generate_request", "ResponseState"]
