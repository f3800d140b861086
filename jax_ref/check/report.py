"""The rows of a cross-check and how they print: a table of every compared
array, or one line per processor, case and dtype.

A :class:`Row` is one compared array (an output's value, ``d/d hidden`` or
``d/d weight``) with its errors and verdict; a :class:`CrossCheckReport`
holds rows and prints them. Made by ``jax_ref.check.comparison``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = ["CrossCheckReport", "Row", "combine", "pass_rule"]


@dataclasses.dataclass(frozen=True)
class Row:
    """One compared array: ``quantity`` is ``value``, ``d/d hidden`` or ``d/d weight``."""

    case: str
    dtype: str
    output: str
    quantity: str
    max_abs: float
    max_rel: float
    rtol: float
    passed: bool
    note: str = ""
    floor: float = 0.0
    processor: str = ""
    atol: float = 0.0
    slack: float = 0.0
    where: str = ""  # a failing row: its first failing tokens, ours and the reference's values

    def fail_line(self) -> str:
        """The one line a failing row prints: what failed, by how much against what it
        was allowed, and the first tokens where (ours and the reference's values)."""
        reason = (
            self.note
            if self.note.startswith(("non-finite", "shape", "finite"))
            else f"max abs err {self.max_abs:.3g}, {self.max_rel:.3g} of the reference's scale "
            f"(rtol {self.rtol:g}, atol {self.atol:g}) {self.note}".rstrip()
        )
        where = f"; {self.where}" if self.where else ""
        head = f"FAIL {self.processor}: {self.output} {self.quantity} [{self.case}, {self.dtype}]"
        return f"{head}: {reason}{where}"


_HEADER = (
    "case",
    "dtype",
    "output",
    "quantity",
    "max abs err",
    "max rel err",
    "rtol",
    "atol",
    "result",
)
_SUMMARY = ("processor", "case", "dtype", "outputs", "value", "d/d hidden", "d/d weight", "result")


def _fmt(x: float) -> str:
    return "nan" if math.isnan(x) else "inf" if math.isinf(x) else f"{x:.2e}"


def _grid(cells: list[tuple[str, ...]]) -> str:
    widths = [max(len(c[i]) for c in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _result(r: Row) -> str:
    if not r.passed:
        return f"FAIL {r.note}".rstrip()
    return "ok" if not r.floor else f"ok (f32 floor {r.floor:.1e})"


@dataclasses.dataclass(frozen=True)
class CrossCheckReport:
    """The rows of one or more cross-checks; ``str(report)`` is a table."""

    processor: str
    reference: str
    rows: tuple[Row, ...]

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.passed for r in self.rows)

    def failures(self) -> tuple[Row, ...]:
        return tuple(r for r in self.rows if not r.passed)

    def table(self) -> str:
        """Every compared array: its max abs and max relative error (to the
        reference array's largest magnitude), and the verdict."""
        head = (("processor",) if len({r.processor for r in self.rows}) > 1 else ()) + _HEADER
        cells = [head] + [
            ((r.processor,) if len(head) > len(_HEADER) else ())
            + (
                r.case,
                r.dtype,
                r.output,
                r.quantity,
                _fmt(r.max_abs),
                _fmt(r.max_rel),
                f"{r.rtol:.0e}",
                f"{r.atol:.0e}",
                _result(r),
            )
            for r in self.rows
        ]
        return _grid(cells)

    def summary(self) -> str:
        """One line per processor, case and dtype: the worst relative error of
        the values, of ``d/d hidden`` and of ``d/d weight`` over its outputs."""
        groups: dict[tuple[str, str, str], list[Row]] = {}
        for r in self.rows:
            groups.setdefault((r.processor, r.case, r.dtype), []).append(r)
        cells: list[tuple[str, ...]] = [_SUMMARY]
        for (proc, case, dtype), rows in groups.items():
            worst = []
            for quantity in ("value", "d/d hidden", "d/d weight"):
                errs = [r.max_rel for r in rows if r.quantity == quantity]
                worst.append(_fmt(max(errs)) if errs else "-")
            bad = [r for r in rows if not r.passed]
            outputs = ",".join(sorted({r.output for r in rows}))
            floored = any(r.floor for r in rows)
            verdict = (
                f"FAIL ({len(bad)} of {len(rows)})"
                if bad
                else "ok (f32 floor)"
                if floored
                else "ok"
            )
            cells.append((proc, case, dtype, outputs, *worst, verdict))
        return _grid(cells)

    def legend(self) -> str:
        """How a row passes, with the tolerances of the dtypes in the rows."""
        return pass_rule(self.rows)

    def __str__(self) -> str:
        status = "passed" if self.passed else f"FAILED ({len(self.failures())} of {len(self.rows)})"
        return f"{self.processor} vs {self.reference}: {status}\n{self.table()}\n{self.legend()}"


def pass_rule(rows: Sequence[Row]) -> str:
    """The pass rule of a table, in words, and the tolerances of its dtypes::

    pass: max abs err <= atol + rtol * max|reference| + slack * floor (per compared array)
    """
    tols = {r.dtype: (r.rtol, r.atol, r.slack) for r in rows}
    slack = max((s for _, _, s in tols.values()), default=0.0)
    by_dtype = "; ".join(f"{d} rtol {rt:.0e} atol {at:.0e}" for d, (rt, at, _) in tols.items())
    return (
        f"pass: max abs err <= atol + rtol * max|reference| + {slack:g} * floor, "
        f"per compared array ({by_dtype}).\n"
        "max rel err = max abs err / max|reference|: above rtol, a row passes on atol where the "
        "reference is tiny.\n"
        "floor: the error of the reference's own formula run in float32 against float64, computed "
        'only for an array that fails the first two terms ("ok (f32 floor)": passed on it).'
    )


def combine(
    reports: Sequence[CrossCheckReport], /, *, processor: str, reference: str
) -> CrossCheckReport:
    """One report holding the rows of ``reports``."""
    rows: tuple[Row, ...] = ()
    for r in reports:
        rows += r.rows
    return CrossCheckReport(processor, reference, rows)
