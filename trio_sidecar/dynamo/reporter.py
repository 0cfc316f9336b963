"""Reporting for humans: startup phases, the discovered model and the ready line; rich on a TTY, plain log
records otherwise."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import format_duration

if TYPE_CHECKING:
    from rich.console import Console

    from ..model import DiscoveredModel, EngineConfig
    from ..routing import KvEventSource
    from .plan import WorkerPlan

__all__ = ["Reporter"]

LOGGER = logging.getLogger("trio_sidecar.dynamo.worker")


class Reporter:
    """Startup phases, the discovered model and the ready line: rich on a TTY, plain log records otherwise."""

    def __init__(self, *, rich_output: bool | None = None) -> None:
        if rich_output is None:
            rich_output = sys.stderr.isatty()
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
            LOGGER.info("phase=%s%s", name.replace(" ", "_"), f" deadline={format_duration(deadline)}" if deadline else "")

    def phase_done(self, name: str) -> None:
        elapsed = format_duration(round(time.monotonic() - self._phase_started, 3))
        if self._console is not None:
            self._console.print(f"  [green]✓[/] {name} in {elapsed}")
        else:
            LOGGER.info("phase=%s done elapsed=%s", name.replace(" ", "_"), elapsed)

    def model_table(self, model: DiscoveredModel, engine: EngineConfig, plan: WorkerPlan,
                    sources: Sequence[KvEventSource]) -> None:
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
            LOGGER.info("model %s", " ".join(f"{k.replace(' ', '_')}={v}" for k, v in rows))

    def ready(self, plan: WorkerPlan) -> None:
        text = f"ready: serving `{plan.served_model_name}` on dyn://{plan.endpoint_path} ({plan.worker_type})"
        if self._console is not None:
            self._console.print(f"[bold green]✔ {text}[/]", markup=True)
        else:
            LOGGER.info(text)


def _model_rows(model: DiscoveredModel, engine: EngineConfig, plan: WorkerPlan,
                sources: Sequence[KvEventSource]) -> list[tuple[str, str]]:
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
