"""``qkrope.apps.bench.plot``: bench.png, also with nothing measured."""

from __future__ import annotations

from qkrope.apps import measure
from qkrope.apps.bench import plot
from qkrope.apps.bench import rows as bench_rows


def test_plot_with_nothing_measured(tmp_path):
    row = measure.BenchRow("trt-plugin", 512, 1024, 512, 1, "bfloat16", status="skipped",
                    reason=bench_rows.REQUIRES_CUDA)
    p = plot.write_plot([row], tmp_path / "x.png")
    assert p.read_bytes()[:4] == b"\x89PNG"
    assert "- trt-plugin: skipped, requires CUDA" in measure.format_bench_table([row])
