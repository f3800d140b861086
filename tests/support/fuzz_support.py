"""The contract fuzzer's machinery: seeded draws, cases, the three outcomes, and the
known findings (test support for ``tests/contract/test_contract_fuzz.py``).

A *case* is one call of a public entry point with arguments drawn from a valid or
an invalid domain. Each case is drawn from ``random.Random(f"{seed}:{index}")`` alone
(Python's string seeding is SHA-512 based, the same in every process), so a case
reproduces from its seed and index::

    python -m tests.support.fuzz_support SEED INDEX  # replays one case, prints its draw and outcome

A case passes on exactly one of three outcomes:

- an invalid draw (``Case.refuse``: the fields its mutations break) raises
  ``hookspec.ContractError`` whose ``field`` is one of them (or a sub-field: ``labels``
  covers ``labels[...]``);
- a valid draw returns, and ``Case.check(result)`` (a comparison with an independent
  float64 computation, within a tolerance derived from the draw's dtypes) is empty;
- a tool run leaves the caller's state as it found it (``Case.check`` compares).

Anything else is a *finding*: another exception type, an invalid draw accepted, a
valid draw refused, a value off the float64 truth, a NaN where a number is expected.
A finding that matches an entry of :data:`tests.support.fuzz_known.KNOWN_FINDINGS` (a named,
reproduced defect not fixed yet) is counted as known instead of failing the run.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hookspec import ContractError

__all__ = [
    "Case",
    "Draw",
    "Result",
    "ThreadGroup",
    "classify",
    "close",
    "describe",
    "run_case",
    "run_spmd",
]


# ---------------------------------------------------------------- draws


class Draw:
    """The random source of one case, recording what it drew (``notes``) so a case
    prints as the draw that made it."""

    def __init__(self, seed: int, index: int) -> None:
        self.rng = random.Random(f"{seed}:{index}")
        self.gen = torch.Generator().manual_seed(self.rng.getrandbits(63))
        self.notes: dict[str, str] = {}
        self.mutations: list[str] = []

    def note(self, key: str, value: Any) -> Any:
        self.notes[key] = value if isinstance(value, str) else _short(value)
        return value

    def pick(self, key: str, options: Sequence[Any], weights: Sequence[float] | None = None) -> Any:
        value = self.rng.choices(list(options), weights=weights)[0]
        return self.note(key, value)

    def chance(self, key: str, p: float) -> bool:
        value = self.rng.random() < p
        if value:
            self.note(key, True)
        return value

    def int(self, key: str, low: int, high: int) -> int:
        return self.note(key, self.rng.randint(low, high))  # type: ignore[no-any-return]

    def uniform(self, low: float, high: float) -> float:
        return self.rng.uniform(low, high)

    def randn(
        self, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0
    ) -> torch.Tensor:
        return (torch.randn(tuple(shape), generator=self.gen, dtype=torch.float64) * scale).to(
            dtype
        )

    def randint(self, low: int, high: int, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=self.gen)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(tuple(shape), generator=self.gen, dtype=torch.float64)

    def mutate(
        self, candidates: dict[str, tuple[str, ...]], p: float = 0.45
    ) -> dict[str, tuple[str, ...]]:
        """The invalid mutations of this case: none (a valid draw) with ``1 - p``, else
        one (or, one time in six, two) of ``candidates`` (name -> the fields it breaks)."""
        if not candidates or self.rng.random() >= p:
            return {}
        names = sorted(candidates)
        count = 2 if len(names) > 1 and self.rng.random() < 1 / 6 else 1
        chosen = self.rng.sample(names, count)
        if count == 2 and chosen[0].split("_")[0] == chosen[1].split("_")[0]:
            chosen = chosen[:1]  # two changes to one argument: the second would undo the first
        self.mutations.extend(chosen)
        self.note("invalid", ",".join(chosen))
        return {name: candidates[name] for name in chosen}


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)}:{str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------- cases and outcomes


def _no_check(result: Any) -> list[str]:
    return []


@dataclasses.dataclass
class Case:
    """One drawn call. ``refuse``: the fields a ``ContractError`` may name (an invalid
    draw); empty: a valid draw whose result ``check`` compares with the truth.
    ``raises``: a documented exception type other than ``ContractError`` (with
    ``match`` in its message), for the few the API documents."""

    entry: str
    call: Callable[[], Any]
    check: Callable[[Any], list[str]] = _no_check
    refuse: tuple[str, ...] = ()
    raises: type[BaseException] | None = None
    match: str = ""


@dataclasses.dataclass(frozen=True)
class Result:
    """The outcome of case ``index`` of ``seed``. ``kind``: ``"value"`` (a valid draw
    matched its truth), ``"refused"`` (an invalid draw raised the ``ContractError`` it
    should), ``"known"`` (a finding of :data:`KNOWN_FINDINGS`), or ``"finding"``."""

    seed: int
    index: int
    entry: str
    kind: str
    notes: dict[str, str]
    mutations: tuple[str, ...]
    message: str = ""
    known: str = ""

    def describe(self) -> str:
        draw = ", ".join(f"{k}={v}" for k, v in self.notes.items())
        head = f"case {self.index} of seed {self.seed}: {self.entry}({draw})"
        tail = f"\n    {self.kind}: {self.message}" if self.message else ""
        known = f" [known: {self.known}]" if self.known else ""
        return (
            head
            + known
            + tail
            + f"\n    replay: python -m tests.support.fuzz_support {self.seed} {self.index}"
        )


def describe(results: Sequence[Result]) -> str:
    """A summary: counts per entry point and outcome."""
    entries: dict[str, dict[str, int]] = {}
    for r in results:
        entries.setdefault(r.entry, {}).setdefault(r.kind, 0)
        entries[r.entry][r.kind] += 1
    lines = [f"{len(results)} cases"]
    for entry in sorted(entries):
        counts = ", ".join(f"{k} {v}" for k, v in sorted(entries[entry].items()))
        lines.append(f"  {entry}: {counts}")
    return "\n".join(lines)


def _field_matches(field: str, allowed: Sequence[str]) -> bool:
    return any(
        field == a or field.startswith(a + ".") or field.startswith(a + "[") for a in allowed
    )


def classify(case: Case, run: Callable[[], Any]) -> tuple[str, str]:
    """``(kind, message)`` of running ``case`` (``run`` calls it): ``"value"``,
    ``"refused"`` or ``"finding"``."""
    try:
        result = run()
    except ContractError as exc:
        if not case.refuse:
            return "finding", f"a valid draw refused: ContractError({exc.field!r}): {exc}"
        if not isinstance(exc.field, str) or not exc.field.strip():
            return "finding", f"ContractError without a field name: {exc}"
        if not _field_matches(exc.field, case.refuse):
            return (
                "finding",
                f"ContractError names {exc.field!r}, expected one of {list(case.refuse)}: {exc}",
            )
        return "refused", ""
    except Exception as exc:
        if case.raises is not None and isinstance(exc, case.raises) and case.match in str(exc):
            return "refused", ""
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return (
            "finding",
            f"{type(exc).__name__}: {str(exc)[:400]} ({where.filename}:{where.lineno})",
        )
    if case.refuse or case.raises is not None:
        want = list(case.refuse) or [case.raises.__name__ if case.raises else ""]
        return "finding", f"an invalid draw accepted (expected ContractError naming one of {want})"
    try:
        problems = case.check(result)
    except Exception as exc:
        return "finding", f"the result could not be checked: {type(exc).__name__}: {exc}"
    if problems:
        return "finding", "; ".join(problems)[:1500]
    return "value", ""


def run_case(seed: int, index: int) -> Result:
    """Draw case ``index`` of ``seed``, run it, and classify its outcome."""
    from .fuzz_entries import draw_case
    from .fuzz_known import known_finding

    d = Draw(seed, index)
    case = draw_case(d)
    kind, message = classify(case, case.call)
    known = ""
    result = Result(seed, index, case.entry, kind, dict(d.notes), tuple(d.mutations), message)
    if kind == "finding":
        known = known_finding(result)
        if known:
            result = dataclasses.replace(result, kind="known", known=known)
    return result


# ---------------------------------------------------------------- comparisons


def close(
    name: str, actual: Any, truth: torch.Tensor, *, atol: float | torch.Tensor, rtol: float = 0.0
) -> list[str]:
    """``[]`` where ``|actual - truth| <= atol + rtol * |truth|`` everywhere (NaN
    only where the truth is NaN, infinities equal), else one line saying where and by
    how much. ``atol`` may be a tensor broadcasting against ``truth``."""
    if not isinstance(actual, torch.Tensor):
        return [f"{name}: expected a tensor, got {type(actual).__name__}"]
    a = actual.detach().to(torch.float64).cpu()
    t = truth.detach().to(torch.float64).cpu()
    if tuple(a.shape) != tuple(t.shape):
        return [f"{name}: shape {list(a.shape)}, truth {list(t.shape)}"]
    if a.numel() == 0:
        return []
    nan_a, nan_t = torch.isnan(a), torch.isnan(t)
    if bool((nan_a & ~nan_t).any()):
        i = int(torch.nonzero((nan_a & ~nan_t).flatten())[0])
        return [
            f"{name}: NaN where the float64 truth is {t.flatten()[i].item():.6g} (flat index {i})"
        ]
    if bool((nan_t & ~nan_a).any()):
        return [f"{name}: a number where the float64 truth is NaN"]
    bound = torch.as_tensor(atol, dtype=torch.float64) + rtol * t.abs()
    same = (a == t) | (nan_a & nan_t)
    err = torch.where(same, 0.0, (a - t).abs())
    bad = ~(err <= bound)
    if bool(bad.any()):
        flat = torch.where(bad, err, -1.0).flatten()
        i = int(flat.argmax())
        b = bound.expand_as(t).flatten()[i].item()
        return [
            f"{name}: off the float64 truth by {err.flatten()[i].item():.3g} (tolerance {b:.3g}) "
            f"at flat index {i}: got {a.flatten()[i].item():.9g}, truth {t.flatten()[i].item():.9g}"
        ]
    return []


# ---------------------------------------------------------------- tensor parallel in threads


class _Rendezvous:
    """Every rank's value, exchanged by ``size`` threads (one per rank)."""

    def __init__(self, size: int, timeout: float) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots: list[Any] = [None] * size

    def exchange(self, rank: int, value: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``value``, each a copy: a rank holds no other rank's tensor (a
        detached view would keep that rank's graph alive) as a process group holds
        none."""
        self.slots[rank] = value.detach().clone()
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        self.slots[rank] = None  # holds no rank's tensor (nor, through a view, its input) after
        return out


def _exact() -> torch.autocast:
    """A collective moves values as they are: a caller's autocast does not reach it."""
    return torch.autocast("cpu", enabled=False)


class _Sum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, meet: _Rendezvous, rank: int) -> torch.Tensor:
        parts = meet.exchange(rank, x)
        with _exact():
            return torch.stack(parts).sum(0)  # the same order on every rank: bitwise replicated

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return g, None, None


class _Gather(torch.autograd.Function):
    """Sequence parallel: concatenate along dim 0 (backward: sum, then this rank's
    part); otherwise the identity (backward: sum over the ranks)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, meet: _Rendezvous, rank: int, sp: bool) -> torch.Tensor:
        ctx.meet, ctx.rank, ctx.sp, ctx.rows = meet, rank, sp, x.shape[0]
        if not sp:
            return x.clone()
        with _exact():
            return torch.cat(meet.exchange(rank, x), 0)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        with _exact():
            total = torch.stack(ctx.meet.exchange(ctx.rank, g)).sum(0)
        if ctx.sp:
            total = total[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows]
        return total, None, None, None


Fault = Callable[[torch.Tensor, torch.Tensor], Any]
"""``(input, correct result) -> what a faulty collective returns instead``."""


class ThreadGroup:
    """``size`` tensor-parallel ranks as threads of this process: ``rank(r)`` is rank
    ``r``'s ``hookspec.Collectives`` (differentiable as the contract says), with
    ``faults`` (method -> :data:`Fault`) replacing a method's results, as a custom
    collectives object with a defect would. Not ``checked_results``: an
    ``OutputContext`` wraps it in ``checked_collectives`` as it does a user's."""

    def __init__(
        self, size: int, *, sequence_parallel: bool = False, faults: dict[str, Fault] | None = None
    ) -> None:
        self.size = size
        self.sequence_parallel = sequence_parallel
        self.faults = faults or {}
        self.meet = _Rendezvous(size, timeout=60.0)

    def rank(self, r: int) -> RankCollectives:
        return RankCollectives(self, r)


class RankCollectives:
    """Rank ``rank``'s collectives of a :class:`ThreadGroup`."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.r = group, rank
        self.size = group.size
        self.sequence_parallel = group.sequence_parallel

    def __repr__(self) -> str:
        return f"ThreadGroup(size={self.size}).rank({self.r})"

    def _out(self, method: str, x: torch.Tensor, y: torch.Tensor) -> Any:
        fault = self.group.faults.get(method)
        return y if fault is None else fault(x, y)

    def all_reduce_sum(self, x: torch.Tensor, /) -> Any:
        return self._out("all_reduce_sum", x, _Sum.apply(x, self.group.meet, self.r))

    def all_reduce_max(self, x: torch.Tensor, /) -> Any:
        parts = self.group.meet.exchange(self.r, x)
        with _exact():
            return self._out("all_reduce_max", x, torch.stack(parts).amax(0))

    def gather_hidden_states(self, x: torch.Tensor, /) -> Any:
        y = _Gather.apply(x, self.group.meet, self.r, self.sequence_parallel)
        return self._out("gather_hidden_states", x, y)

    def all_gather(self, x: torch.Tensor, /) -> Any:
        parts = self.group.meet.exchange(self.r, x)
        with _exact():
            return self._out("all_gather", x, torch.stack(parts))


class RankDisagreement(AssertionError):
    """Some ranks returned while others raised: under a real group the others hang."""


def run_spmd(size: int, fn: Callable[[int], Any], group: ThreadGroup | None = None) -> list[Any]:
    """``[fn(0), ..., fn(size - 1)]``, each rank in its own thread (``size > 1``). A
    rank's ``ContractError`` (or other exception) is raised here; the ranks it left
    waiting at a collective see the barrier broken, which is not counted. Ranks that
    disagree (one raises, another returns) raise :class:`RankDisagreement`."""
    if size == 1:
        return [fn(0)]
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def body(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as exc:
            errors[r] = exc
            if group is not None:
                group.meet.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    primary = [
        e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)
    ]
    if primary:
        raised = [r for r in range(size) if errors[r] is not None]
        if len(raised) < size:
            first = primary[0]
            raise RankDisagreement(
                f"ranks {raised} raised ({type(first).__name__}: {first}), the others returned"
            )
        raise primary[0]
    if any(e is not None for e in errors):
        raise RankDisagreement("a collective's barrier broke with no rank raising")
    return results


def main(argv: Sequence[str]) -> int:
    """Replay cases: ``python -m tests.support.fuzz_support SEED INDEX [INDEX ...]``."""
    seed, indices = int(argv[0]), [int(i) for i in argv[1:]]
    status = 0
    for index in indices:
        result = run_case(seed, index)
        print(result.describe())
        if result.kind == "finding":
            status = 1
            case_trace(seed, index)
    return status


def case_trace(seed: int, index: int) -> None:
    """Run case ``index`` again and print the traceback of its exception, if any."""
    from .fuzz_entries import draw_case

    case = draw_case(Draw(seed, index))
    try:
        result = case.call()
    except Exception:
        traceback.print_exc()
    else:
        for line in case.check(result):
            print("   ", line)


if __name__ == "__main__":
    import sys

    torch.set_num_threads(1)  # as the test runs it: tiny tensors
    raise SystemExit(main(sys.argv[1:]))
