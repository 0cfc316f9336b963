"""The image placeholder for exact multimodal KV routing (docs/reference/worker.md#multimodal-kv-routing).

The outcome rules and native's texts on a stand-in resolver, then Dynamo's own resolver (the one the native
1.6.1 sidecar and the frontend use) on model directories of the shapes real models ship, with the values
the native sidecar reported for the same directories (docs/dynamo.md, "Exact multimodal KV routing").
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from trio_sidecar.core.mm_routing import (
    FETCH_FAILED,
    FETCH_TIMED_OUT,
    RESOLVED,
    UNAVAILABLE,
    fetch_failed,
    resolve_image_token,
)


def test_a_resolved_id_is_kept_and_logged_at_info_with_natives_text():
    calls = []

    def resolver(model: str, model_dir: str) -> int:
        calls.append((model, model_dir))
        return 151655

    outcome = resolve_image_token("Qwen/Qwen2-VL-2B-Instruct", "/models/qwen", resolver)
    assert calls == [("Qwen/Qwen2-VL-2B-Instruct", "/models/qwen")]
    assert outcome.image_token_id == 151655
    assert outcome.level == logging.INFO
    assert outcome.message == f"{RESOLVED} (model=Qwen/Qwen2-VL-2B-Instruct, image_token_id=151655)"


@pytest.mark.parametrize("token", [None, True, -1, 2**32, "151655", 3.0])
def test_anything_but_a_u32_leaves_exact_routing_off_with_natives_warning(token: Any):
    outcome = resolve_image_token("m", "/d", lambda _m, _d: token)
    assert outcome.image_token_id is None
    assert outcome.level == logging.WARNING
    assert outcome.message == f"{UNAVAILABLE} (model=m, model_dir=/d)"
    assert UNAVAILABLE == (
        "Exact multimodal routing prerequisites are unavailable; source metadata will omit the image token"
    )


def test_the_largest_u32_is_a_valid_id():
    assert resolve_image_token("m", "/d", lambda _m, _d: 2**32 - 1).image_token_id == 2**32 - 1


def test_a_failed_fetch_leaves_exact_routing_off_and_names_the_timeout_and_the_error():
    outcome = fetch_failed("acme/vl", "Model snapshots for 'acme/vl' not found in cache")
    assert outcome.image_token_id is None
    assert outcome.level == logging.WARNING
    assert outcome.message == (
        "Unable to fetch model configuration; exact multimodal KV routing is disabled "
        "(model=acme/vl, fetch_timeout_secs=30, error=Model snapshots for 'acme/vl' not found in cache)"
    )
    assert FETCH_FAILED in fetch_failed("m", FETCH_TIMED_OUT).message
    assert FETCH_TIMED_OUT == "model configuration fetch timed out"


# --- Dynamo's resolver on the shapes real models use ---------------------------------------------------------

QWEN2_VL_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "min_pixels": 3136,
    "max_pixels": 12845056,
}
CLIP_PREPROCESSOR = {
    "image_processor_type": "CLIPImageProcessor",
    "crop_size": {"height": 336, "width": 336},
    "size": {"shortest_edge": 336},
}

# (case, config.json or None, preprocessor_config.json or None, the id native resolved)
SHAPES = [
    (
        "qwen2-vl: image_token_id and video_token_id",
        {"model_type": "qwen2_vl", "image_token_id": 151655, "video_token_id": 151656},
        QWEN2_VL_PREPROCESSOR,
        151655,
    ),
    ("qwen2.5-vl", {"model_type": "qwen2_5_vl", "image_token_id": 151655}, QWEN2_VL_PREPROCESSOR, 151655),
    ("qwen3-vl", {"model_type": "qwen3_vl", "image_token_id": 151655}, QWEN2_VL_PREPROCESSOR, 151655),
    (
        "qwen2-vl without preprocessor_config.json",
        {"model_type": "qwen2_vl", "image_token_id": 151655},
        None,
        None,
    ),
    (
        "qwen2-vl with the id only under text_config",
        {"model_type": "qwen2_vl", "text_config": {"image_token_id": 151655}},
        QWEN2_VL_PREPROCESSOR,
        None,
    ),
    (
        "llava-next: image_token_index",
        {"model_type": "llava_next", "image_token_index": 32000},
        CLIP_PREPROCESSOR,
        32000,
    ),
    # LLaVA-1.5 resolves its placeholder through the tokenizer's vocabulary; without it, nothing.
    ("llava-1.5 without a tokenizer", {"model_type": "llava", "image_token_index": 32000}, CLIP_PREPROCESSOR, None),
    ("text-only llama", {"model_type": "llama", "vocab_size": 32000}, QWEN2_VL_PREPROCESSOR, None),
    (
        "an unknown family with an image_token_id",
        {"model_type": "acme", "image_token_id": 5},
        QWEN2_VL_PREPROCESSOR,
        None,
    ),
    ("no config.json", None, QWEN2_VL_PREPROCESSOR, None),
]


def _model_dir(root: Path, config: dict | None, preprocessor: dict | None) -> Path:
    root.mkdir()
    if config is not None:
        (root / "config.json").write_text(json.dumps(config))
    if preprocessor is not None:
        (root / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return root


@pytest.mark.dynamo
@pytest.mark.parametrize(("case", "config", "preprocessor", "expected"), SHAPES, ids=[s[0] for s in SHAPES])
def test_dynamos_resolver_gives_the_id_native_resolved_for_each_model_shape(
    tmp_path, case, config, preprocessor, expected
):
    from dynamo._core import resolve_routing_image_token_id

    model_dir = _model_dir(tmp_path / "model", config, preprocessor)
    outcome = resolve_image_token(str(model_dir), str(model_dir), resolve_routing_image_token_id)
    assert outcome.image_token_id == expected, case
    assert outcome.level == (logging.INFO if expected is not None else logging.WARNING)


@pytest.mark.dynamo
def test_the_tiny_multimodal_model_resolves_to_the_mocks_placeholder(tmp_path):
    from dynamo._core import resolve_routing_image_token_id

    from trio_sidecar.mock.tiny_vl_model import IMAGE_TOKEN_ID, make_tiny_vl_model

    model_dir = str(make_tiny_vl_model(tmp_path / "tiny-vl"))
    outcome = resolve_image_token(model_dir, model_dir, resolve_routing_image_token_id)
    assert outcome.image_token_id == IMAGE_TOKEN_ID == 31999
