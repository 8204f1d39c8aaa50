"""Print a gate report for people: one table of gates and per-level rates, the cheaters, the
difference from the previous version, and each failure with its seed."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from assay.envs.qa.gate import GateReport


def print_report(console: Console, report: GateReport, changes: list[str]) -> None:
    verdict = "[green]passed[/]" if report.passed else "[red]FAILED[/]"
    console.print(f"[bold]{report.env}[/] ({report.kind}, hash {report.hash}, gate v{report.gate_version}): {verdict}")
    gates = report.gate_status()
    mark = {"pass": "✓", "fail": "✗", "skipped": "–"}
    console.print("  " + "  ".join(f"{g} {mark[s]}" for g, s in gates.items()))
    for why in report.skipped:
        console.print(f"  [yellow]skipped[/] {why}")
    for why in report.warnings:
        console.print(f"  [yellow]warning[/] {why}")
    table = Table("level", "reference", "flaky", "null (empty/ws/echo)", "random answer", "calibration")
    for level, s in sorted(report.levels.items()):
        table.add_row(str(level), f"{s['reference']:.2f}", f"{s['flaky']:.2f}",
                      f"{s['empty']:.2f}/{s['whitespace']:.2f}/{s['echo']:.2f}", f"{s['random well-formed']:.2f}",
                      f"{s.get('calibration pass rate', float('nan')):.2f}")
    console.print(table)
    by_class: dict[str, list[str]] = {}
    for name, c in report.cheaters.items():
        by_class.setdefault(c.get("class") or "other", []).append(f"{name} {c['passed']}/{c['tried']}")
    cheats = "; ".join(f"{k}: {', '.join(v)}" for k, v in by_class.items())
    console.print(f"  cheaters by class (passed/tried): {cheats or 'none apply'}")
    f = report.flakiness
    if f:
        console.print(f"  flakiness: {f['runs needed']} runs see a {f['rate']:.0%} flake rate with probability "
                      f"{f['power']}; failed {f['idle failed']} of {f['idle runs']} idle, {f['loaded failed']} of "
                      f"{f['loaded runs']} with {f['busy cpus']} CPUs kept busy")
    if report.power:
        p = report.power
        console.print(f"  power: each chance test catches a strategy winning {p['loophole rate']:.0%} of its tries with "
                      f"probability {p['power']} ({p['random answer tries']} tries of another task's answer a level, "
                      f"up to {p['cheater tries']} of a cheater, as its tolerance needs; {p['tasks per level']} tasks a level)")
    if report.leaks:
        console.print(f"  bare answer value in the prompt: {report.leaks['answer in prompt']:.0%} of tasks, another "
                      f"task's {report.leaks['another answer in prompt']:.0%} (p = {report.leaks['p']:.2g})")
    console.print("  vs previous version: " + "; ".join(changes))
    for f in report.failures:
        console.print(f"  [red]✗[/] {f.line()}")
