"""``bench.png``: the median latency of every measured row, per (size, batch) and backend, as a
bar chart (matplotlib's Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..measure import BenchRow


def write_plot(rows: Sequence[BenchRow], path: Path) -> Path:
    """Bar chart of median latency per (size, batch) and backend, as a PNG (matplotlib Agg)."""
    from qkrope._deps import require

    mpl = require("matplotlib", "qkrope bench's plot")
    mpl.use("Agg", force=True)
    plt = require("matplotlib.pyplot", "qkrope bench's plot")
    ok = [r for r in rows if r.status == "ok" and r.median_ms is not None
          and r.backend != "kernel"]
    groups = sorted({(r.size, r.batch) for r in ok})
    many_threads = len({r.threads for r in ok}) > 1

    def series(r: BenchRow) -> str:
        label = r.backend + (f" {r.attention}" if r.attention and r.attention != "sdpa" else "")
        return label + (f" ({r.threads} thr)" if many_threads and r.threads else "")

    backends = list(dict.fromkeys(series(r) for r in ok))
    fig, ax = plt.subplots(figsize=(max(5.0, (0.6 + 0.3 * len(backends)) * len(groups) + 2),
                                    3.8), dpi=100)
    width = 0.8 / max(1, len(backends))
    for i, b in enumerate(backends):
        xs, ys = [], []
        for g, (size, batch) in enumerate(groups):
            hit = [r for r in ok if series(r) == b and (r.size, r.batch) == (size, batch)]
            if hit:
                xs.append(g + i * width)
                ys.append(hit[0].median_ms)
        ax.bar(xs, ys, width=width, label=b)
    ax.set_xticks([g + width * (len(backends) - 1) / 2 for g in range(len(groups))])
    ax.set_xticklabels([f"{s}px\nbatch {b}" for s, b in groups])
    ax.set_ylabel("median latency (ms)")
    dev = ok[0].device if ok else "no measurements"
    ax.set_title(f"Qwen-Image attention block ({dev})", fontsize=9)
    if backends:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path
