"""A tiny *multimodal* model directory, shaped like Qwen2-VL (no weights, no downloads).

Derived from the tiny text model (:mod:`trio_sidecar.mock.tiny_model`) so that Dynamo's frontend and both
sidecars treat it as a model that routes images exactly (docs/reference/worker.md#multimodal-kv-routing):

- ``config.json``: ``model_type: qwen2_vl`` with ``image_token_id`` :data:`IMAGE_TOKEN_ID` (the mock's
  default placeholder) and ``video_token_id`` :data:`VIDEO_TOKEN_ID`, as Qwen2-VL's configuration has them.
- ``preprocessor_config.json``: Qwen2-VL's image processor (14-pixel patches merged 2×2), so an image of
  :data:`IMAGE_SIDE` × :data:`IMAGE_SIDE` pixels counts :data:`TOKENS_PER_IMAGE` tokens, which is what the
  mock must be told (``tokens_per_image``) to expand a placeholder to the same run as the frontend.
- ``tokenizer.json`` / ``tokenizer_config.json``: ``<|image_pad|>`` and ``<|video_pad|>`` are special tokens
  with those ids (they replace two padding words of the vocabulary), and the chat template renders each
  image part of a message as one ``<|image_pad|>``.

``python -m trio_sidecar.mock.tiny_vl_model OUTPUT_DIR`` writes the directory.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from trio_sidecar.mock import multimodal, tiny_model

__all__ = [
    "IMAGE_PAD",
    "IMAGE_SIDE",
    "IMAGE_TOKEN_ID",
    "TOKENS_PER_IMAGE",
    "VIDEO_PAD",
    "VIDEO_TOKEN_ID",
    "VL_CHAT_TEMPLATE",
    "build_vl_files",
    "make_tiny_vl_model",
]

IMAGE_TOKEN_ID = multimodal.DEFAULT_IMAGE_TOKEN_ID  # 31999
VIDEO_TOKEN_ID = IMAGE_TOKEN_ID - 1
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
IMAGE_SIDE = 56
TOKENS_PER_IMAGE = 4  # (56 / 14)² patches, merged 2×2

VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}" + IMAGE_PAD + "{% endif %}"
    "{% endfor %}{% endif %}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def _special(token_id: int, content: str) -> dict:
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": True,
    }


def build_vl_files() -> dict[str, str]:
    """The tiny text model's files, turned into the Qwen2-VL-shaped model described in the module docstring."""
    files = tiny_model.build_files()
    tokenizer = json.loads(files["tokenizer.json"])
    vocab = tokenizer["model"]["vocab"]
    by_id = {token_id: token for token, token_id in vocab.items()}
    for token_id, content in ((IMAGE_TOKEN_ID, IMAGE_PAD), (VIDEO_TOKEN_ID, VIDEO_PAD)):
        del vocab[by_id[token_id]]
        vocab[content] = token_id
        tokenizer["added_tokens"].append(_special(token_id, content))
    tokenizer_config = json.loads(files["tokenizer_config.json"])
    tokenizer_config["chat_template"] = VL_CHAT_TEMPLATE
    for token_id, content in ((IMAGE_TOKEN_ID, IMAGE_PAD), (VIDEO_TOKEN_ID, VIDEO_PAD)):
        entry = _special(token_id, content)
        del entry["id"]
        tokenizer_config["added_tokens_decoder"][str(token_id)] = entry
    config = json.loads(files["config.json"])
    config.update(
        architectures=["Qwen2VLForConditionalGeneration"],
        model_type="qwen2_vl",
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
    )
    dump = lambda obj: json.dumps(obj, indent=2, ensure_ascii=False) + "\n"  # noqa: E731
    files.update(
        {
            "tokenizer.json": json.dumps(tokenizer, ensure_ascii=False),
            "tokenizer_config.json": dump(tokenizer_config),
            "config.json": dump(config),
            "preprocessor_config.json": dump(_PREPROCESSOR),
        }
    )
    return files


def make_tiny_vl_model(directory: str | os.PathLike[str]) -> Path:
    """Write the files into ``directory`` (created if needed; existing files are replaced); return its path."""
    target = Path(directory).resolve()
    target.mkdir(parents=True, exist_ok=True)
    for name, text in build_vl_files().items():
        (target / name).write_text(text, encoding="utf-8")
    return target


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m trio_sidecar.mock.tiny_vl_model OUTPUT_DIR", file=sys.stderr)
        sys.exit(2)
    print(make_tiny_vl_model(sys.argv[1]))
