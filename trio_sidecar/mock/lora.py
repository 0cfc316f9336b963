"""The mock's LoRA adapter table (``Control.LoadLora`` / ``UnloadLora`` / ``ListLoras`` and ``lora_name`` on
generate requests, docs/reference/mock.md#lora-adapters) — pure: no I/O, no Trio.

The texts and codes are vLLM 0.32's, as its gRPC server answered them (docs/reference/mock.md#lora-adapters
says which were observed on the real server and which are the mock's own). The mock never reads the
adapter: ``source_path`` is only checked for being non-empty, and an adapter changes nothing in the
generated tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs

from trio_sidecar.core.status import StatusCode
from trio_sidecar.mock.generation import RequestRejected

__all__ = ["LORA_DISABLED", "LoraAdapter", "LoraTable", "lora_disabled"]

#: vLLM's text when LoRA is not enabled (the engine was started without ``--enable-lora``).
LORA_DISABLED = "engine was not started with LoRA enabled"


def lora_disabled() -> RequestRejected:
    return RequestRejected(StatusCode.FAILED_PRECONDITION, LORA_DISABLED)


def _not_loaded(name: str) -> RequestRejected:
    return RequestRejected(StatusCode.NOT_FOUND, f"LoRA adapter `{name}` is not loaded")


@attrs.frozen
class LoraAdapter:
    """One loaded adapter: vLLM's ``LoraAdapter`` message (``lora_id`` counts from 1 and is never reused)."""

    lora_id: int
    lora_name: str
    source_path: str


class LoraTable:
    """The adapters loaded on one server, in load order.

    ``max_loras == 0`` means LoRA is disabled: every operation fails as vLLM's does without
    ``--enable-lora``. Otherwise it does not limit the table: vLLM's ``--max-loras`` bounds the adapters
    used in one batch, and the real server loads more.

    What it does limit is the engine's cache of adapters in memory (``--max-cpu-loras``, which defaults to
    ``max_loras``): loading an adapter, or a request using one, puts it in the cache and evicts the least
    recently used one beyond ``max_loras``. A request for an evicted adapter brings it back, but
    ``UnloadLora`` of an evicted adapter fails, and the adapter stays listed, until a request uses it again.
    The table keeps that cache too (``resident``), to answer as vLLM does.

    Methods raise :class:`~trio_sidecar.mock.generation.RequestRejected` with the status and text the
    client receives.
    """

    def __init__(self, max_loras: int, base_model_names: tuple[str, ...]) -> None:
        self.max_loras = max_loras
        self._base_names = frozenset(base_model_names)
        self._adapters: dict[str, LoraAdapter] = {}
        self._next_id = 1
        #: The engine's adapter cache, least recently used first (names; a subset of the table).
        self._resident: list[str] = []

    @property
    def enabled(self) -> bool:
        return self.max_loras > 0

    def __iter__(self) -> Iterator[LoraAdapter]:
        return iter(list(self._adapters.values()))

    def __len__(self) -> int:
        return len(self._adapters)

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def load(self, name: str, source_path: str) -> LoraAdapter:
        """``LoadLora``: the checks in vLLM's order, then add the adapter."""
        if not self.enabled:
            raise lora_disabled()
        if not name:
            raise RequestRejected(StatusCode.INVALID_ARGUMENT, "lora_name must not be empty")
        if not source_path:
            raise RequestRejected(StatusCode.INVALID_ARGUMENT, "lora_path must not be empty")
        if name in self._base_names:
            raise RequestRejected(
                StatusCode.ALREADY_EXISTS, f"LoRA adapter `{name}` conflicts with a served base model"
            )
        if name in self._adapters:
            raise RequestRejected(StatusCode.ALREADY_EXISTS, f"LoRA adapter `{name}` is already loaded")
        adapter = LoraAdapter(self._next_id, name, source_path)
        self._next_id += 1
        self._adapters[name] = adapter
        self._use(name)
        return adapter

    @property
    def resident(self) -> tuple[str, ...]:
        """The adapters in the engine's cache, least recently used first."""
        return tuple(self._resident)

    def _use(self, name: str) -> None:
        if name in self._resident:
            self._resident.remove(name)
        self._resident.append(name)
        del self._resident[: -self.max_loras]

    def unload(self, name: str) -> LoraAdapter:
        """``UnloadLora``: vLLM checks the name before whether LoRA is enabled."""
        if not name:
            raise RequestRejected(StatusCode.INVALID_ARGUMENT, "lora_name is required")
        if not self.enabled:
            raise lora_disabled()
        adapter = self._adapters.get(name)
        if adapter is None:
            raise _not_loaded(name)
        if name not in self._resident:
            # vLLM's engine finds nothing to remove; its frontend keeps the adapter listed.
            raise RequestRejected(
                StatusCode.INTERNAL, f"engine rejected removal of LoRA adapter `{name}` with id {adapter.lora_id}"
            )
        self._resident.remove(name)
        del self._adapters[name]
        return adapter

    def list(self) -> list[LoraAdapter]:
        """``ListLoras``."""
        if not self.enabled:
            raise lora_disabled()
        return list(self._adapters.values())

    def check_request(self, name: str) -> None:
        """A generate request's ``lora_name`` (non-empty): accepted only when that adapter is loaded."""
        if not self.enabled:
            raise lora_disabled()
        if name not in self._adapters:
            raise _not_loaded(name)

    def use(self, name: str) -> None:
        """An accepted request runs with adapter ``name``: it is (back) in the engine's cache."""
        if name in self._adapters:
            self._use(name)
