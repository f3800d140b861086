"""The cost of the hook itself: an enabled model whose processor recomputes exactly
the stock output path (output layer, Megatron's loss) against the stock model,
forward + backward, in one process, the variants interleaved.

    python -m benchmarks.hook_overhead            # 4 layers, hidden 512, V 32768, 4 x 512 tokens
    python -m benchmarks.hook_overhead --quick

Writes ``benchmarks/results/hook_overhead.csv`` and ``hook_overhead.png``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ._harness import load_average, ratio, write_csv

FULL = {"layers": 4, "hidden": 512, "heads": 8, "vocab": 32768, "batch": 4, "seq": 512, "iters": 20}
QUICK = {"layers": 2, "hidden": 128, "heads": 4, "vocab": 4096, "batch": 2, "seq": 128, "iters": 6}


def _passthrough() -> Any:
    import hookspec

    @hookspec.processor
    def passthrough(ctx: hookspec.OutputContext) -> torch.Tensor:
        """The stock output path, through the context: output layer, MuP scaling, loss."""
        logits, _ = ctx.output_layer(ctx.hidden_states, weight=ctx.output_weight)
        return ctx.compute_language_model_loss(ctx.labels, ctx.scale_logits(logits))

    return passthrough


def run(size: dict[str, int]) -> list[dict[str, Any]]:
    import torch_impl
    from torch_impl.tiny import TinyGPTShape, build_tiny_gpt, megatron_parallel, tiny_batch

    shape = TinyGPTShape(
        num_layers=size["layers"],
        hidden_size=size["hidden"],
        num_attention_heads=size["heads"],
        vocab_size=size["vocab"],
        max_sequence_length=size["seq"],
    )
    variants = ("stock", "enabled, no processor", "enabled, pass-through")
    times: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    with megatron_parallel():
        model = build_tiny_gpt(shape)
        batch = tiny_batch(size["batch"], size["seq"], size["vocab"], seed=0)
        args = (batch["input_ids"], batch["position_ids"], None)
        processor = _passthrough()
        losses = {}

        def step(variant: str) -> tuple[float, float]:
            if variant == "stock":
                torch_impl.disable_output_processor(model)
                kwargs: dict[str, Any] = {}
            else:
                torch_impl.enable_output_processor(model)
                kwargs = {"output_processor": processor} if variant.endswith("pass-through") else {}
            model.zero_grad(set_to_none=True)
            t0, c0 = time.perf_counter(), time.process_time()
            loss = model(*args, labels=batch["labels"], **kwargs)
            loss.sum().backward()
            elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - c0
            losses[variant] = loss.detach()
            return elapsed, cpu_s

        for variant in times:  # warm-up
            step(variant)
        for i in range(size["iters"]):
            order = list(times) if i % 2 == 0 else list(reversed(times))
            for variant in order:
                wall, cpu_s = step(variant)
                times[variant].append(wall)
                cpu[variant].append(cpu_s)
        same = all(torch.equal(losses["stock"], v) for v in losses.values())
    rows = []
    stock_med, stock_min = statistics.median(times["stock"]), min(times["stock"])
    stock_cpu = statistics.median(cpu["stock"])
    for variant, ts in times.items():
        rows.append(
            {
                "variant": variant,
                "median_s": statistics.median(ts),
                "min_s": min(ts),
                "cpu_median_s": statistics.median(cpu[variant]),
                "median_vs_stock": ratio(statistics.median(ts), stock_med),
                "min_vs_stock": ratio(min(ts), stock_min),
                "cpu_median_vs_stock": ratio(statistics.median(cpu[variant]), stock_cpu),
                "iters": len(ts),
                "same_loss_bitwise": same,
                "load_avg": round(load_average(), 2),
                **{k: v for k, v in size.items() if k != "iters"},
            }
        )
    return rows


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [r["variant"] for r in rows]
    ax.bar(names, [r["min_vs_stock"] for r in rows], label="wall min / stock")
    ax.plot(names, [r["median_vs_stock"] for r in rows], "ko", label="wall median / stock")
    ax.plot(names, [r["cpu_median_vs_stock"] for r in rows], "r^", label="CPU-time median / stock")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(1.01, color="red", lw=0.8, ls="--", label="target 1.01")
    keys = ("min_vs_stock", "median_vs_stock", "cpu_median_vs_stock")
    lo = min(r[k] for r in rows for k in keys)
    hi = max(r[k] for r in rows for k in keys)
    ax.set_ylim(min(0.95, lo - 0.01), max(1.05, hi + 0.01))
    ax.set_title("hook overhead, forward + backward")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.hook_overhead", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    size = dict(QUICK if args.quick else FULL)
    if args.iters:
        size["iters"] = args.iters
    rows = run(size)
    columns = list(rows[0])
    write_csv(rows, args.out / "hook_overhead.csv", columns)
    _plot(rows, args.out / "hook_overhead.png")
    for r in rows:
        print(
            f"{r['variant']:<24} median {r['median_s']:.3f} s ({r['median_vs_stock']:.3f}x), "
            f"min {r['min_s']:.3f} s ({r['min_vs_stock']:.3f}x), "
            f"CPU time median {r['cpu_median_s']:.3f} s ({r['cpu_median_vs_stock']:.3f}x)"
        )
    print(f"losses bitwise equal to stock: {rows[0]['same_loss_bitwise']}")
    print(f"wrote {args.out / 'hook_overhead.csv'}, {args.out / 'hook_overhead.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
