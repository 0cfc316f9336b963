"""HPACK encoding and decoding cached per dynamic-table state (pure: no I/O).

Steady-state gRPC header blocks (the request line, ``:status 200``, ``grpc-status 0``) repeat, and while
the dynamic table is unchanged the same header list always encodes to the same bytes (and the same bytes
decode to the same list). ``_h2.H2Connection`` installs these in place of hpack's encoder and decoder.
"""

from __future__ import annotations

import hpack
import hpack.table

__all__ = ["CachingDecoder", "CachingEncoder"]


class _VersionedTable(hpack.table.HeaderTable):
    """An HPACK header table that counts its mutations (entries added, size changed)."""

    def __init__(self) -> None:
        super().__init__()
        self.version = 0

    def add(self, name, value):  # type: ignore[no-untyped-def]
        self.version += 1
        super().add(name, value)

    @property
    def maxsize(self):  # type: ignore[no-untyped-def]
        return self._maxsize

    @maxsize.setter
    def maxsize(self, newmax):  # type: ignore[no-untyped-def]
        self.version += 1
        hpack.table.HeaderTable.maxsize.fset(self, newmax)


_HPACK_CACHE_SIZE = 256


class CachingEncoder(hpack.Encoder):
    """Reuses the encoding of a header list while the dynamic table has not changed since.

    Encoding a list whose every header is already in the table does not touch the table and always gives
    the same bytes, and steady-state gRPC header blocks (request line, ``:status 200``, ``grpc-status 0``)
    are exactly that. About a tenth of a unary call's CPU was spent in pure-Python HPACK encoding.
    """

    def __init__(self) -> None:
        super().__init__()
        self.header_table = _VersionedTable()
        self._cache: dict = {}

    def encode(self, headers, huffman=True):  # type: ignore[no-untyped-def]
        if type(headers) is not list or not huffman:
            return super().encode(headers, huffman)
        key = tuple(headers)
        table = self.header_table
        hit = self._cache.get(key)
        if hit is not None and hit[0] == table.version and not table.resized:
            return hit[1]
        version, resized = table.version, table.resized
        block = super().encode(headers, huffman)
        if table.version == version and not resized:  # (a resize is signalled inside the block)
            if len(self._cache) >= _HPACK_CACHE_SIZE:
                self._cache.clear()
            self._cache[key] = (version, block)
        return block


class CachingDecoder(hpack.Decoder):
    """Reuses the decoding of a header block while the dynamic table has not changed since (see above)."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.header_table = _VersionedTable()
        self._cache: dict = {}

    def decode(self, data, raw=False):  # type: ignore[no-untyped-def]
        key = (bytes(data), raw)
        table = self.header_table
        hit = self._cache.get(key)
        if hit is not None and hit[0] == table.version:
            return list(hit[1])
        version = table.version
        headers = super().decode(data, raw)
        if table.version == version:
            if len(self._cache) >= _HPACK_CACHE_SIZE:
                self._cache.clear()
            self._cache[key] = (version, tuple(headers))
        return headers
