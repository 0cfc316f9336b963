"""The model's own tokenizer, for text prompts a server cannot tokenize (docs/embedded.md#text-prompts).
Blocking file I/O: call it from a worker thread.

vLLM serves text prompts itself when ``ModelInfo.supports_text_input`` is true. Otherwise the typed API
encodes the text here, with the tokenizer of the model vLLM loaded (Control's ``model_id``: a local
directory holding ``tokenizer.json``, or a Hugging Face model name, fetched through the Hugging Face
cache), the way vLLM encodes a completion prompt: special tokens added (``add_special_tokens=True``).
The ``tokenizers`` package is the optional extra ``text`` (``pip install 'trio-sidecar[text]'``).

The mock server uses the same loader: with a model directory holding a tokenizer, it accepts text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from ..core.errors import InvalidArgument

__all__ = ["EXTRA", "Encoder", "load_tokenizer", "local_tokenizer"]

#: The optional extra that brings the tokenizer.
EXTRA = "trio-sidecar[text]"


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


class _Encoder:
    """A ``tokenizers.Tokenizer`` encoding as vLLM encodes a completion prompt."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=True).ids
        return ids


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        return None
    return tokenizers


def local_tokenizer(model_id: str) -> Encoder | None:
    """The tokenizer of a local model directory (``tokenizer.json``), or ``None`` when ``model_id`` is not
    such a directory or the ``tokenizers`` package is missing."""
    path = Path(model_id) / "tokenizer.json"
    module = _tokenizers()
    if module is None or not path.is_file():
        return None
    return _Encoder(module.Tokenizer.from_file(str(path)))


def load_tokenizer(model_id: str) -> Encoder:
    """The tokenizer of ``model_id``: a local directory's ``tokenizer.json``, else the Hugging Face model of
    that name.

    Raises:
        InvalidArgument: the ``tokenizers`` package is missing (the message names the extra), or the
            tokenizer cannot be loaded (the message says why).
    """
    module = _tokenizers()
    if module is None:
        raise InvalidArgument(
            "vLLM does not accept text prompts (supports_text_input is false) and tokenizing them locally "
            f"needs the `tokenizers` package: pip install '{EXTRA}'"
        )
    try:
        found = local_tokenizer(model_id)
        if found is not None:
            return found
        return _Encoder(module.Tokenizer.from_pretrained(model_id))
    except Exception as exc:  # (tokenizers raises plain Exceptions for missing files and hub errors)
        raise InvalidArgument(f"cannot load the tokenizer of model '{model_id}': {exc}") from None
