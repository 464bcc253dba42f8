"""The goodput timeline picture (matplotlib, the ``examples`` extra)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from distrain._src.goodput.ledger import BUCKETS

if TYPE_CHECKING:
    from distrain._src.goodput.report import Report

COLORS = {
    "step": "#2ca02c",
    "startup": "#7f7f7f",
    "compile": "#9467bd",
    "input": "#1f77b4",
    "checkpoint": "#ff7f0e",
    "evaluation": "#17becf",
    "sync": "#bcbd22",
    "hang": "#8c564b",
    "other": "#c7c7c7",
}


def plot_timeline(r: Report, path: str) -> None:
    """One band per attempt from its process start to its last record; each interval
    between two records is split in the buckets it was charged to."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "The goodput timeline needs matplotlib: pip install 'distrain[examples]'."
        ) from e
    t0 = r.attempts[0].start
    n = len(r.attempts)
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.5 * n))
    for i, a in enumerate(r.attempts):
        y = n - 1 - i
        prev_t, prev = a.start, dict.fromkeys(BUCKETS, 0.0)
        for t, _step, totals in a.records:
            x = prev_t - t0
            for k in BUCKETS:
                width = max(0.0, float(totals.get(k, 0.0)) - prev[k])
                if width > 0:
                    ax.broken_barh([(x, width)], (y - 0.35, 0.7), color=COLORS[k], lw=0)
                    x += width
            prev_t, prev = t, {k: float(totals.get(k, 0.0)) for k in BUCKETS}
        for t, _ in a.saves:
            ax.plot([t - t0] * 2, [y - 0.4, y + 0.4], color="black", lw=0.8)
        if not a.finished and i + 1 < n:
            # Lost work: from the record of the step the next attempt resumed from.
            resume = r.attempts[i + 1].resumed_from or 0
            kept = [t for t, s, _ in a.records if s is not None and s <= resume]
            lost_from = kept[-1] if kept else a.start
            ax.broken_barh(
                [(lost_from - t0, a.end - lost_from)],
                (y - 0.35, 0.7),
                facecolor="none",
                edgecolor="red",
                hatch="///",
                lw=0,
            )
            ax.plot(a.end - t0, y, marker="x", color="red", ms=10, mew=2)
            ax.axvspan(a.end - t0, r.attempts[i + 1].start - t0, color="#f2d0d0", lw=0)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    labels = ["productive" if k == "step" else k for k in COLORS]
    ax.legend(
        handles,
        labels,
        ncol=len(labels),
        loc="lower center",
        fontsize=8,
        bbox_to_anchor=(0.5, 1.0),
        frameon=False,
    )
    ax.set_yticks(range(n), [f"attempt {n - j}" for j in range(n)])
    ax.set_xlabel(
        "seconds since the first start (red: a failure, the work it lost (hatched) and the "
        "downtime after it; ticks: saves)"
    )
    ax.set_title(f"goodput {r.goodput:.1%}, wall {r.wall_s:.0f} s, {r.failures} failure(s)", pad=24)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
