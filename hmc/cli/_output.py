"""How the CLI shows things: aligned tables or JSON on stdout, progress on stderr.

Concurrency: used from the CLI's main thread only.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TextIO

__all__ = ["Progress", "print_json", "print_table"]


def print_json(data: Any, out: TextIO | None = None) -> None:
    """`data` as indented JSON on `out` (stdout as it is at the call)."""
    out = sys.stdout if out is None else out
    json.dump(data, out, indent=2, sort_keys=False, default=str)
    out.write("\n")


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def print_table(rows: Sequence[Mapping[str, Any]], columns: Iterable[str] | None = None, out: TextIO | None = None) -> None:
    """Rows as an aligned text table with a header, on `out` (stdout as it is at the call)."""
    out = sys.stdout if out is None else out
    if not rows:
        out.write("(none)\n")
        return
    names = list(columns) if columns is not None else list(rows[0])
    cells = [[_cell(row.get(name, "")) for name in names] for row in rows]
    widths = [max(len(name), *(len(line[i]) for line in cells)) for i, name in enumerate(names)]
    out.write("  ".join(name.upper().ljust(w) for name, w in zip(names, widths)).rstrip() + "\n")
    for line in cells:
        out.write("  ".join(value.ljust(w) for value, w in zip(line, widths)).rstrip() + "\n")


class Progress:
    """A one-line progress display on stderr (redrawn on a terminal, plain lines elsewhere)."""

    def __init__(self, total: int, label: str, out: TextIO | None = None, enabled: bool = True) -> None:
        """`out`: stderr as it is when the display is made (not when this module was imported)."""
        self.total = max(total, 1)
        self.label = label
        self.done = 0
        out = sys.stderr if out is None else out
        self._out = out
        self._enabled = enabled
        self._tty = out.isatty()
        self._last = 0.0

    def advance(self, step: int = 1, note: str = "") -> None:
        self.update(self.done + step, note)

    def update(self, done: int, note: str = "") -> None:
        """Show `done` out of the total."""
        self.done = min(self.total, done)
        now = time.monotonic()
        if not self._enabled or (self._tty and now - self._last < 0.1 and self.done < self.total):
            return
        self._last = now
        percent = 100 * self.done // self.total
        line = f"{self.label}: {self.done}/{self.total} ({percent}%) {note}".rstrip()
        self._out.write(f"\r\x1b[2K{line}" if self._tty else f"{line}\n")
        if self._tty and self.done == self.total:
            self._out.write("\n")
        self._out.flush()
