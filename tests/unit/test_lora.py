"""The pure LoRA checks and answers (docs/lora.md): the native 1.6.1 sidecar's texts, and ``lora_name`` on
the converted request."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trio_sidecar.core import lora_requests as lora
from trio_sidecar.core.config import DisaggregationMode
from trio_sidecar.core.convert import build_generate_request
from trio_sidecar.core.errors import CannotConnect, InvalidArgument, ProtocolError, SidecarError
from trio_sidecar.core.lora_requests import LoadRequest, LoadResult, LoraAdapter
from trio_sidecar.core.protocol import structure_request


def test_the_lora_module_is_pure():
    code = "import sys\nimport trio_sidecar.core.lora_requests\nassert 'trio' not in sys.modules, 'trio imported'\n"
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
        ({"lora_name": "   ", "source": {"uri": "file:///a"}}, "lora_name must be a non-empty string"),
        ({"lora_name": "a", "source": {"uri": "  "}}, "source.uri must be a non-empty string"),
        ({"lora_name": "a", "source": {"uri": "FILE:///a"}}, "source.uri must use the file://, hf://, or s3:// scheme"),
        (
            {"lora_name": "a", "source": {"uri": "HF://org/r"}},
            "source.uri must use the file://, hf://, or s3:// scheme",
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
    # A load trims the name and the URI; the name of an unload is kept as given.
    assert lora.parse_load_body({"lora_name": " a ", "source": {"uri": " file:///x/y "}}) == LoadRequest(
        "a", "file:///x/y", "/x/y"
    )
    assert lora.parse_lora_name({"lora_name": " a "}) == " a "
    assert lora.parse_load_body({"lora_name": "a", "source": {"uri": "file:///x%20y"}}).path == "/x%20y"


@pytest.mark.parametrize(
    ("adapters", "message"),
    [
        ([LoraAdapter(" ", 1, "/x")], "ListLoras returned an adapter with an empty name"),
        ([LoraAdapter("a", 0, "/x")], "ListLoras returned adapter `a` with a non-positive id 0"),
        ([LoraAdapter("a", 1, " ")], "ListLoras returned adapter `a` without a source path"),
        ([LoraAdapter("a", 1, "/x"), LoraAdapter("a", 2, "/x")], "ListLoras returned duplicate adapter name `a`"),
        ([LoraAdapter("a", 1, "/x"), LoraAdapter("b", 1, "/x")], "ListLoras returned duplicate adapter id 1"),
        ([LoraAdapter("..", 1, "/x")], "adapter `..` does not produce a usable discovery suffix"),
        (
            [LoraAdapter("Z.z", 1, "/x"), LoraAdapter("z_z", 2, "/x")],
            "adapter `z_z` derives the discovery suffix `z_z`, which another loaded adapter already uses",
        ),
    ],
)
def test_an_ambiguous_adapter_list_is_refused_with_the_native_text(adapters, message):
    assert refused(lora.check_inventory, adapters) == (ProtocolError, f"invalid vLLM gRPC response: {message}")


def test_a_sound_adapter_list_passes():
    lora.check_inventory([LoraAdapter("a", 1, "/x"), LoraAdapter("b", 2, "/x")])
    lora.check_inventory([])


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
    assert refused(lora.resolve_local_source, remote) == (
        InvalidArgument,
        "LoRA source `hf://org/repo` is not supported without a source resolver: only file:// sources are loaded "
        "(see docs/lora.md#sources)",
    )


def test_an_adapter_directory_is_canonicalized_before_it_is_checked_and_named(tmp_path: Path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    assert refused(lora.check_adapter_directory, f"{link}/") == (
        InvalidArgument,
        f"LoRA directory `{real}` must contain adapter_config.json and adapter weights",
    )
    (real / "adapter_config.json").write_text("{}")
    (real / "adapter_model.safetensors").write_bytes(b"")
    assert lora.check_adapter_directory(str(link)) == str(real)


def test_a_downloader_failure_is_the_native_resolve_text_without_the_python_prefix():
    error = lora.source_not_resolved("s3://b/x", "Download failed: LoRA s3://b/x not found in any source")
    assert (type(error), str(error)) == (
        ProtocolError,
        "invalid vLLM gRPC response: failed to resolve LoRA source `s3://b/x`: LoRA s3://b/x not found in any source",
    )


@pytest.mark.parametrize(
    ("name", "suffix"),
    [("a", "a"), ("A.b", "a_b"), ("my-lora_2", "my-lora_2"), ("__x", "x"), (".x", "x"), ("é", ""), ("..", "")],
)
def test_the_discovery_suffix_is_dynamos_slug_of_the_name(name, suffix):
    assert lora.discovery_suffix(name) == suffix


def test_an_adapter_name_must_give_a_discovery_suffix_no_other_loaded_adapter_uses():
    loaded = [LoraAdapter("A.b", 1, "/x"), LoraAdapter("c", 2, "/y")]
    assert refused(lora.check_adapter_name, "a_b", ("tiny",), loaded) == (
        InvalidArgument,
        "LoRA adapter `a_b` derives the discovery suffix `a_b`, which is already used by loaded adapter `A.b`; "
        "publishing it would overwrite that adapter's discovery record",
    )
    assert refused(lora.check_adapter_name, "..", ("tiny",), loaded) == (
        InvalidArgument,
        "LoRA adapter `..` does not produce a usable discovery suffix",
    )
    lora.check_adapter_name("A.b", ("tiny",), loaded)  # the adapter itself: "already loaded" is decided later
    lora.check_adapter_name("d", ("tiny",), loaded)
    # The base model's name is checked first.
    assert "conflicts with the base model" in refused(lora.check_adapter_name, "tiny", ("tiny",), loaded)[1]


def test_a_refused_list_answers_without_lora_name():
    assert lora.list_error_answer(ProtocolError("x")) == {
        "status": "error",
        "message": "Internal: invalid vLLM gRPC response: x",
    }


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
    assert str(info.value) == "LoRA request selection is not supported by vLLM gRPC"
    plain = structure_request({"token_ids": [1, 2]})
    assert (
        build_generate_request(plain, "r", "tiny", DisaggregationMode.AGG, lora_supported=True).message.lora_name == ""
    )
