"""Live terminal view of a run: a progress bar and a per-domain table, refreshed each step."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

DOMAIN_COLUMNS = [("difficulty", "diff", "{:.0f}"), ("ratio", "ratio", "{:.2f}"), ("n", "n", "{:.0f}"),
                  ("reward_mean", "reward", "{:.2f}"), ("pass_rate", "pass", "{:.2f}"),
                  ("completion_len", "len", "{:.0f}"), ("truncation_rate", "trunc", "{:.2f}"),
                  ("tool_errors", "tool err", "{:.2f}"), ("entropy", "entropy", "{:.2f}"),
                  ("kl_ref", "kl", "{:.3f}"), ("mismatch", "|Δlogp|", "{:.1e}"), ("infra_errors", "infra", "{:.0f}")]


class RunView:
    def __init__(self, title: str, total: int, quiet: bool = False, console: Console | None = None) -> None:
        self.console = console or Console()
        self.quiet = quiet
        self.progress = Progress(TextColumn(f"[bold]{title}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                                 TimeElapsedColumn(), TimeRemainingColumn(), console=self.console)
        self.task = self.progress.add_task(title, total=total, info="")
        self.table: Table | None = None
        self.live = Live(Group(self.progress), console=self.console, refresh_per_second=4, transient=False)

    def __enter__(self) -> RunView:
        if not self.quiet:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.quiet:
            self.live.__exit__(*exc)

    def advance(self, completed: int, info: str = "", domains: dict[str, dict[str, float]] | None = None) -> None:
        self.progress.update(self.task, completed=completed, info=info)
        if domains:
            self.table = domain_table(domains)
            self.live.update(Group(self.progress, self.table))

    def warn(self, text: str) -> None:
        if not self.quiet:
            self.console.print(f"[yellow]warning:[/] {text}")


def domain_table(domains: dict[str, dict[str, float]]) -> Table:
    table = Table(box=None, pad_edge=False)
    table.add_column("domain")
    for _, header, _ in DOMAIN_COLUMNS:
        table.add_column(header, justify="right")
    for name, stats in domains.items():
        table.add_row(name, *(fmt.format(stats[key]) if key in stats else "-" for key, _, fmt in DOMAIN_COLUMNS))
    return table
