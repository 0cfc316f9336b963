"""Deterministic synthetic generation for the mock server (docs/reference/mock.md#deterministic-generation, docs/reference/mock.md#termination). PURE: no I/O, no Trio.

Theory of operation
-------------------
Everything a request produces is a function of values the client controls, so tests can predict it:

* ``blake3(seed as u64 LE ‖ request_id UTF-8)`` gives a 32-byte digest. Its first 16 bytes, with the UUID
  version/variant bits forced, are the **request UUID** (the scheduler's key; ``Abort`` maps ids the same way).
  Its first 8 bytes as a little-endian u64 are the **token seed**.
* With engine argument ``token_seed_source = "prompt"`` (docs/reference/mock.md#token-seed-and-request-uuid) the token seed comes from
  ``blake3(seed as u64 LE ‖ prompt ids as u32 LE)`` instead, so the same prompt always yields the same tokens
  whatever the request id. The UUID still comes from the request id.
* Token ``p`` is splitmix64's finaliser over ``token_seed + p × golden ratio``, folded into [1000, 32000).
  Positions are independent, so the output plan (its length already cut by stop tokens and the context
  cap) is decided up front and handed to the scheduler as a :class:`TokenPlan`, which computes each token
  when it is read.
* Text, logprobs and candidates are synthetic functions of the token id (docs/reference/mock.md#text-logprobs-and-candidates); the protobuf pieces of the
  responses are built here too, so the server only moves them.
* Engine argument ``text_mode = "bytes"`` replaces the ``<token:{id}>`` text by a byte-level one
  (:func:`token_bytes`, :class:`ByteDetokenizer`): each token is one to three bytes of UTF-8, some of them
  pieces of multi-byte characters, and the text of each message is what vLLM's incremental detokenizer
  would send: ``""`` while the text decoded so far ends with an incomplete character (U+FFFD), then the
  completed characters; at the finish the bytes still held back are flushed (an incomplete tail as U+FFFD).
"""

from __future__ import annotations

import uuid as _uuid
from collections.abc import Iterable, Iterator, Sequence

import attrs
from blake3 import blake3

from trio_sidecar._proto.vllm import inference_pb2 as pb
from trio_sidecar.core.status import StatusCode

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "MAX_CANDIDATES",
    "MAX_NEW_TOKENS_LIMIT",
    "CandidateSpec",
    "OutputPlan",
    "RequestRejected",
    "TokenPlan",
    "ByteDetokenizer",
    "build_prompt_info",
    "build_sequence_output",
    "candidates_for",
    "fill_sequence_output",
    "plan_output",
    "planned_tokens",
    "prompt_token_seed",
    "request_uuid",
    "token_at",
    "token_logprob",
    "token_seed",
    "token_bytes",
    "token_text",
]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB

TOKEN_BASE = 1000
TOKEN_SPAN = 31000
DEFAULT_MAX_NEW_TOKENS = 20  # StoppingCriteria.max_new_tokens == 0 means this (docs/reference/wire.md#default-values)
MAX_NEW_TOKENS_LIMIT = 32768  # the upstream stack's limit (docs/reference/mock.md#request-validation row 16)
MAX_CANDIDATES = (
    20  # per position; more are truncated, not rejected (docs/reference/mock.md#text-logprobs-and-candidates)
)

FinishReason = pb.FinishInfo.FinishReason


class RequestRejected(Exception):
    """A request the mock refuses: the gRPC status and the exact message the client receives.

    Raised by the pure request model (validation, handoff, multimodal); the server turns it into the RPC
    status at its edge. ``str(err)`` is the message.
    """

    def __init__(self, code: StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"RequestRejected({self.code.name}, {self.message!r})"


# --- identity and seeds (docs/reference/mock.md#token-seed-and-request-uuid) ------------------------------------------------------------------------


def _digest(seed: int, request_id: str) -> bytes:
    return blake3((seed & _MASK64).to_bytes(8, "little") + request_id.encode("utf-8")).digest()


def request_uuid(seed: int, request_id: str) -> str:
    """The request UUID of docs/reference/mock.md#token-seed-and-request-uuid: the digest's first 16 bytes with the version-4 and RFC 4122 variant bits."""
    b = bytearray(_digest(seed, request_id)[:16])
    b[6] = (b[6] & 0x0F) | 0x40
    b[8] = (b[8] & 0x3F) | 0x80
    return str(_uuid.UUID(bytes=bytes(b)))


def token_seed(seed: int, request_id: str) -> int:
    """The token seed of docs/reference/mock.md#token-seed-and-request-uuid: the raw digest's first 8 bytes as a little-endian u64."""
    return int.from_bytes(_digest(seed, request_id)[:8], "little")


def prompt_token_seed(seed: int, prompt: Iterable[int]) -> int:
    """The token seed for ``token_seed_source = "prompt"`` (docs/reference/mock.md#token-seed-and-request-uuid).

    ``blake3(seed as u64 LE ‖ each prompt id as u32 LE)``, first 8 bytes little-endian.
    """
    hasher = blake3((seed & _MASK64).to_bytes(8, "little"))
    hasher.update(b"".join(int(t).to_bytes(4, "little") for t in prompt))
    return int.from_bytes(hasher.digest()[:8], "little")


# --- tokens (docs/reference/mock.md#tokens) ------------------------------------------------------------------------------------


def token_at(seed_value: int, position: int) -> int:
    """The planned token at 0-based ``position`` for a token seed (splitmix64, wrapping u64)."""
    v = (seed_value + position * _GOLDEN) & _MASK64
    v = ((v ^ (v >> 30)) * _MIX1) & _MASK64
    v = ((v ^ (v >> 27)) * _MIX2) & _MASK64
    v ^= v >> 31
    return TOKEN_BASE + (v & 0xFFFFFFFF) % TOKEN_SPAN


def planned_tokens(seed: int, request_id: str, n: int) -> list[int]:
    """The first ``n`` tokens the mock plans for ``request_id`` under ``seed`` (request-id seeding)."""
    s = token_seed(seed, request_id)
    return [token_at(s, p) for p in range(n)]


class TokenPlan(Sequence[int]):
    """The planned output tokens of one request, computed on access.

    Positions are independent (docs/reference/mock.md#tokens), so a plan is just ``(token seed, length)``: creating one costs
    nothing and holds no per-token memory, however large ``max_new_tokens`` is. Indexing and slicing
    behave like a tuple's.
    """

    __slots__ = ("_length", "_seed")

    def __init__(self, seed_value: int, length: int) -> None:
        self._seed = seed_value
        self._length = length

    @property
    def seed(self) -> int:
        """The token seed: token ``p`` is ``token_at(seed, p)``."""
        return self._seed

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        if isinstance(index, slice):
            return tuple(token_at(self._seed, p) for p in range(*index.indices(self._length)))
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError("token plan index out of range")
        return token_at(self._seed, index)

    def __iter__(self) -> Iterator[int]:
        seed_value = self._seed
        return (token_at(seed_value, p) for p in range(self._length))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenPlan):
            return (self._seed, self._length) == (other._seed, other._length)
        if isinstance(other, Sequence) and not isinstance(other, str):
            return len(other) == self._length and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to tuples, so not hashable consistently

    def __repr__(self) -> str:
        head = ", ".join(str(t) for t in self[:5])
        more = ", …" if self._length > 5 else ""
        return f"TokenPlan([{head}{more}], len={self._length})"


@attrs.frozen(eq=False)
class OutputPlan:
    """What the scheduler will emit for one request, decided up front (docs/reference/mock.md#termination)."""

    tokens: Sequence[int]
    finish_reason: pb.FinishInfo.FinishReason  # FinishReason.LENGTH or FinishReason.STOP
    stop_token_id: int | None = None
    eos_token_id: int | None = None  # a scripted completion's EOS (docs/reference/mock.md#scripted-completions)


def plan_output(
    seed_value: int, max_tokens: int, min_tokens: int = 0, stop_token_ids: Iterable[int] = ()
) -> OutputPlan:
    """Plan the output: ``max_tokens`` tokens ending ``LENGTH``, or cut after the first stop token.

    A stop token counts only from position ``min_tokens`` on (vLLM masks stop tokens until the minimum);
    the matching token itself is emitted and the terminal is ``STOP`` with ``stop_token_id``. Stop ids
    outside the mock's token range can never match, so they cost no scan (frontends routinely send the
    model's EOS ids).
    """
    stops = {t for t in stop_token_ids if TOKEN_BASE <= t < TOKEN_BASE + TOKEN_SPAN}
    if stops:
        for p in range(min_tokens, max_tokens):
            token = token_at(seed_value, p)
            if token in stops:
                return OutputPlan(TokenPlan(seed_value, p + 1), FinishReason.STOP, token)
    return OutputPlan(TokenPlan(seed_value, max_tokens), FinishReason.LENGTH)


# --- text, logprobs, candidates (docs/reference/mock.md#text-logprobs-and-candidates) ----------------------------------------------------------------


def token_text(token: int) -> str:
    return f"<token:{token}>"


# text_mode "bytes": what a token is, by ``token % 8``. Random tokens make a mix of ASCII, whole two-byte
# characters, lead bytes whose character a later continuation byte completes, and stray continuation bytes
# (invalid: U+FFFD), like the partial-UTF-8 byte tokens of a byte-level BPE vocabulary.
_ASCII = b"abcdefghijklmnopqrstuvwxyz "


def token_bytes(token: int) -> bytes:
    """The UTF-8 bytes of ``token`` in ``text_mode = "bytes"`` (a pure function of the id)."""
    kind, value = token % 8, token >> 3
    if kind < 2:  # an ASCII letter or space
        return _ASCII[value % len(_ASCII) : value % len(_ASCII) + 1]
    if kind == 2:  # a whole two-byte character, U+00E0..U+00FF
        return chr(0xE0 + value % 32).encode()
    if kind == 3:  # the lead byte of a two-byte character (U+00C0..U+00FF): a continuation completes it
        return b"\xc3"
    if kind == 4:  # the first two bytes of a three-byte CJK character: a continuation completes it
        return bytes((0xE4, 0xB8 + value % 4))
    return bytes((0x80 + value % 64,))  # a continuation byte


class ByteDetokenizer:
    """One request's incremental detokenizer for ``text_mode = "bytes"``, with vLLM's rule: the text of a
    message is ``""`` while everything not sent yet decodes to a text ending with U+FFFD (an incomplete
    character, or an invalid byte that more bytes may still explain), else all of it; :meth:`finish`
    flushes what is held back (decoded with U+FFFD replacements)."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def step(self, tokens: Iterable[int]) -> str:
        """The text of the message that carries ``tokens``."""
        pending = self._pending + b"".join([token_bytes(t) for t in tokens])
        text = pending.decode("utf-8", "replace")
        if not text or text.endswith("\ufffd"):
            self._pending = pending
            return ""
        self._pending = b""
        return text

    def finish(self) -> str:
        """The held-back bytes, decoded (an incomplete tail as U+FFFD); nothing is held back afterwards."""
        pending, self._pending = self._pending, b""
        return pending.decode("utf-8", "replace")


def token_logprob(token: int) -> float:
    """Synthetic logprob: ``−0.1 × ((id mod 10) + 1)``; the rank is always 1."""
    return -0.1 * ((token % 10) + 1)


@attrs.frozen
class CandidateSpec:
    """A decoded ``CandidateTokens`` selector: ``kind`` is ``"top_n"``, ``"token_ids"`` or ``"all"``."""

    kind: str
    top_n: int = 0
    token_ids: tuple[int, ...] = ()

    @classmethod
    def from_proto(cls, msg: pb.CandidateTokens) -> CandidateSpec | None:
        which = msg.WhichOneof("select")
        if which == "top_n":
            return cls("top_n", top_n=msg.top_n) if msg.top_n > 0 else None
        if which == "token_ids":
            ids = tuple(msg.token_ids.ids[:MAX_CANDIDATES])
            return cls("token_ids", token_ids=ids) if ids else None
        if which == "all" and msg.all:
            return cls("all")
        return None


def candidates_for(token: int, logprob: float, spec: CandidateSpec | None) -> list[tuple[int, float, int]]:
    """The candidate list ``(id, logprob, rank)`` for a selected token (docs/reference/mock.md#text-logprobs-and-candidates with docs/reference/sidecar.md#per-message-checks).

    ``top_n = n`` matches real vLLM: the sampled token first (rank 1, its own logprob), then the next
    ``n − 1`` synthetic ids. ``token_ids`` and ``all`` list synthetic alternatives only: candidate ``i``
    has logprob ``L − 0.1 × (i + 1)`` and rank ``i + 2``. At most 20 entries.
    """
    if spec is None:
        return []
    if spec.kind == "top_n":
        n = min(spec.top_n, MAX_CANDIDATES)
        out = [(token, logprob, 1)]
        out.extend((token + 1 + i, logprob - 0.1 * (i + 1), i + 2) for i in range(n - 1))
        return out
    ids = spec.token_ids if spec.kind == "token_ids" else tuple(token + 1 + i for i in range(MAX_CANDIDATES))
    return [(cid, logprob - 0.1 * (i + 1), i + 2) for i, cid in enumerate(ids[:MAX_CANDIDATES])]


def _candidate_info(cands: Sequence[tuple[int, float, int]]) -> pb.CandidateTokenInfo:
    info = pb.CandidateTokenInfo()
    for cid, lp, rank in cands:
        info.tokens.add(id=cid, logprob=lp, rank=rank)
    return info


@attrs.frozen
class OutputOptions:
    """The ``ResponseOptions`` that shape each ``SequenceOutput``."""

    text: bool = True
    token_ids: bool = False
    logprobs: bool = False
    candidates: CandidateSpec | None = None
    candidates_requested: bool = False

    @classmethod
    def from_proto(cls, response: pb.ResponseOptions) -> OutputOptions:
        has_candidates = response.HasField("output_candidates")
        return cls(
            text=response.output_text if response.HasField("output_text") else True,
            token_ids=response.output_token_ids,
            logprobs=response.output_logprobs,
            candidates=CandidateSpec.from_proto(response.output_candidates) if has_candidates else None,
            candidates_requested=has_candidates,
        )


def fill_sequence_output(
    out: pb.SequenceOutput, tokens: Sequence[int], options: OutputOptions, text: str | None = None
) -> None:
    """Fill an empty ``SequenceOutput`` in place (no copy: the hot path of streaming). ``text``: the text
    when the options ask for it (``text_mode = "bytes"``: the detokenizer's); ``None``: the tokens' tags."""
    out.num_tokens = len(tokens)
    if options.text:
        out.text = "".join([f"<token:{t}>" for t in tokens]) if text is None else text
    if options.token_ids:
        out.token_ids.extend(tokens)
    if options.logprobs or options.candidates_requested:
        for t in tokens:
            lp = token_logprob(t)
            if options.logprobs:
                out.logprobs.append(lp)
                out.ranks.append(1)
            out.candidate_tokens.append(_candidate_info(candidates_for(t, lp, options.candidates)))


def build_sequence_output(tokens: Sequence[int], options: OutputOptions, text: str | None = None) -> pb.SequenceOutput:
    """One ``SequenceOutput`` delta carrying ``tokens`` as the options ask (no ``finish_info``)."""
    out = pb.SequenceOutput()
    fill_sequence_output(out, tokens, options, text)
    return out


def build_prompt_info(prompt: Sequence[int], response: pb.ResponseOptions) -> pb.PromptInfo:
    """``PromptInfo`` of docs/reference/mock.md#prompt-info: the count, and ids/logprobs/ranks/candidates when asked."""
    info = pb.PromptInfo(num_prompt_tokens=len(prompt))
    if response.prompt_token_ids or response.prompt_logprobs:
        info.token_ids.extend(prompt)
    if response.prompt_logprobs:
        spec = CandidateSpec.from_proto(response.prompt_candidates) if response.HasField("prompt_candidates") else None
        for p, t in enumerate(prompt):
            if p == 0:
                info.logprobs.append(0.0)
                info.ranks.append(0)
                info.candidate_tokens.add()
                continue
            lp = token_logprob(t)
            info.logprobs.append(lp)
            info.ranks.append(1)
            info.candidate_tokens.append(_candidate_info(candidates_for(t, lp, spec)))
    return info
