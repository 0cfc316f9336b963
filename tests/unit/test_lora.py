"""The pure LoRA checks and answers (docs/lora.md): the native 1.6.1 sidecar's texts, and ``lora_name`` on
the converted request."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trio_sidecar import lora
from trio_sidecar.config import DisaggregationMode
from trio_sidecar.convert import build_generate_request
from trio_sidecar.errors import CannotConnect, InvalidArgument, ProtocolError, SidecarError
from trio_sidecar.lora import LoadRequest, LoadResult, LoraAdapter
from trio_sidecar.protocol import structure_request


def test_the_lora_module_is_pure():
    code = "import sys\nimport trio_sidecar.lora\nassert 'trio' not in sys.modules, 'trio imported'\n"
    subprocess.run([sys.executable, "-c", code], check=True)


def refused(fn, *args) -> tuple[type[SidecarError], str]:
    with pytest.raises(SidecarError) as info:
        fn(*args)
    return type(info.value), str(info.value)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"lora_name": "", "source": {"uri": "file:///a"}}, "lora_name must be a non-empty string"),
        ({"lora_name": 3, "source": {"uri": "file:///a"}}, "lora_name must be a non-empty string"),
        ({"source": {"uri": "file:///a"}}, "lora_name must be a non-empty string"),
        ({"lora_name": "a", "lora_path": "/a"}, "source.uri must be a non-empty string"),
        ({"lora_name": "a", "source": {"uri": ""}}, "source.uri must be a non-empty string"),
        ({"lora_name": "a", "source": "file:///a"}, "source.uri must be a non-empty string"),
        ({"lora_name": "a", "source": {"uri": "/abs/dir"}}, "source.uri must use the file://, hf://, or s3:// scheme"),
        (
            {"lora_name": "a", "source": {"uri": "http://h/x"}},
            "source.uri must use the file://, hf://, or s3:// scheme",
        ),
        *(
            (
                {"lora_name": "a", "source": {"uri": uri}},
                "file source.uri must contain an absolute local path without a host, query, or fragment",
            )
            for uri in ("file://relative/x", "file:///a?x=1", "file:///a#f", "file://host/a")
        ),
    ],
)
def test_a_load_body_is_refused_with_the_native_text(body, message):
    assert refused(lora.parse_load_body, body) == (InvalidArgument, message)


def test_a_file_uri_gives_its_absolute_path_and_remote_schemes_pass_the_scheme_check():
    assert lora.parse_load_body({"lora_name": "a", "source": {"uri": "file:///x/y"}}) == LoadRequest(
        "a", "file:///x/y", "/x/y"
    )
    assert lora.parse_load_body({"lora_name": "a", "source": {"uri": "hf://org/repo"}}).path == ""


def test_the_name_capacity_hot_swap_and_not_found_checks_use_the_native_texts():
    assert refused(lora.check_adapter_name, "tiny", ("tiny", "alias")) == (
        InvalidArgument,
        "LoRA adapter `tiny` conflicts with the base model name or one of its aliases",
    )
    lora.check_adapter_name("a", ("tiny", "alias"))
    assert refused(lora.check_capacity, 2, 2) == (
        InvalidArgument,
        "LoRA capacity exceeded: at most 2 adapter(s) may be loaded",
    )
    lora.check_capacity(1, 2)
    assert refused(lora.check_hot_swap, "a", True) == (
        InvalidArgument,
        "LoRA adapter `a` is already loaded; hot swap is not supported by the gRPC backend. "
        "Load new weights under a different name.",
    )
    lora.check_hot_swap("a", False)
    assert str(lora.not_loaded("a", ["b", "c"])) == 'LoRA adapter \'a\' not found. Available LoRAs: ["b", "c"]'
    assert str(lora.not_loaded("a", [])) == "LoRA adapter 'a' not found. Available LoRAs: []"


def test_a_local_source_needs_an_existing_directory_with_config_and_weights(tmp_path: Path):
    missing = LoadRequest("a", f"file://{tmp_path}/nope", f"{tmp_path}/nope")
    assert refused(lora.resolve_local_source, missing) == (
        ProtocolError,
        f"invalid vLLM gRPC response: failed to resolve LoRA source `file://{tmp_path}/nope`: "
        f"Local LoRA not found: file://{tmp_path}/nope",
    )
    request = LoadRequest("a", f"file://{tmp_path}", str(tmp_path))
    no_files = (InvalidArgument, f"LoRA directory `{tmp_path}` must contain adapter_config.json and adapter weights")
    assert refused(lora.resolve_local_source, request) == no_files
    (tmp_path / "adapter_config.json").write_text("{}")
    assert refused(lora.resolve_local_source, request) == no_files
    (tmp_path / "adapter_model.bin").write_bytes(b"")
    assert lora.resolve_local_source(request) == str(tmp_path)
    remote = LoadRequest("a", "hf://org/repo", "")
    assert refused(lora.resolve_local_source, remote)[0] is InvalidArgument


def test_the_answers_are_the_native_json():
    a = LoraAdapter("a", 1, "/x")
    assert lora.list_answer([a, LoraAdapter("b", 3, "/y")]) == {
        "status": "success",
        "count": 2,
        "loras": {"a": 1, "b": 3},
    }
    assert lora.load_answer(LoadResult(a, already_loaded=False)) == {
        "status": "success",
        "message": "LoRA adapter 'a' loaded successfully",
        "lora_name": "a",
        "lora_id": 1,
        "hot_swap": False,
    }
    assert lora.load_answer(LoadResult(a, already_loaded=True))["message"] == "LoRA adapter 'a' already loaded"
    assert lora.unload_answer(a) == {
        "status": "success",
        "message": "LoRA adapter 'a' unloaded successfully",
        "lora_name": "a",
        "lora_id": 1,
    }
    assert lora.error_answer(InvalidArgument("x"), {"lora_name": "a"}) == {
        "status": "error",
        "message": "InvalidRequest: x",
        "lora_name": "a",
    }
    assert lora.error_answer(ProtocolError("y"), {})["message"] == "Internal: invalid vLLM gRPC response: y"
    assert lora.error_answer(CannotConnect("z"), {"lora_name": 1})["lora_name"] is None


@pytest.mark.parametrize(
    ("environ", "requested"),
    [
        ({}, False),
        ({"DYN_LORA_ENABLED": "true"}, True),
        ({"DYN_LORA_ENABLED": "1"}, True),
        ({"DYN_LORA_ENABLED": "no"}, False),
    ],
)
def test_lora_serving_is_opted_in_by_dyn_lora_enabled(environ, requested):
    assert lora.lora_serving_requested(environ) is requested
    hot = {k.replace("DYN_LORA_ENABLED", "DYN_LORA_HOTSWAP_ENABLED"): v for k, v in environ.items()}
    assert lora.hot_swap_requested(hot) is requested


def test_lora_name_is_forwarded_only_when_the_server_supports_lora():
    request = structure_request({"token_ids": [1, 2], "routing": {"lora_name": "a"}})
    built = build_generate_request(request, "r", "tiny", DisaggregationMode.AGG, lora_supported=True)
    assert (built.message.lora_name, built.message.model) == ("a", "tiny")
    with pytest.raises(InvalidArgument) as info:
        build_generate_request(request, "r", "tiny", DisaggregationMode.AGG)
    assert str(info.value) == "LoRA request selection is not supported by vLLM gRPC v0.25.1"
    plain = structure_request({"token_ids": [1, 2]})
    assert (
        build_generate_request(plain, "r", "tiny", DisaggregationMode.AGG, lora_supported=True).message.lora_name == ""
    )
