"""This checkout's processors on the CPU against another checkout's, in one run.

Answers "is the CPU path slower than before?". Each round times, in a fresh process
per checkout and in alternating order, one forward + backward (fp32, after one
warm-up) of ``--what``; the figure is the median over rounds of this checkout's time
over the other's::

    git worktree add /tmp/base <commit>
    python -m benchmarks.cpu_against_checkout /tmp/base --rounds 5 --what logprobs

``--what``: ``logprobs`` (``linear_logprobs`` with entropy, cotangents of ones: the
``benchmarks.logprobs`` row), ``fused`` (``cross_entropy_loss(reduction="mean")``,
the fused loss), ``topk`` (``topk_logprobs(16, entropy=True)``), ``distill-sparse``
and ``distill-dense`` (``distillation_loss`` with a top-16 or a dense teacher of
hidden size ``1.5 H``: the ``benchmarks.distill`` rows). The processors are called
through an ``OutputContext``, whose signature both checkouts share.

Prints one JSON line: the sizes, both checkouts' times per round, the ratios, and their
median. Nothing is asserted: a ratio is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from ._harness import ROOT

_ONE_RUN = r"""
import sys, time, torch
sys.path.insert(0, sys.argv[1])
from hookspec import OutputContext, VocabShard
from torch_impl import processors as P
what = sys.argv[5]
n, h, v = (int(a) for a in sys.argv[2:5])
torch.manual_seed(0)
x = torch.randn(n, h, requires_grad=True)
w = (torch.randn(v, h) * 0.05).requires_grad_()
y = torch.randint(0, v, (n,))
teacher = None
if what.startswith("distill"):
    th, tw = torch.randn(n, 1, h * 3 // 2), torch.randn(v, h * 3 // 2) * 0.05
    if what == "distill-dense":
        teacher = P.DenseTeacher(hidden_states=th, weight=tw)
    else:
        with torch.no_grad():
            top = torch.sort((th[:, 0] @ tw.T).log_softmax(-1), -1, descending=True)
        ids, lp = top.indices[None, :, :16].contiguous(), top.values[None, :, :16].contiguous()
        teacher = P.SparseTeacher(ids=ids, logprobs=lp)
def ctx():
    shard = VocabShard(0, v, v)
    return OutputContext(hidden_states=x[:, None], labels=y[None], vocab_weight=w, vocab=shard,
                         context=teacher)
def run():
    if what == "logprobs":
        r = P.linear_logprobs(x, w, y, with_entropy=True)
        (r.logprobs.sum() + r.entropy.sum()).backward()
    elif what == "fused":
        P.cross_entropy_loss(reduction="mean")(ctx())["loss"].backward()
    elif what == "topk":
        out = P.topk_logprobs(16, entropy=True)(ctx())
        (out["topk_logprobs"].sum() + out["entropy"].sum()).backward()
    else:
        P.distillation_loss(P.DistillConfig(tail="bucket"))(ctx())["loss"].backward()
run()
t = time.perf_counter(); run(); print(time.perf_counter() - t)
"""

WHAT = ("logprobs", "fused", "topk", "distill-sparse", "distill-dense")


def _time(checkout: Path, n: int, h: int, v: int, what: str = "logprobs") -> float:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("PYTHONPATH", None)
    out = subprocess.run(
        [sys.executable, "-c", _ONE_RUN, str(checkout), str(n), str(h), str(v), what],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=1800,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.cpu_against_checkout", description=__doc__
    )
    p.add_argument(
        "base", type=Path, help="the other checkout (a git worktree of the commit to compare)"
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--size", type=int, nargs=3, default=(4096, 1024, 32768), metavar=("N", "H", "V")
    )
    p.add_argument("--what", choices=WHAT, default="logprobs")
    args = p.parse_args(argv)
    times: dict[str, list[float]] = {"base": [], "this": []}
    for i in range(args.rounds):
        order = [("base", args.base), ("this", ROOT)]
        for name, path in order if i % 2 == 0 else order[::-1]:
            times[name].append(_time(path.resolve(), *args.size, args.what))
    ratios = [t / b for t, b in zip(times["this"], times["base"])]
    print(
        json.dumps(
            {
                "what": args.what,
                "size_n_h_v": list(args.size),
                "base_s": times["base"],
                "this_s": times["this"],
                "ratios": ratios,
                "median_ratio": statistics.median(ratios),
            }
        )
    )


if __name__ == "__main__":
    main()
