"""Images on the real vLLM 0.32 CPU server: refused for a model outside vllm-rs's multimodal registry (docs/conformance.md#multimodal-on-the-cpu-build-not-servable).

The model is a tiny random BLIP-2 built locally by ``scripts/make_tiny_blip2.py`` (no download), served by
its own ``vllm-rs serve`` (module scope). vLLM's Python engine loads it and profiles it with a dummy image
(no torchvision needed), but ``vllm-rs``, which owns both the OpenAI HTTP server and the ``vllm.Inference``
gRPC server, has no multimodal model spec for ``blip-2`` and disables images for it at start. Pinned here,
so that a vLLM that starts serving images for it fails these tests and the multimodal rows can be added:

- gRPC ``GenerateStream`` with an image ``MediaItem`` (data URI): ``INVALID_ARGUMENT`` with vLLM's exact
  texts (``text`` input: token ids are required; ``token_ids`` input: the renderer has no multimodal
  support); the same prompt without media is served.
- vLLM's own chat endpoint: HTTP 400 ``unsupported multimodal content: image_url``.
- Native sidecar vs ``trio-sidecar run``, each behind its own ``dynamo.frontend``: an image chat request
  gets HTTP 400 on both sides (unary and streamed; trio-sidecar's message carries vLLM's text), and a text
  chat the same text as vLLM's own.
"""

from __future__ import annotations

import base64
import shutil
import struct
import subprocess
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import grpc
import pytest
from real_vllm_server import SERVED_MODEL_NAME, RealVllmEnv, check_env, env_from_environ, start_ready_server
from test_real_differential import CHAT, READY_TIMEOUT_S, SIDES, Row, ask, finish_of, text_of, usage_of

from trio_sidecar._devtools import local
from trio_sidecar._proto.vllm import inference_pb2

REPO = Path(__file__).resolve().parents[2]
GREEDY = {"temperature": 0}


def png(rgb: tuple[int, int, int], side: int = 40) -> bytes:
    """A solid ``side`` × ``side`` RGB PNG (no imaging library needed)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    rows = b"".join(b"\x00" + bytes(rgb) * side for _ in range(side))
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


IMAGE = "data:image/png;base64," + base64.b64encode(png((30, 60, 90))).decode()


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def image_chat(*parts: dict[str, Any], text: str = "describe") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def both(name: str, body: dict[str, Any], kind: str = "greedy") -> list[Row]:
    streamed = {**body, "stream_options": {"include_usage": True}}
    return [Row(name, CHAT, body, False, kind), Row(f"{name} (stream)", CHAT, streamed, True, kind)]


ROWS: list[Row] = [
    *both("image chat", {"messages": image_chat(image_part(IMAGE)), "max_tokens": 8, **GREEDY}, "error"),
    *both("text chat", {"messages": [{"role": "user", "content": "describe"}], "max_tokens": 8, **GREEDY}),
]


# ----------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def vl_env(tmp_path_factory) -> RealVllmEnv:
    env = env_from_environ()
    assert env is not None
    check_env(env)
    out = Path(tmp_path_factory.mktemp("tiny-blip2"))
    done = subprocess.run(
        [str(env.python), str(REPO / "scripts" / "make_tiny_blip2.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": str(env.venv_bin)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return RealVllmEnv(env.python, out)


@pytest.fixture(scope="module")
def vl_server(vl_env) -> Iterator[Any]:
    server = start_ready_server(vl_env, launch="rust", warm_up=False)
    try:
        yield server
    finally:
        try:
            server.stop()
            assert not server.leftovers(), f"vLLM processes still running after stop: {server.leftovers()}"
        finally:
            server.cleanup_files()


@attrs.frozen
class Pair:
    ports: dict[str, int]
    vllm_http_port: int


@pytest.fixture(scope="module")
def pair(vl_server, tmp_path_factory) -> Iterator[Pair]:
    pytest.importorskip("dynamo.frontend", reason="ai-dynamo 1.6.1 (frontend) is not installed")
    workdir = Path(tmp_path_factory.mktemp("real-multimodal"))
    env = local.dynamo_env(workdir / "file-kv")
    (workdir / "file-kv").mkdir()
    processes: list[local.Process] = []
    ports: dict[str, int] = {}
    try:
        for side in SIDES:
            namespace = f"realmm-{side}"
            frontend, ports[side] = local.start_frontend(workdir, env, namespace=namespace)
            processes.append(frontend)
            start = local.start_native_sidecar if side == "native" else local.start_trio_sidecar
            processes.append(start(workdir, env, vl_server.endpoint, namespace=namespace, name=f"{side}-sidecar"))
        for port in ports.values():
            local.wait_for_models(port, [SERVED_MODEL_NAME], timeout=READY_TIMEOUT_S, watch=processes)
        yield Pair(ports, vl_server.http_port)
    finally:
        for proc in processes:
            proc.stop(grace=5.0)
        shutil.rmtree(workdir, ignore_errors=True)


# ----------------------------------------------------------------------------------------------- vLLM itself


def _generate(
    endpoint: str, media: list[inference_pb2.MediaItem], **prompt: Any
) -> list[inference_pb2.GenerateResponse]:
    request = inference_pb2.GenerateRequest(
        request_id=f"mm-{len(media)}",
        temperature=0.0,
        stopping=inference_pb2.StoppingCriteria(max_new_tokens=4),
        media=media,
        **prompt,
    )
    with grpc.insecure_channel(endpoint) as channel:
        stream = channel.unary_stream(
            "/vllm.Inference/GenerateStream",
            request_serializer=inference_pb2.GenerateRequest.SerializeToString,
            response_deserializer=inference_pb2.GenerateResponse.FromString,
        )
        return list(stream(request, timeout=120))


IMAGE_ITEM = inference_pb2.MediaItem(modality=inference_pb2.MODALITY_IMAGE, data_uri=IMAGE)
PROMPT_IDS = inference_pb2.TokenIds(ids=[71, 265, 70, 85, 76, 69, 72])  # "describe" in the tiny tokenizer


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ({"text": "describe"}, "multimodal gRPC requests must provide token_ids input"),
        ({"token_ids": PROMPT_IDS}, "multimodal input is not supported by this chat renderer"),
    ],
    ids=["text", "token_ids"],
)
def test_generate_stream_refuses_an_image_media_item(vl_server, prompt, message):
    with pytest.raises(grpc.RpcError) as refused:
        _generate(vl_server.endpoint, [IMAGE_ITEM], **prompt)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == message
    served = _generate(vl_server.endpoint, [], **prompt)
    assert served and served[-1].outputs.HasField("finish_info"), served


def test_vllm_rs_disables_images_for_the_model_at_start(vl_server):
    log = vl_server.log_text()
    assert "multimodal model spec is not registered; disabling image/video support for this model" in log
    assert 'model_type="blip-2"' in log


def test_vllm_chat_endpoint_refuses_an_image(vl_server):
    row = Row("image chat", CHAT, {"messages": image_chat(image_part(IMAGE)), "max_tokens": 4, **GREEDY})
    answer = ask(vl_server.http_port, row, row.body)
    assert answer.status == 400, answer
    assert answer.body["error"]["message"] == "unsupported multimodal content: image_url", answer


# ----------------------------------------------------------------------------------------------- the sidecars


@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
def test_trio_sidecar_answers_an_image_request_like_the_native_sidecar(pair, row):
    answers = {side: ask(port, row, row.body) for side, port in pair.ports.items()}
    native, trio = answers["native"], answers["trio"]
    assert trio.status == native.status, (native, trio)
    if row.kind == "error":
        # native's frontend answer says only "Invalid request"; trio-sidecar's carries vLLM's text (docs/dynamo.md).
        assert native.status == 400, native
        assert "multimodal input is not supported by this chat renderer" in trio.body["message"], trio
        return
    assert native.status == 200, native
    assert finish_of(trio, row) == finish_of(native, row)
    assert usage_of(trio, row) == usage_of(native, row)
    assert text_of(trio, row).encode() == text_of(native, row).encode()
    assert trio.body == native.body
    vllm = ask(pair.vllm_http_port, row, row.body)
    assert vllm.status == 200, vllm
    assert text_of(trio, row).encode() == text_of(vllm, row).encode()
    assert finish_of(trio, row) == finish_of(vllm, row)
