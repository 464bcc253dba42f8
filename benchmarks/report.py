"""Turns benchmark samples into medians, target ratios, a text table, Markdown and a plot.

Pure functions of the results dictionary that ``benchmarks/run.py`` writes, so a saved
``latest.json`` can be re-rendered: ``python -m benchmarks.report results.json``.

Example:
  >>> summarize_group({"configs": {"jax_shard_map": {"samples": [{"steps_per_sec": 90.0}]}}})
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from typing import Any

LABELS = {
    "jax_shard_map": "(a) hand-written jit(shard_map)",
    "jax_shard_map_numpy": "(a') hand-written + NumPy shuffled feed",
    "jax_shard_map_spe": '(a") hand-written, 8 steps per call',
    "distrain_run": "(b) distrain strategy.run",
    "distrain_run_pipeline": "(c) strategy.run + ArrayPipeline",
    "distrain_fit": "(d) distrain Trainer.fit",
    "distrain_fit_spe": "(d') Trainer.fit steps_per_execution=8",
    "distrain_fit_pipeline": '(d") Trainer.fit + ArrayPipeline (device-resident input)',
    "distrain_fit_pipeline_host": "(d3) Trainer.fit + ArrayPipeline, host input",
    "distrain_fit_auto": "(d4) Trainer.fit + ArrayPipeline, steps_per_execution auto",
    "keras_jax_fit": "(e) Keras 3 JAX DataParallel fit",
    "tf_mirrored_fit": "(e') TF MirroredStrategy Model.fit",
}

# (name, numerator, denominator, target or None, source of the target)
RATIOS: tuple[tuple[str, str, str, float | None, str], ...] = (
    ("strategy.run / hand-written", "distrain_run", "jax_shard_map", 0.97, "issue 2"),
    ("pipeline / pre-staged (run)", "distrain_run_pipeline", "distrain_run", 0.90, "issue 2"),
    ("Trainer.fit / hand-written", "distrain_fit", "jax_shard_map", 0.97, "issue 3"),
    ("fit steps_per_execution / hand-written", "distrain_fit_spe", "jax_shard_map", 1.0, "issue 3"),
    ("fit pipeline / fit pre-staged", "distrain_fit_pipeline", "distrain_fit", 0.90, "issue 8"),
    ("fit pipeline / hand-written", "distrain_fit_pipeline", "jax_shard_map", 0.90, "issue 13"),
    (
        "fit host pipeline / hand-written",
        "distrain_fit_pipeline_host",
        "jax_shard_map",
        None,
        "issue 13",
    ),
    ("fit auto spe / hand-written", "distrain_fit_auto", "jax_shard_map", None, "issue 13"),
    ("fit pipeline / Keras 3 JAX fit", "distrain_fit_pipeline", "keras_jax_fit", 1.15, "issue 8"),
    (
        "fit pipeline / TF MirroredStrategy fit",
        "distrain_fit_pipeline",
        "tf_mirrored_fit",
        2.0,
        "issue 8",
    ),
    # No target: what unrolling 8 steps per compiled call gives a loop without distrain.
    (
        "hand-written k=8 / hand-written",
        "jax_shard_map_spe",
        "jax_shard_map",
        None,
        "reference",
    ),
    # No target: what any loop pays for shuffled host input (no distrain code involved).
    (
        "hand-written NumPy-fed / hand-written",
        "jax_shard_map_numpy",
        "jax_shard_map",
        None,
        "reference",
    ),
    # No target: how far any JAX loop could get past the peers (the floor's own
    # margin, with data already on the devices); a peer target above it is out of reach.
    ("hand-written / Keras 3 JAX fit", "jax_shard_map", "keras_jax_fit", None, "reference"),
    (
        "hand-written / TF MirroredStrategy fit",
        "jax_shard_map",
        "tf_mirrored_fit",
        None,
        "reference",
    ),
)


def _median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize_config(entry: dict[str, Any]) -> dict[str, Any]:
    """Adds medians (steps/s, host us/step, gap us, startup ms) to one config's entry."""
    samples = entry.get("samples") or []
    sps = [s["steps_per_sec"] for s in samples]
    entry["median_steps_per_sec"] = _median(sps)
    entry["min_steps_per_sec"] = min(sps) if sps else None
    entry["max_steps_per_sec"] = max(sps) if sps else None
    for key in ("host_us_per_step", "cpu_ms_per_step", "gap_us", "startup_ms"):
        entry[f"median_{key}"] = _median([s.get(key) for s in samples])
    return entry


def paired_ratio(num: dict[str, Any], den: dict[str, Any]) -> float | None:
    """Median over rounds of ``num`` steps/s / ``den`` steps/s in the same round.

    Both ran moments apart, so a busy spell of the shared machine mostly cancels out;
    this is steadier than the ratio of the two medians. Samples without a ``round``
    are paired in order.
    """

    def by_round(entry: dict[str, Any]) -> dict[int, float]:
        samples = entry.get("samples") or []
        return {s.get("round", i): s["steps_per_sec"] for i, s in enumerate(samples)}

    a, b = by_round(num), by_round(den)
    return _median([a[r] / b[r] for r in a if r in b and b[r] > 0])


def summarize_group(group: dict[str, Any]) -> dict[str, Any]:
    """Medians per config and the target ratios (``met`` is None when a side is missing).

    ``value`` is the median of per-round ratios (:func:`paired_ratio`);
    ``ratio_of_medians`` is kept alongside.
    """
    configs = group["configs"]
    for entry in configs.values():
        summarize_config(entry)
    ratios = []
    for name, num, den, target, source in RATIOS:
        a = configs.get(num, {}).get("median_steps_per_sec")
        b = configs.get(den, {}).get("median_steps_per_sec")
        value = paired_ratio(configs[num], configs[den]) if a and b else None
        met = None if value is None or target is None else value >= target
        ratios.append(
            {
                "name": name,
                "numerator": num,
                "denominator": den,
                "value": value,
                "ratio_of_medians": a / b if a and b else None,
                "target": target,
                "met": met,
                "source": source,
            }
        )
    group["ratios"] = ratios
    return group


def _short(text: str, n: int = 160) -> str:
    """One line of at most ``n`` characters (worker errors can carry stack traces)."""
    line = " ".join(str(text).split())
    return line if len(line) <= n else line[: n - 3] + "..."


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def text_table(results: dict[str, Any]) -> str:
    """A fixed-width table of every group, then its ratios."""
    lines = []
    for g in results["groups"]:
        lines.append(
            f"\n{g['workload']} (global batch {g['global_batch_size']}), {g['devices']} "
            f"device(s), {g['steps_per_repeat']} steps x {g['repeats']} interleaved repeats"
        )
        lines.append(
            f"  {'configuration':42s} {'steps/s':>8s} {'min-max':>13s} "
            f"{'host us/step':>12s} {'cpu ms/step':>11s} {'gap us':>7s}"
        )
        for name, e in g["configs"].items():
            label = LABELS.get(name, name)
            if e.get("skipped"):
                lines.append(f"  {label:42s} skipped: {_short(e['skipped'])}")
                continue
            rng = f"{_fmt(e['min_steps_per_sec'], '.0f')}-{_fmt(e['max_steps_per_sec'], '.0f')}"
            lines.append(
                f"  {label:42s} {_fmt(e['median_steps_per_sec'], '8.1f')} {rng:>13s} "
                f"{_fmt(e['median_host_us_per_step'], '12.0f')} "
                f"{_fmt(e['median_cpu_ms_per_step'], '11.2f')} {_fmt(e['median_gap_us'], '7.1f')}"
            )
        for r in g["ratios"]:
            if r["value"] is None:
                continue
            verdict = "" if r["met"] is None else ("  met" if r["met"] else "  NOT met")
            target = "" if r["target"] is None else f" (target >= {r['target']:.2f})"
            lines.append(
                f"    {r['name']:42s} {r['value']:.3f} (of medians {r['ratio_of_medians']:.3f})"
                f"{target}{verdict}"
            )
    return "\n".join(lines)


def markdown_tables(results: dict[str, Any]) -> str:
    """Markdown: one table of steps/s per group, then one table of all ratios."""
    out = []
    for g in results["groups"]:
        out.append(
            f"**{g['workload'].upper()}, {g['devices']} device(s)** "
            f"(global batch {g['global_batch_size']}, {g['steps_per_repeat']} steps x "
            f"{g['repeats']} repeats)\n"
        )
        out.append(
            "| configuration | median steps/s | min-max | host us/step | CPU ms/step | gap us |"
        )
        out.append("| --- | ---: | ---: | ---: | ---: | ---: |")
        for name, e in g["configs"].items():
            label = LABELS.get(name, name)
            if e.get("skipped"):
                out.append(f"| {label} | skipped: {_short(e['skipped'])} | | | | |")
                continue
            out.append(
                f"| {label} | {_fmt(e['median_steps_per_sec'], '.1f')} | "
                f"{_fmt(e['min_steps_per_sec'], '.0f')}-{_fmt(e['max_steps_per_sec'], '.0f')} | "
                f"{_fmt(e['median_host_us_per_step'], '.0f')} | "
                f"{_fmt(e['median_cpu_ms_per_step'], '.2f')} | {_fmt(e['median_gap_us'], '.1f')} |"
            )
        out.append("")
    out.append(
        "| workload | devices | ratio (median of per-round ratios) | value | ratio of medians "
        "| target | result |"
    )
    out.append("| --- | ---: | --- | ---: | ---: | ---: | --- |")
    for g in results["groups"]:
        for r in g["ratios"]:
            if r["value"] is None:
                continue
            target = "-" if r["target"] is None else f">= {r['target']:.2f} ({r['source']})"
            verdict = "-" if r["met"] is None else ("met" if r["met"] else "**not met**")
            out.append(
                f"| {g['workload']} | {g['devices']} | {r['name']} | {r['value']:.3f} | "
                f"{r['ratio_of_medians']:.3f} | {target} | {verdict} |"
            )
    return "\n".join(out) + "\n"


def plot(results: dict[str, Any], path: str) -> None:
    """Horizontal bars of median steps/s (whiskers: min-max), one panel per group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = results["groups"]
    fig, axes = plt.subplots(
        len(groups), 1, figsize=(9, 2.2 + 0.45 * 8 * len(groups) / 2), squeeze=False
    )
    for ax, g in zip(axes[:, 0], groups, strict=True):
        names = [n for n, e in g["configs"].items() if e.get("median_steps_per_sec")]
        med = [g["configs"][n]["median_steps_per_sec"] for n in names]
        lo = [m - g["configs"][n]["min_steps_per_sec"] for n, m in zip(names, med, strict=True)]
        hi = [g["configs"][n]["max_steps_per_sec"] - m for n, m in zip(names, med, strict=True)]
        colors = [
            "#888888"
            if n.startswith("jax_shard_map")
            else "#1f77b4"
            if n.startswith("distrain")
            else "#d62728"
            for n in names
        ]
        ys = range(len(names))
        ax.barh(ys, med, xerr=[lo, hi], color=colors, capsize=3)
        ax.set_yticks(list(ys), [LABELS.get(n, n) for n in names], fontsize=8)
        ax.invert_yaxis()
        for y, m, h in zip(ys, med, hi, strict=True):
            ax.text(m + h, y, f"  {m:.0f}", va="center", fontsize=7)
        ax.set_title(
            f"{g['workload'].upper()}, {g['devices']} virtual CPU device(s), global "
            f"batch {g['global_batch_size']}",
            fontsize=9,
        )
        ax.set_xlabel("steps/s (median of interleaved repeats; whiskers min-max)", fontsize=8)
    fig.suptitle(results["meta"].get("machine_summary", ""), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Render saved benchmark results.")
    parser.add_argument("results", help="JSON written by `python -m benchmarks.run`")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument("--plot", help="write a PNG plot here")
    args = parser.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    for group in results["groups"]:
        summarize_group(group)
    print(markdown_tables(results) if args.markdown else text_table(results))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
