"""``qkrope.apps.measure``: the bytes the fused kernel moves, the timing statistics, the
peak-bandwidth table, the timers of ``qkrope bench`` and a child's own peak memory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from qkrope.apps import measure


def test_bytes_moved_matches_the_design_figure():
    # 1024x1024 image (4096 tokens) + 512 text tokens, 24 heads x 128, bf16, fp32 cache.
    assert measure.image_tokens(1024) == 4096 and measure.image_tokens(512) == 1024
    n = measure.qknorm_rope_bytes(4096, 512, 24, 128, act_bytes=2)
    # q, k read + q_out, k_out written: 4 x 4608 x 24 x 128 x 2 B = 113,246,208
    # cache rows: 4608 x 128 x 4 B = 2,359,296; weights: 4 x 128 x 2 B = 1,024
    assert n == 113_246_208 + 2_359_296 + 1_024 == 115_606_528
    assert round(n / 1e6, 1) == 115.6                       # DESIGN.md: "about 115.6 MB"
    assert round(n / 4.8e12 * 1e6, 1) == 24.1               # "24.1 us at 4.8 TB/s"
    # batch doubles the activations, not the cache rows or weights
    assert measure.qknorm_rope_bytes(4096, 512, 24, 128, batch=2) == 2 * 113_246_208 + 2_360_320
    # partial rotary reads fewer cache columns
    assert measure.qknorm_rope_bytes(1, 0, 1, 128, rotary_dim=64, act_bytes=4) == \
        4 * 128 * 4 + 2 * 128 * 4 + 64 * 4 + 2 * 128 * 4


def test_summarize():
    st = measure.summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert st["median_ms"] == 3.0 and st["min_ms"] == 1.0 and st["mean_ms"] == 3.0
    assert st["p10_ms"] == pytest.approx(1.4) and st["p90_ms"] == pytest.approx(4.6)
    assert st["n"] == 5
    assert measure.summarize([2.0])["stdev_ms"] == 0.0
    assert measure.summarize([1.0, 2.0])["median_ms"] == 1.5
    with pytest.raises(ValueError):
        measure.summarize([])


def test_peak_table_and_parsing():
    assert measure.peak_gbps("NVIDIA H200") == 4800.0
    assert measure.peak_gbps("NVIDIA H100 PCIe") == 2000.0
    assert measure.peak_gbps("NVIDIA H100 80GB HBM3") == 3350.0
    assert measure.peak_gbps("NVIDIA GH200 480GB") == 4000.0
    assert measure.peak_gbps("Some Future GPU") is None
    assert measure.peak_gbps("NVIDIA H200", override=1234) == 1234.0
    with pytest.raises(ValueError):
        measure.image_tokens(500)


def test_time_interleaved_rotates_backends_and_isolates_failures():
    calls = []

    def boom():
        calls.append("c")
        if len([c for c in calls if c == "c"]) > 2:
            raise RuntimeError("third call")

    res = measure.time_interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b"),
                                  "c": boom}, iters=4, warmup=1)
    assert calls[:3] == ["a", "b", "c"]                       # warm-up, one each
    timed = calls[3:]
    assert timed[:3] == ["a", "b", "c"] and timed[3:6] == ["b", "c", "a"]  # rotating order
    assert isinstance(res["c"], RuntimeError)
    assert len(res["a"]) == 4 and len(res["b"]) == 4


def test_time_cpu_counts_calls():
    calls = []
    times = measure.time_cpu(lambda: calls.append(1), iters=4, warmup=2)
    assert len(times) == 4 and len(calls) == 6 and all(t >= 0 for t in times)


# --------------------------------------------------------------------------------------------
# run_peak_rss: a child's own peak, not its spawner's
# --------------------------------------------------------------------------------------------

_ALLOCATE = "import sys; b = bytearray(b'\\x01') * (int(sys.argv[1]) << 20); print(len(b))"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="requires Linux (ru_maxrss)")
def test_run_peak_rss_reports_the_child_not_a_fat_parent(tmp_path):
    """A parent holding 512 MiB (touched, so resident) runs a small child. Spawned directly, the
    child's wait4 ru_maxrss is at least the parent's 512 MiB (the premise: Linux folds the image
    that exec replaces into the new one's high-water mark); through run_peak_rss it is the
    child's own: a bare interpreter, far below 128 MiB. A child that does allocate 256 MiB is
    measured at 256 MiB or more, so the helper does not just report a floor."""
    ballast = bytearray(b"\x01") * (512 << 20)  # noqa: F841  (held until the end)
    small = [sys.executable, "-I", "-S", "-c", "pass"]
    proc = subprocess.Popen(small)
    _, status, usage = os.wait4(proc.pid, 0)
    assert status == 0 and usage.ru_maxrss / 1024 >= 512, \
        f"premise: a direct child reports {usage.ru_maxrss / 1024:.0f} MiB"

    run = measure.run_peak_rss(small)
    assert run.returncode == 0 and 0 < run.peak_mib < 128, run

    with open(tmp_path / "out", "w") as out:
        big = measure.run_peak_rss([sys.executable, "-I", "-S", "-c", _ALLOCATE, "256"],
                                   stdout=out)
    assert big.returncode == 0 and big.peak_mib >= 256, big
    assert (tmp_path / "out").read_text().strip() == str(256 << 20)  # its stdout went there
    assert big.wall_s > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="requires Linux (ru_maxrss)")
def test_run_peak_rss_passes_exit_status_and_refuses_pipes():
    assert measure.run_peak_rss([sys.executable, "-I", "-S", "-c", "raise SystemExit(3)"]
                                ).returncode == 3
    assert measure.run_peak_rss(
        [sys.executable, "-I", "-S", "-c", "import os, signal; os.kill(os.getpid(), 9)"]
    ).returncode == -9
    assert measure.run_peak_rss(["/nonexistent/qkrope-no-such-program"],
                                stderr=subprocess.DEVNULL).returncode == 127
    with pytest.raises(ValueError, match="not PIPE"):
        measure.run_peak_rss(["true"], stdout=subprocess.PIPE)
