"""Simulated paged KV cache of one DP rank, with prefix caching and KV events (docs/reference/mock.md#kv-cache-and-kv-events)
— pure: no I/O, no Trio.

Theory of operation
-------------------
The pool has ``num_blocks`` slots of ``block_size`` tokens. A slot is in exactly one of three states:

* **free** — never used, or released while private (only counted, no object);
* **active** — held by at least one sequence (``_Block.ref > 0``);
* **inactive** — a *registered* (content-hashed) block that no sequence holds; it still answers prefix
  lookups and is the only kind of slot that eviction reclaims.

A sequence (:class:`SeqKv`) holds a list of blocks covering its current tokens. When a block becomes full
*and computed* (:meth:`KvPool.commit`), its chained hash is computed; with prefix caching on, the block is
registered under that hash and a ``BlockStored`` event is queued — unless a block with the same hash is
already registered (two identical prompts computed concurrently, or a ``bypass_prefix_cache`` request),
in which case the new block stays private, as vLLM does with duplicates. Blocks holding generated tokens
are committed the same way.

Admission (:meth:`KvPool.admit`) looks up the longest registered prefix of the sequence (never the whole
sequence: at least one token is always recomputed, as vLLM's ``num_tokens - 1`` cap), takes a reference on
the hits (reactivating inactive ones) and allocates the rest. Its capacity rule is vLLM's: the blocks of the
current sequence must fit into free + inactive slots, where an *active* hit costs nothing and an
*inactive* hit is charged.

Allocation takes a free slot, else evicts an inactive block, leaf first (a block no registered block
names as parent), least recently released first, and queues ``BlockRemoved`` with the stored hash.
Releasing a sequence moves its registered blocks with no other holder to the inactive pool and frees its
private blocks.

Events come out in order of occurrence through :meth:`KvPool.drain_events`; consecutive stores that
continue one chain merge into one ``BlockStored``, consecutive removals into one ``BlockRemoved``.
"""

from __future__ import annotations

import heapq
import itertools
import struct
from collections.abc import Sequence

import attrs
import blake3

__all__ = ["BlockRemoved", "BlockStored", "ExtraKeys", "KvEvent", "KvPool", "MmSpan", "SeqKv", "block_hash"]

#: The extra keys of one block: ``(mm identifier, offset of the feature relative to the block start)`` pairs,
#: in feature order, as vLLM publishes them (untagged) in ``BlockStored.extra_keys``.
ExtraKeys = tuple[tuple[str, int], ...]


@attrs.frozen
class MmSpan:
    """One multimodal feature of a prompt: ``length`` tokens from ``offset``, keyed by ``identifier``."""

    offset: int
    length: int
    identifier: str


@attrs.frozen
class BlockStored:
    """Full blocks newly stored; ``token_ids`` holds ``len(block_hashes) × block_size`` ids in block order
    and ``parent_block_hash`` is the hash of the block before the first one (None for a root block)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    #: Per block, its multimodal extra keys or None; None altogether when no block has any.
    extra_keys: tuple[ExtraKeys | None, ...] | None = None


@attrs.frozen
class BlockRemoved:
    """Inactive blocks evicted; the hashes are the values that were stored."""

    block_hashes: tuple[int, ...]


KvEvent = BlockStored | BlockRemoved

_ZERO_PARENT = bytes(8)


def block_hash(parent: int | None, tokens: Sequence[int], salt: str = "", extra: ExtraKeys = ()) -> int:
    """Chained content hash of one full block (project choice, docs/reference/mock.md#kv-cache-and-kv-events).

    ``u64_le(blake3(parent as u64 LE, or 8 zero bytes for the first block ‖ tokens as u32 LE)[0:8])``;
    a non-empty cache salt is appended (UTF-8) to the *first* block's input only, so the whole chain of a
    salted prompt differs from the unsalted one. Each multimodal extra key of the block is appended as
    ``b"mm\\0" ‖ identifier (UTF-8) ‖ b"\\0" ‖ offset (i64 LE)``, so two images behind the same placeholder
    ids never share a block.
    """
    head = _ZERO_PARENT if parent is None else parent.to_bytes(8, "little")
    data = head + struct.pack(f"<{len(tokens)}I", *tokens)
    if parent is None and salt:
        data += salt.encode("utf-8")
    for identifier, offset in extra:
        data += b"mm\0" + identifier.encode("utf-8") + b"\0" + offset.to_bytes(8, "little", signed=True)
    return int.from_bytes(blake3.blake3(data).digest(length=8), "little")


def _extra_keys(spans: Sequence[MmSpan], start: int, end: int) -> ExtraKeys:
    """The features overlapping tokens ``[start, end)``, with their offsets relative to ``start``."""
    return tuple((s.identifier, s.offset - start) for s in spans if s.offset < end and start < s.offset + s.length)


class _Block:
    __slots__ = ("depth", "hash", "heap_tick", "parent", "ref", "registered")

    def __init__(self) -> None:
        self.ref = 1
        self.hash: int | None = None
        self.parent: int | None = None
        self.registered = False
        self.depth = 0
        self.heap_tick = -1  # tick of its live entry in the inactive heap; -1 when active


class SeqKv:
    """KV state of one sequence: its tokens (``prompt`` + the first ``generated`` entries of ``plan``),
    the blocks it holds, and the chained hashes of its full blocks (memoised; the content never changes,
    so they survive preemption)."""

    __slots__ = ("_blocks", "_committed", "_hashes", "bypass_prefix_cache", "mm", "plan", "prompt", "salt")

    def __init__(
        self,
        prompt: Sequence[int],
        plan: Sequence[int] = (),
        *,
        salt: str = "",
        bypass_prefix_cache: bool = False,
        mm: Sequence[MmSpan] = (),
    ) -> None:
        self.prompt = prompt
        self.plan = plan
        self.salt = salt
        self.mm = tuple(mm)
        self.bypass_prefix_cache = bypass_prefix_cache
        self._blocks: list[_Block] = []
        self._hashes: list[int] = []
        self._committed = 0  # leading held blocks already hashed (registered or private duplicates)

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def tokens(self, start: int, end: int) -> Sequence[int]:
        """Token ids at positions ``[start, end)`` of the sequence."""
        n = len(self.prompt)
        if end <= n:
            return self.prompt[start:end]
        if start >= n:
            return self.plan[start - n : end - n]
        return tuple(self.prompt[start:]) + tuple(self.plan[: end - n])

    def hash_of(self, index: int, block_size: int) -> int:
        """Chained hash of full block ``index`` (computes and memoises the chain up to it)."""
        hashes = self._hashes
        while len(hashes) <= index:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            start, end = i * block_size, (i + 1) * block_size
            hashes.append(block_hash(parent, self.tokens(start, end), self.salt, self.extra_keys(start, end)))
        return hashes[index]

    def extra_keys(self, start: int, end: int) -> ExtraKeys:
        """The multimodal extra keys of the tokens ``[start, end)`` (empty without features)."""
        return _extra_keys(self.mm, start, end) if self.mm else ()


class KvPool:
    """The paged KV pool of one rank (see the module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.total_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free = num_blocks
        self._inactive = 0
        self._registry: dict[int, _Block] = {}
        # Registered blocks naming each hash as parent (the parent itself may be unregistered).
        self._children: dict[int, int] = {}
        self._heap: list[tuple[int, int, int, _Block]] = []  # (tick, -depth, unique, block)
        self._tick = 0
        self._unique = itertools.count()
        self._events: list[tuple] = []  # (kind, hashes, parent, token ids, extra keys), see _emit_*

    # --- counters ---------------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        """Slots never used or released while private."""
        return self._free

    @property
    def inactive_blocks(self) -> int:
        """Registered blocks that no sequence holds (reusable, evictable)."""
        return self._inactive

    @property
    def active_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.total_blocks - self._free - self._inactive

    @property
    def available_blocks(self) -> int:
        """Blocks an allocation can obtain (free + evictable)."""
        return self._free + self._inactive

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def is_cached(self, block_hash_value: int) -> bool:
        """Whether a block with this hash is registered (active or inactive)."""
        return block_hash_value in self._registry

    # --- admission and growth ---------------------------------------------------------------------

    def _prefix_hits(self, seq: SeqKv, num_tokens: int) -> list[_Block]:
        if not self.enable_prefix_caching or seq.bypass_prefix_cache or num_tokens <= 1:
            return []
        hits: list[_Block] = []
        # At least one token is always computed (vLLM caps the hit at num_tokens - 1).
        for index in range((num_tokens - 1) // self.block_size):
            block = self._registry.get(seq.hash_of(index, self.block_size))
            if block is None:
                break
            hits.append(block)
        return hits

    def cached_prefix_tokens(self, seq: SeqKv, num_tokens: int) -> int:
        """Tokens :meth:`admit` would find cached right now (no side effects)."""
        return len(self._prefix_hits(seq, num_tokens)) * self.block_size

    def admit(self, seq: SeqKv, num_tokens: int) -> int | None:
        """Give a sequence that holds no blocks the blocks for its first ``num_tokens`` tokens.

        Returns the number of tokens already computed thanks to cached prefix blocks (a multiple of
        ``block_size``), or None — holding nothing — when the blocks do not fit. A sequence needing more
        blocks than the whole pool is given the whole pool (the caller rejects such prompts up front;
        this only matters for a preempted sequence that overgrew the pool).
        """
        if seq._blocks:
            raise ValueError("sequence already holds blocks")
        hits = self._prefix_hits(seq, num_tokens)
        needed = min(self.blocks_for(num_tokens), self.total_blocks)
        active_hits = sum(1 for block in hits if block.ref > 0)
        if needed - active_hits > self.available_blocks:
            return None
        for block in hits:
            self._take(block)
        seq._blocks.extend(hits)
        seq._committed = len(hits)
        self._allocate(seq, needed - len(hits))
        return len(hits) * self.block_size

    def grow(self, seq: SeqKv, num_tokens: int) -> bool:
        """Make the sequence hold the blocks for ``num_tokens`` tokens; all or nothing."""
        missing = self.blocks_for(num_tokens) - len(seq._blocks)
        if missing <= 0:
            return True
        if missing > self.available_blocks:
            return False
        self._allocate(seq, missing)
        return True

    def grow_partial(self, seq: SeqKv, num_tokens: int) -> None:
        """Like :meth:`grow`, but take what is available (a lone sequence outgrowing the pool)."""
        missing = min(self.blocks_for(num_tokens) - len(seq._blocks), self.available_blocks)
        if missing > 0:
            self._allocate(seq, missing)

    def _take(self, block: _Block) -> None:
        if block.ref == 0:  # reactivate: out of the inactive pool (its heap entry goes stale)
            self._inactive -= 1
            block.heap_tick = -1
        block.ref += 1

    def _allocate(self, seq: SeqKv, count: int) -> None:
        for _ in range(count):
            if self._free > 0:
                self._free -= 1
            else:
                self._evict_one()
            seq._blocks.append(_Block())

    # --- eviction ---------------------------------------------------------------------------------

    def _evict_one(self) -> None:
        heap = self._heap
        skipped: list[tuple[int, int, int, _Block]] = []
        victim: _Block | None = None
        while heap:
            entry = heapq.heappop(heap)
            block = entry[3]
            if block.ref > 0 or block.heap_tick != entry[0] or not block.registered:
                continue  # stale entry
            if self._children.get(block.hash, 0):  # type: ignore[arg-type]
                skipped.append(entry)  # not a leaf yet
                continue
            victim = block
            break
        if victim is None:
            if not skipped:
                raise RuntimeError("KV pool accounting error: no inactive block to evict")
            # Only non-leaves are left (possible with bypassed/duplicate chains): take the oldest.
            victim = skipped.pop(0)[3]
        for entry in skipped:
            heapq.heappush(heap, entry)
        self._unregister(victim)
        self._inactive -= 1
        victim.heap_tick = -1
        self._emit_removed(victim.hash)  # type: ignore[arg-type]

    def _unregister(self, block: _Block) -> None:
        del self._registry[block.hash]  # type: ignore[arg-type]
        block.registered = False
        if block.parent is not None:
            left = self._children[block.parent] - 1
            if left:
                self._children[block.parent] = left
            else:
                del self._children[block.parent]

    # --- commit and release -----------------------------------------------------------------------

    def commit(self, seq: SeqKv, num_computed: int) -> None:
        """Record that the sequence's first ``num_computed`` tokens have KV: hash its newly full blocks and
        (prefix caching on) register them, queueing ``BlockStored``."""
        full = min(num_computed // self.block_size, len(seq._blocks))
        if full <= seq._committed:
            return
        if not self.enable_prefix_caching:
            seq._committed = full
            return
        bs = self.block_size
        for index in range(seq._committed, full):
            block = seq._blocks[index]
            h = seq.hash_of(index, bs)
            parent = seq._hashes[index - 1] if index else None
            if h in self._registry:
                continue  # a duplicate of a registered block stays private
            block.hash = h
            block.parent = parent
            block.depth = index
            block.registered = True
            self._registry[h] = block
            if parent is not None:
                self._children[parent] = self._children.get(parent, 0) + 1
            start, end = index * bs, (index + 1) * bs
            self._emit_stored(h, parent, seq.tokens(start, end), seq.extra_keys(start, end) or None)
        seq._committed = full

    def release(self, seq: SeqKv) -> None:
        """Drop every block the sequence holds (finish, cancel or preemption)."""
        blocks = seq._blocks
        if not blocks:
            return
        self._tick += 1
        tick = self._tick
        for block in reversed(blocks):
            block.ref -= 1
            if block.ref:
                continue
            if block.registered:
                self._inactive += 1
                block.heap_tick = tick
                heapq.heappush(self._heap, (tick, -block.depth, next(self._unique), block))
            else:
                self._free += 1
        seq._blocks = []
        seq._committed = 0
        if len(self._heap) > 2 * self._inactive + 1024:
            self._heap = [e for e in self._heap if e[3].ref == 0 and e[3].heap_tick == e[0]]
            heapq.heapify(self._heap)

    # --- events -----------------------------------------------------------------------------------

    def _emit_stored(self, h: int, parent: int | None, tokens: Sequence[int], extra: ExtraKeys | None) -> None:
        # Pending events are mutable lists until drained, so merging a long chain stays linear.
        events = self._events
        if events:
            last = events[-1]
            if last[0] is BlockStored and parent is not None and last[1][-1] == parent:
                last[1].append(h)
                last[3].extend(tokens)
                last[4].append(extra)
                return
        events.append((BlockStored, [h], parent, list(tokens), [extra]))

    def _emit_removed(self, h: int) -> None:
        events = self._events
        if events and events[-1][0] is BlockRemoved:
            events[-1][1].append(h)
        else:
            events.append((BlockRemoved, [h], None, None, None))

    def drain_events(self) -> list[KvEvent]:
        """Take the events queued since the last call, in order of occurrence."""
        pending, self._events = self._events, []
        out: list[KvEvent] = []
        for kind, hashes, parent, tokens, extra in pending:
            if kind is BlockStored:
                extra_keys = tuple(extra) if any(e is not None for e in extra) else None
                out.append(BlockStored(tuple(hashes), parent, tuple(tokens), self.block_size, extra_keys))
            else:
                out.append(BlockRemoved(tuple(hashes)))
        return out

    def __repr__(self) -> str:
        return (
            f"<KvPool blocks={self.total_blocks}x{self.block_size} active={self.active_blocks} "
            f"inactive={self._inactive} free={self._free} cached={len(self._registry)}>"
        )
