"""Scripted completions for the mock (docs/reference/mock.md#scripted-completions). No Trio; only
:func:`load_scripts` reads files (the model directory's tokenizer, once at startup).

Theory of operation
-------------------
Engine argument ``scripted_completions`` lists ``{"prompt_contains": ..., "text": ...}`` entries. A request whose
prompt, decoded with the model's tokenizer, contains an entry's ``prompt_contains`` (the first match wins; an
empty or missing one matches every prompt) is answered with that entry's ``text`` instead of synthetic tokens,
as a model that generated exactly this text would answer:

* the tokens are the text encoded with the model's tokenizer (no special tokens added), followed by the
  model's EOS token; the EOS ends the request with ``STOP`` and ``eos_token_id``, as vLLM reports it, unless
  the request ignores EOS or has not reached ``min_new_tokens`` yet, in which case the EOS is an ordinary
  token and the script starts again;
* ``max_new_tokens`` (and the context cap) cut the output with ``LENGTH``; a stop token id of the request
  ends it with ``STOP`` and ``stop_token_id``, as for synthetic tokens;
* the text of each message is what vLLM's incremental detokenizer sends: the new text of the decoded prefix,
  ``""`` while that prefix ends with an incomplete character (U+FFFD), the held-back rest at the finish;
  special tokens are skipped unless the request sets ``skip_special_tokens`` false, and the text of the EOS
  that ends a request is never sent (vLLM drops a stop token's text).

Everything is computed once per script when the server starts (both ``skip_special_tokens`` variants), so a
request only walks positions.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import attrs

from trio_sidecar._proto.vllm import inference_pb2 as pb

__all__ = ["Script", "ScriptedOutput", "ScriptedText", "Scripts", "TokenizerLike", "build_scripts", "load_scripts"]

FinishReason = pb.FinishInfo.FinishReason


class TokenizerLike(Protocol):
    """What the scripts need of a ``tokenizers.Tokenizer``."""

    def encode(self, sequence: Any, *, add_special_tokens: bool = ...) -> Any: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...


@attrs.frozen
class _Texts:
    """Per cycle position: the text sent with the token, and the text still held back after it."""

    pieces: tuple[str, ...]
    held: tuple[str, ...]


def _detokenize(tokenizer: TokenizerLike, ids: Sequence[int], skip_special_tokens: bool) -> _Texts:
    pieces, held = [], []
    sent = ""
    for end in range(1, len(ids) + 1):
        full = tokenizer.decode(list(ids[:end]), skip_special_tokens=skip_special_tokens)
        if full.endswith("\ufffd") or not full.startswith(sent):
            pieces.append("")
        else:
            pieces.append(full[len(sent) :])
            sent = full
        held.append(full[len(sent) :] if full.startswith(sent) else "")
    return _Texts(tuple(pieces), tuple(held))


@attrs.frozen
class Script:
    """One entry: its prompt test and its tokens (the text's, then the EOS when the model has one)."""

    prompt_contains: str
    text: str
    tokens: tuple[int, ...]
    eos_token_id: int | None
    _skip: _Texts
    _keep: _Texts

    def texts(self, skip_special_tokens: bool) -> _Texts:
        return self._skip if skip_special_tokens else self._keep


@attrs.frozen
class ScriptedOutput:
    """A request's scripted plan: its tokens and terminal, and a factory of its detokenizer."""

    tokens: tuple[int, ...]
    finish_reason: pb.FinishInfo.FinishReason
    stop_token_id: int | None
    eos_token_id: int | None
    script: Script
    skip_special_tokens: bool

    def detokenizer(self) -> ScriptedText:
        # vLLM never sends the text of the token that stopped the request (EOS or a stop token id).
        stopped = self.finish_reason == FinishReason.STOP
        return ScriptedText(
            self.script.texts(self.skip_special_tokens), len(self.script.tokens), len(self.tokens), stopped
        )


class ScriptedText:
    """One request's text, message by message (the interface of ``generation.ByteDetokenizer``)."""

    __slots__ = ("_cycle", "_length", "_position", "_stopped", "_texts")

    def __init__(self, texts: _Texts, cycle: int, length: int, stopped: bool) -> None:
        self._texts = texts
        self._cycle = cycle
        self._length = length
        self._stopped = stopped
        self._position = 0

    def step(self, tokens: Iterable[int]) -> str:
        """The text of the message that carries ``tokens`` (the next positions of the plan)."""
        out = []
        for _ in tokens:
            if not (self._stopped and self._position == self._length - 1):
                out.append(self._texts.pieces[self._position % self._cycle])
            self._position += 1
        return "".join(out)

    def finish(self) -> str:
        """The text held back after the last token sent (before the stop token, when one ended the request)."""
        last = self._position - (2 if self._stopped and self._position == self._length else 1)
        return self._texts.held[last % self._cycle] if last >= 0 else ""


@attrs.frozen
class Scripts:
    """The server's scripts, matched against each request's decoded prompt."""

    tokenizer: TokenizerLike = attrs.field(eq=False)
    scripts: tuple[Script, ...]

    def match(
        self,
        prompt: Sequence[int],
        *,
        max_tokens: int,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        stop_token_ids: Iterable[int] = (),
        skip_special_tokens: bool = True,
    ) -> ScriptedOutput | None:
        """The scripted output for ``prompt``, or ``None`` when no entry matches."""
        decoded = self.tokenizer.decode(list(prompt), skip_special_tokens=False)
        script = next((s for s in self.scripts if s.prompt_contains in decoded), None)
        if script is None:
            return None
        stops = set(stop_token_ids)
        cycle = script.tokens
        out: list[int] = []
        for position in range(max_tokens):
            token = cycle[position % len(cycle)]
            out.append(token)
            if token == script.eos_token_id and not ignore_eos and position >= min_tokens:
                return ScriptedOutput(tuple(out), FinishReason.STOP, None, token, script, skip_special_tokens)
            if token in stops and position >= min_tokens:
                return ScriptedOutput(tuple(out), FinishReason.STOP, token, None, script, skip_special_tokens)
        return ScriptedOutput(tuple(out), FinishReason.LENGTH, None, None, script, skip_special_tokens)


def build_scripts(entries: Sequence[tuple[str, str]], tokenizer: TokenizerLike, eos_token_id: int | None) -> Scripts:
    """Tokenize and detokenize every ``(prompt_contains, text)`` entry once."""
    scripts = []
    for prompt_contains, text in entries:
        ids = list(tokenizer.encode(text, add_special_tokens=False).ids)
        if eos_token_id is not None:
            ids.append(eos_token_id)
        if not ids:
            raise ValueError("a scripted completion needs a text or a model with an EOS token")
        scripts.append(
            Script(
                prompt_contains,
                text,
                tuple(ids),
                eos_token_id,
                _detokenize(tokenizer, ids, True),
                _detokenize(tokenizer, ids, False),
            )
        )
    return Scripts(tokenizer, tuple(scripts))


def load_scripts(entries: Sequence[tuple[str, str]], model: str) -> Scripts:
    """:func:`build_scripts` with the tokenizer (``tokenizer.json``) and EOS id of the model directory.

    The EOS id is ``eos_token_id`` of ``generation_config.json``, else of ``config.json`` (the first of a
    list), else the id of ``tokenizer_config.json``'s ``eos_token``; a model without one gets no EOS.

    Raises:
        ValueError: the tokenizer cannot be loaded (the message says why).
    """
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("scripted completions need the `tokenizers` package (pip install tokenizers)") from None
    path = os.path.join(model, "tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exceptions
        raise ValueError(f"scripted completions need the model's tokenizer: cannot load {path}: {exc}") from None
    return build_scripts(entries, tokenizer, _eos_token_id(model, tokenizer))


def _eos_token_id(model: str, tokenizer: TokenizerLike) -> int | None:
    for name in ("generation_config.json", "config.json"):
        value = _json_field(os.path.join(model, name), "eos_token_id")
        if isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    token = _json_field(os.path.join(model, "tokenizer_config.json"), "eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str):
        return tokenizer.token_to_id(token)
    return None


def _json_field(path: str, key: str) -> object:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data.get(key) if isinstance(data, dict) else None
