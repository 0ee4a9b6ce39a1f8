"""The check's report: sections of rows, printed as tables and written as report.json and report.md.

A cell holds a number, a string, or `NA` where a figure needs CUDA and this is a dry run;
numbers stay numbers in report.json and are rounded only for the tables.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

NA = "n/a (dry run)"
GIB = float(1 << 30)


def gib(value):
    """Bytes as GiB; a cell that is not a byte count (NA, an error) stays as it is."""
    return value / GIB if isinstance(value, int) else value


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value != 0 and abs(value) < 1e-2:
            return f"{value:.2e}"
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.3f}"
    return str(value)


@dataclass
class Section:
    key: str
    title: str
    columns: list[str]
    rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, **cells) -> dict:
        unknown = set(cells) - set(self.columns)
        if unknown:
            raise KeyError(f"{self.key}: unknown columns {sorted(unknown)}")
        row = {column: cells.get(column) for column in self.columns}
        self.rows.append(row)
        return row

    def lines(self, markdown: bool) -> list[str]:
        table = [self.columns] + [[fmt(row[c]) for c in self.columns] for row in self.rows]
        if markdown:
            out = [f"## {self.title}", ""]
            out += ["| " + " | ".join(cells) + " |" for cells in table[:1]]
            out += ["|" + "---|" * len(self.columns)]
            out += ["| " + " | ".join(cells) + " |" for cells in table[1:]]
            return out + [""] + [f"- {note}" for note in self.notes] + [""]
        widths = [max(len(cells[i]) for cells in table) for i in range(len(self.columns))]
        out = [f"== {self.title}"]
        out += ["  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip() for cells in table]
        return out + [f"  note: {note}" for note in self.notes] + [""]


class Report:
    def __init__(self, meta: dict):
        self.meta = meta
        self.sections: list[Section] = []

    def section(self, key: str, title: str, columns: list[str]) -> Section:
        section = Section(key, title, columns)
        self.sections.append(section)
        return section

    def text(self) -> str:
        head = [f"{key}: {value}" for key, value in self.meta.items()]
        return "\n".join(head + [""] + [line for s in self.sections for line in s.lines(False)])

    def write(self, out: Path) -> None:
        data = {"meta": self.meta, "sections": {s.key: vars(s) for s in self.sections}}
        (out / "report.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
        head = ["# GPU self-check", ""] + [f"- {key}: {value}" for key, value in self.meta.items()] + [""]
        (out / "report.md").write_text("\n".join(head + [line for s in self.sections for line in s.lines(True)]))
