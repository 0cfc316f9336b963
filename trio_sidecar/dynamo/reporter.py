"""Reporting for humans: startup phases, signs of life while a step waits, the discovered model and the ready
line; rich on a TTY, plain log records otherwise."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio

from ..core.errors import format_duration
from ..shell.diagnostics import round_duration
from ..shell.progress import StartupProgress
from ..transport import collapse_single_exception

if TYPE_CHECKING:
    from rich.console import Console

    from ..core.model import DiscoveredModel, EngineConfig
    from ..core.routing import KvEventSource
    from .plan import WorkerPlan

__all__ = ["Reporter", "TICK_INTERVAL"]

LOGGER = logging.getLogger("trio_sidecar.dynamo.worker")

# Signs of life while a startup step waits (plain log lines; a TTY gets a live status instead).
TICK_INTERVAL = 10.0


class _Ticker:
    """The "still waiting" line of one startup step (see :meth:`Reporter.waiting`)."""

    def __init__(
        self,
        console: Console | None,
        what: str,
        deadline: float | None,
        progress: StartupProgress | None,
        hint: str | None,
    ) -> None:
        self._console = console
        self._what = what
        self._deadline = deadline
        self._progress = progress
        self._hint = hint
        self._started = time.monotonic()
        self._scope = trio.CancelScope()
        self._done = trio.Event()

    def text(self) -> str:
        line = f"still waiting for {self._what}: {format_duration(int(time.monotonic() - self._started))}"
        if self._deadline is not None:
            line += f" of {format_duration(self._deadline)}"
        progress = self._progress
        if progress is not None:
            if progress.attempts:
                plural = "s" if progress.attempts != 1 else ""
                line += f", {progress.attempts} failed attempt{plural}, last: {progress.last_cause}"
            else:
                line += ", no failed attempt yet"
        if self._hint:
            line += f" ({self._hint})"
        return line

    async def run(self) -> None:
        try:
            with self._scope:
                if self._console is not None:
                    with self._console.status(f"waiting for {self._what}") as status:
                        while True:
                            await trio.sleep(0.5)
                            status.update(self.text())
                else:
                    while True:
                        await trio.sleep(TICK_INTERVAL)
                        LOGGER.info("%s", self.text())
        finally:
            self._done.set()

    async def stop(self) -> None:
        """Stop the line and wait until it is gone (the live status must not overlap later output)."""
        self._scope.cancel()
        await self._done.wait()


class Reporter:
    """Startup phases, the discovered model and the ready line: rich on a TTY, plain log records otherwise."""

    def __init__(self, *, rich_output: bool | None = None) -> None:
        if rich_output is None:
            from .._logging import rich_wanted

            rich_output = rich_wanted()
        self.rich = rich_output
        self._console: Console | None = None
        if self.rich:
            from rich.console import Console

            self._console = Console(stderr=True, highlight=False)
        self._phase_started = 0.0

    def phase(self, name: str, deadline: float | None = None) -> None:
        self._phase_started = time.monotonic()
        bound = f" (deadline {format_duration(deadline)})" if deadline is not None else ""
        if self._console is not None:
            self._console.print(f"[bold cyan]▶[/] {name}{bound}")
        else:
            LOGGER.info("%s%s: started", name, bound)

    def phase_done(self, name: str) -> None:
        elapsed = format_duration(round_duration(time.monotonic() - self._phase_started))
        if self._console is not None:
            self._console.print(f"  [green]✓[/] {name} in {elapsed}")
        else:
            LOGGER.info("%s: done in %s", name, elapsed)

    @asynccontextmanager
    async def waiting(
        self,
        what: str,
        deadline: float | None = None,
        *,
        progress: StartupProgress | None = None,
        hint: str | None = None,
    ) -> AsyncIterator[_Ticker]:
        """Signs of life while a startup step waits: a line every :data:`TICK_INTERVAL` (plain logs) or a
        live status line (TTY) with the elapsed time against the deadline, the failed attempts and the last
        cause. Ends with the block, or earlier with ``await ticker.stop()``."""
        ticker = _Ticker(self._console, what, deadline, progress, hint)
        with collapse_single_exception():  # the ticker never fails: the body's error surfaces as itself
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ticker.run)
                try:
                    yield ticker
                finally:
                    with trio.CancelScope(shield=True):
                        await ticker.stop()

    def model_table(
        self, model: DiscoveredModel, engine: EngineConfig, plan: WorkerPlan, sources: Sequence[KvEventSource]
    ) -> None:
        rows = _model_rows(model, engine, plan, sources)
        if self._console is not None:
            from rich.table import Table

            table = Table(title="Discovered vLLM model", show_header=False, title_justify="left")
            table.add_column(style="bold")
            table.add_column()
            for key, value in rows:
                table.add_row(key, value)
            self._console.print(table)
        else:
            LOGGER.info("discovered vLLM model: %s", "; ".join(f"{k}: {v}" for k, v in rows))

    def ready(self, plan: WorkerPlan) -> None:
        text = f"ready: serving `{plan.served_model_name}` on dyn://{plan.endpoint_path} ({plan.worker_type})"
        if self._console is not None:
            self._console.print(f"[bold green]✔ {text}[/]", markup=True)
        else:
            LOGGER.info(text)


def _model_rows(
    model: DiscoveredModel, engine: EngineConfig, plan: WorkerPlan, sources: Sequence[KvEventSource]
) -> list[tuple[str, str]]:
    def show(value: object) -> str:
        return "-" if value is None else str(value)

    info = model.server_info
    return [
        ("model", engine.model),
        ("served name", engine.served_model_name),
        ("aliases", ", ".join(engine.aliases) or "-"),
        ("engine", f"{info.engine_version or '?'} (instance {info.instance_id or '?'})"),
        ("context length", show(engine.context_length)),
        ("KV block size", show(engine.kv_cache_block_size)),
        ("total KV blocks", show(engine.total_kv_blocks)),
        ("max seqs", show(engine.max_num_seqs)),
        ("max batched tokens", show(engine.max_num_batched_tokens)),
        ("DP size", show(model.data_parallel_size())),
        ("KV events", ", ".join(f"{s.dp_rank}:{s.endpoint}" for s in sources) or "-"),
        ("endpoint", f"dyn://{plan.endpoint_path}"),
        ("worker type", plan.worker_type),
    ]
