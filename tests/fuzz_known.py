"""The contract fuzzer's known findings: defects it found that are not fixed yet,
each named, with its minimal reproduction (a strict ``xfail`` in
``tests/test_contract_fuzz.py`` runs each one), and matched by entry point, draw and
message, so that the default run stays green while each stays visible: the run
counts and prints every case it matched. Remove an entry with its fix (its strict
``xfail`` then fails first, as a reminder).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["KNOWN_FINDINGS", "KnownFinding", "known_finding"]


@dataclasses.dataclass(frozen=True)
class KnownFinding:
    """A defect the fuzzer finds: ``matches(result)`` says whether a finding is it."""

    name: str
    entries: tuple[str, ...]
    where: str  # the code that has it
    reproduction: str  # the minimal reproduction, as the xfail test runs it
    matches: Callable[[Any], bool]


KNOWN_FINDINGS: tuple[KnownFinding, ...] = ()
"""None open. The five the fuzzer found first (a VocabShard of None named as the weight;
sparse distillation under inference mode; an unused count without its ``context.``
prefix; the bucket tails formed by cancellation; top-k with entropy keeping its graph
through ``ctx``) are fixed, each pinned by ``tests/test_contract_fuzz.py``'s
``test_a_fixed_finding_stays_fixed``."""


def known_finding(result: Any) -> str:
    """The name of the known finding ``result`` is, or ``""``."""
    for known in KNOWN_FINDINGS:
        if result.entry in known.entries and known.matches(result):
            return known.name
    return ""
