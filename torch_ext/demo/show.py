"""Printing for the demo: part headers, aligned tables, and one short line per failure."""
from __future__ import annotations

import re
import sys
from typing import Callable, Sequence

WIDTH = 96  # every line the demo prints stays under this
OUTCOME_WIDTH = WIDTH - 36  # what fits after "     torch_ext.install()  refused: "


def header(name: str, title: str) -> None:
    print(f"\n== {name}: {title} ".ljust(WIDTH, "="))


def table(rows: Sequence[Sequence[object]], *, head: Sequence[str] | None = None, indent: str = "  ") -> None:
    """Columns left-aligned, except numbers (right-aligned)."""
    all_rows = [list(map(str, r)) for r in ([head] if head else []) + list(rows)]
    widths = [max(len(r[i]) for r in all_rows) for i in range(len(all_rows[0]))]
    numeric = [all(_is_number(r[i]) for r in all_rows[1 if head else 0:]) for i in range(len(widths))]
    for r in all_rows:
        cells = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric)]
        print((indent + "  ".join(cells)).rstrip())


def _is_number(text: str) -> bool:
    return bool(re.fullmatch(r"-?[\d.]+", text))


def reason(error: BaseException, width: int = 80) -> str:
    """The informative line of an exception: torch wraps the cause in headers such as
    "backend='inductor' raised:" or "... Got graph break/error:", so skip lines ending in ':'
    and keep the first sentence of what follows, shortened to `width`."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    line = next((x for x in lines if not x.endswith(":")), lines[0] if lines else type(error).__name__)
    line = line.split(" Got ", 1)[-1]  # 2.9.1: "... to be capturable into a single graph Got <cause>"
    return shorten(re.split(r"(?<=[a-z)])\. ", line)[0], width)


def shorten(line: str, width: int) -> str:
    return line if len(line) <= width else line[: width - 1].rsplit(" ", 1)[0] + " …"


def attempt(fn: Callable[[], object], width: int = 80) -> tuple[bool, object]:
    """(True, result) or (False, short reason): the demo reports torch's failures, not raises them."""
    try:
        return True, fn()
    except Exception as e:  # noqa: BLE001 - any refusal is what the demo shows
        return False, reason(e, width)


def flush() -> None:
    sys.stdout.flush()  # before a subprocess or a long compile, so the output reads in order
