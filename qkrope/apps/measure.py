"""Timing, result rows and tables: the one module shared by ``qkrope bench``, ``qkrope check``,
the kernel timing method (:mod:`qkrope.apps.kernel_bench`) and the scripts
(``scripts/bench_kernel.py``, ``scripts/bench_export.py``).

- sizes and rates: image tokens of a resolution, the op's minimum DRAM traffic, peak bandwidth
  of known GPUs;
- timing: per-call timers (``perf_counter``, CUDA events), backends timed interleaved, and the
  statistics reported (median, p10/p90);
- a child process's own peak memory (:func:`run_peak_rss`);
- the machine a measurement ran on;
- result rows (:class:`BenchRow` of ``qkrope bench``, :class:`CheckRow` of ``qkrope check``) and
  their tables.
"""

from __future__ import annotations

import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from qkrope.errors import InputError
from qkrope.runtime.profiles import PIXELS_PER_TOKEN  # one image token per 16x16 pixels


# --------------------------------------------------------------------------------------------
# Sizes and rates
# --------------------------------------------------------------------------------------------

# Peak HBM / GDDR bandwidth in GB/s (1 GB = 1e9 B), from the vendors' data sheets. Matched by
# substring of torch.cuda.get_device_name(), longest key first.
PEAK_GBPS = {
    "H200": 4800.0,
    "H100 NVL": 3900.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,          # SXM5 80 GB
    "H800": 3350.0,
    "H20": 4000.0,
    "GH200": 4000.0,
    "B200": 8000.0,
    "GB200": 8000.0,
    "B100": 8000.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100-PCIE-40GB": 1555.0,
    "A100-SXM4-40GB": 1555.0,
    "A100": 1555.0,
    "A10G": 600.0,
    "A10": 600.0,
    "L40S": 864.0,
    "L40": 864.0,
    "L4": 300.0,
    "RTX 6000 Ada": 960.0,
    "RTX 4090": 1008.0,
    "RTX 3090": 936.0,
    "V100": 900.0,
    "T4": 320.0,
}


def image_tokens(size_px: int, pixels_per_token: int = PIXELS_PER_TOKEN) -> int:
    """Image tokens of a square ``size_px`` image: ``(size_px / 16) ** 2``."""
    if size_px <= 0 or size_px % pixels_per_token:
        raise InputError(f"image size must be a positive multiple of {pixels_per_token} px; "
                         f"got {size_px}")
    side = size_px // pixels_per_token
    return side * side


def qknorm_rope_stream_bytes(tokens: int, heads: int, head_dim: int, *, batch: int = 1,
                             act_bytes: int = 2, rotary_dim: int | None = None,
                             cache_bytes: int = 4) -> int:
    """Minimum DRAM traffic of one QKNormRoPE launch (one stream of S = ``tokens`` tokens): q and
    k read, q_out and k_out written (4 x B*S*H*D activations), the two RMSNorm weights ([D] each,
    activation dtype) and the S cache rows it uses (S x rotary_dim fp32; rows are shared across
    the batch, so read once). The one formula of the project (``qkrope bench`` and
    ``scripts/bench_kernel.py``)."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    return (4 * batch * tokens * heads * head_dim * act_bytes + 2 * head_dim * act_bytes
            + tokens * rotary_dim * cache_bytes)


def qknorm_rope_bytes(img_tokens: int, txt_tokens: int, heads: int, head_dim: int, *,
                      batch: int = 1, act_bytes: int = 2, rotary_dim: int | None = None,
                      cache_bytes: int = 4) -> int:
    """Minimum DRAM traffic of the op over both streams of one attention block (the image and
    the text launch): :func:`qknorm_rope_stream_bytes` of each."""
    return sum(qknorm_rope_stream_bytes(s, heads, head_dim, batch=batch, act_bytes=act_bytes,
                                        rotary_dim=rotary_dim, cache_bytes=cache_bytes)
               for s in (img_tokens, txt_tokens))


def peak_gbps(device_name: str | None, override: float | None = None) -> float | None:
    """Peak memory bandwidth for ``device_name`` (GB/s), ``override`` first; None if unknown."""
    if override is not None:
        return float(override)
    if not device_name:
        return None
    for key in sorted(PEAK_GBPS, key=len, reverse=True):
        if key.lower() in device_name.lower():
            return PEAK_GBPS[key]
    return None


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------

def summarize(times_ms: Sequence[float]) -> dict[str, float]:
    """median / mean / min / p10 / p90 / stdev of per-call times (ms)."""
    if not times_ms:
        raise InputError("no timings to summarise")
    xs = sorted(float(t) for t in times_ms)

    def pct(p: float) -> float:  # linear interpolation, like numpy's default
        pos = (len(xs) - 1) * p
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"median_ms": statistics.median(xs), "mean_ms": statistics.fmean(xs),
            "min_ms": xs[0], "p10_ms": pct(0.10), "p90_ms": pct(0.90),
            "stdev_ms": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


def time_cpu(fn: Callable[[], Any], *, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def time_one_cuda(fn: Callable[[], Any]) -> float:
    """One call timed alone with CUDA events on the current stream (ms)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def time_one_cpu(fn: Callable[[], Any]) -> float:
    """One call timed alone with ``perf_counter`` (ms)."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_interleaved(fns: Mapping[str, Callable[[], Any]], *, iters: int, warmup: int,
                     cuda: bool = False) -> dict[str, list[float] | BaseException]:
    """Per-call times (ms) of several backends measured **interleaved**: every round calls each
    backend once, the order rotating from round to round, so a change in machine load (another
    process, thermal state) hits every backend alike instead of whichever ran last. Each call is
    timed alone. A backend that raises gets its exception instead of a list; the others go on."""
    one = time_one_cuda if cuda else time_one_cpu
    out: dict[str, list[float] | BaseException] = {}
    live = []
    for name, fn in fns.items():
        try:
            for _ in range(warmup):
                fn()
        except Exception as exc:  # noqa: BLE001 - reported per backend
            out[name] = exc
            continue
        out[name] = []
        live.append(name)
    for i in range(iters):
        k = i % len(live) if live else 0
        for name in live[k:] + live[:k]:
            if isinstance(out[name], BaseException):
                continue
            try:
                out[name].append(one(fns[name]))  # type: ignore[union-attr]
            except Exception as exc:  # noqa: BLE001
                out[name] = exc
    return out


# --------------------------------------------------------------------------------------------
# Peak memory of a child process
# --------------------------------------------------------------------------------------------

# The intermediate of run_peak_rss: it forks, execs the command in the child, waits for it with
# wait4 and writes "<wait status> <ru_maxrss KiB>" to the file descriptor it was given. Run as
# `python -I -S`: no site packages, no environment-driven imports, about 10 MiB resident, which
# is the floor the measured figure can inherit (Linux folds the resident set of the image that
# exec replaces into the new image's ru_maxrss).
_PEAK_INTERMEDIATE = r"""
import os, sys
fd, argv = int(sys.argv[1]), sys.argv[2:]
pid = os.fork()
if pid == 0:
    os.close(fd)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        os.write(2, f"cannot run {argv[0]!r}: {exc}\n".encode())
    os._exit(127)
_, status, usage = os.wait4(pid, 0)
os.write(fd, f"{status} {usage.ru_maxrss}".encode())
"""


@dataclass(frozen=True)
class PeakRun:
    """One command run by :func:`run_peak_rss`."""

    returncode: int      # as subprocess reports it: negative for a signal
    peak_mib: float      # the command's own peak resident set size
    wall_s: float


def run_peak_rss(argv: Sequence[str], *, stdout=None, stderr=None, env=None,
                 cwd=None) -> PeakRun:
    """Run ``argv`` to completion and return its exit status, its own peak resident set size and
    its wall time (Linux).

    ``wait4``'s ``ru_maxrss`` of a child is not the child's alone: at ``execve`` Linux folds the
    high-water mark of the memory image being replaced into the new one's, and the image a child
    of ``subprocess`` replaces is its parent's (``vfork``) or a copy of it (``fork``). Measured
    from a test worker or a script that has built a model, a small command reports the spawning
    process's peak instead of its own. The command is therefore started by a ~10 MiB
    intermediate interpreter that forks and execs it and reports the grandchild's
    ``ru_maxrss``: the floor it can inherit is the intermediate's, not the caller's
    (``tests/test_measure.py`` checks this with a parent holding 512 MiB).
    ``stdout``/``stderr`` (a file, ``DEVNULL`` or None: not ``PIPE``, which nothing would drain
    while the report is awaited), ``env`` and ``cwd`` are passed to :class:`subprocess.Popen`."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"run_peak_rss needs Linux (ru_maxrss in KiB), not {sys.platform}")
    if subprocess.PIPE in (stdout, stderr):
        raise ValueError("run_peak_rss: pass a file or DEVNULL for stdout/stderr, not PIPE")
    read_fd, write_fd = os.pipe()
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _PEAK_INTERMEDIATE, str(write_fd), *argv],
            stdout=stdout, stderr=stderr, env=env, cwd=cwd, pass_fds=(write_fd,))
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    with os.fdopen(read_fd, "rb") as report:
        text = report.read().decode()
    proc.wait()
    wall = time.perf_counter() - t0
    if proc.returncode or not text:
        raise RuntimeError(f"the peak-memory intermediate failed (exit {proc.returncode}) "
                           f"running {list(argv)!r}")
    status, kib = (int(v) for v in text.split())
    return PeakRun(os.waitstatus_to_exitcode(status), kib / 1024, wall)


# --------------------------------------------------------------------------------------------
# Machine
# --------------------------------------------------------------------------------------------

def machine_info(device: str = "cpu") -> dict[str, str]:
    """CPU model, GPU name and the versions of torch / ONNX Runtime / TensorRT; on a CUDA device
    also its SM count, L2, memory, driver and clocks (:func:`gpu_details`)."""
    info: dict[str, str] = {"cpu": _cpu_model(), "cores": str(os.cpu_count() or "?"),
                            "python": platform.python_version()}
    import torch

    info["torch"] = torch.__version__
    try:
        import onnxruntime as ort

        info["onnxruntime"] = ort.__version__
    except ImportError:
        info["onnxruntime"] = "not installed"
    try:
        import tensorrt as trt  # noqa: F401

        info["tensorrt"] = trt.__version__
    except ImportError:
        info["tensorrt"] = "not installed"
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
        info["cuda"] = str(torch.version.cuda)
        info.update(gpu_details(torch.device(device)))
    return info


def gpu_details(device) -> dict[str, str]:
    """SM count, L2 size, compute capability and memory of a CUDA device (PyTorch), plus the
    driver version and current / maximum clocks from ``nvidia-smi`` where it runs."""
    import subprocess

    import torch

    props = torch.cuda.get_device_properties(device)
    info = {"sm_count": str(props.multi_processor_count),
            "l2_mib": f"{getattr(props, 'L2_cache_size', 0) / 2**20:g}",
            "compute_capability": f"{props.major}.{props.minor}",
            "gpu_memory_gib": f"{props.total_memory / 2**30:.0f}"}
    if getattr(props, "memory_bus_width", 0):
        info["memory_bus_bits"] = str(props.memory_bus_width)
    uuid = str(getattr(props, "uuid", "") or "")
    # nvidia-smi by UUID (CUDA_VISIBLE_DEVICES may renumber the devices), else by index
    idents = ([uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"] if uuid else []) \
        + [str(torch.device(device).index or 0)]
    fields = ("driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem")
    smi = shutil.which("nvidia-smi")
    for ident in idents if smi else []:
        try:
            out = subprocess.run([smi, f"--id={ident}", f"--query-gpu={','.join(fields)}",
                                  "--format=csv,noheader,nounits"], capture_output=True,
                                 text=True, timeout=15, check=False).stdout.strip()
            vals = [v.strip() for v in out.splitlines()[0].split(",")] if out else []
        except (OSError, subprocess.SubprocessError, IndexError):
            vals = []
        if len(vals) == len(fields):
            info["driver"] = vals[0]
            info["clocks_mhz"] = f"sm {vals[1]}/{vals[2]} max, mem {vals[3]}/{vals[4]} max"
            break
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# --------------------------------------------------------------------------------------------
# Rows and tables
# --------------------------------------------------------------------------------------------

@dataclass
class BenchRow:
    backend: str
    size: int                 # image side in px
    img_tokens: int
    txt_tokens: int
    batch: int
    dtype: str
    status: str = "ok"        # "ok" | "skipped" | "failed"
    reason: str = ""
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    iters: int = 0
    gbps: float | None = None
    peak_fraction: float | None = None
    device: str = ""
    note: str = ""
    machine: dict = field(default_factory=dict)
    threads: int | None = None        # CPU threads of torch and ONNX Runtime in this row's set
    attention: str = ""               # attention form: "primitive" | "onnx23" (ONNX rows), "sdpa"
    ort_vs_eager: float | None = None  # ONNX Runtime median / torch-eager median, same set
    profile: dict | None = None       # ONNX Runtime per-op profile (qkrope bench, CPU)
    fused_attention: str = ""  # TensorRT inspector: yes | likely | no | unknown ("": not TensorRT)
    fused_attention_basis: str = ""   # what that answer rests on


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def format_bench_table(rows: Sequence[BenchRow]) -> str:
    """Markdown table of the measured rows (thread count and attention form of each; ONNX
    Runtime's ratio to torch eager of the same set), the rows' notes, then the skipped rows with
    their reasons."""
    threads = sorted({_row_threads(r) for r in rows if r.status == "ok"} - {None}, key=int)
    title = (f"CPU threads (torch, ONNX Runtime): {', '.join(map(str, threads))}; backends "
             f"measured interleaved, size by size" if threads else "")
    head = ("| backend | attention | threads | size | img tok | txt tok | batch | dtype | "
            "median ms | p10 ms | p90 ms | iters | vs eager | GB/s | % peak | device |")
    lines = ([title, ""] if title else []) + [head, "|" + "---|" * (head.count("|") - 1)]
    notes = []
    for r in rows:
        if r.status != "ok":
            continue
        pct = None if r.peak_fraction is None else 100.0 * r.peak_fraction
        t = _row_threads(r)
        lines.append(f"| {r.backend} | {r.attention or '-'} | {'-' if t is None else t} | "
                     f"{r.size} | {r.img_tokens} | {r.txt_tokens} | {r.batch} | "
                     f"{r.dtype} | {_fmt(r.median_ms)} | {_fmt(r.p10_ms)} | {_fmt(r.p90_ms)} | "
                     f"{r.iters} | {_fmt(r.ort_vs_eager, '.2f')} | {_fmt(r.gbps, '.0f')} | "
                     f"{_fmt(pct, '.1f')} | {r.device} |")
        if r.note:
            notes.append(f"- {_row_label(r)}: {r.note}")
    if notes:
        lines += ["", "Notes:", ""] + list(dict.fromkeys(notes))
    skipped = [r for r in rows if r.status != "ok"]
    if skipped:
        lines += ["", "Not measured:", ""]
        seen = set()
        for r in skipped:
            key = (r.backend, r.attention, r.status, r.reason)
            if key in seen:
                continue
            seen.add(key)
            n = sum(1 for x in skipped if (x.backend, x.attention, x.status, x.reason) == key)
            name = f"{r.backend} ({r.attention})" if r.attention else r.backend
            lines.append(f"- {name}: {r.status}, {r.reason} ({n} row{'s' * (n != 1)})")
    return "\n".join(lines)


def _row_threads(r: BenchRow) -> int | None:
    """The row's CPU thread count (its own field; rows written before it: the machine's)."""
    if r.threads is not None:
        return int(r.threads)
    t = r.machine.get("cpu_threads")
    return int(t) if t not in (None, "") else None


def _row_label(r: BenchRow) -> str:
    t = _row_threads(r)
    parts = [r.attention] if r.attention else []
    parts += [f"{t} thread{'s' * (t != 1)}"] if t is not None else []
    parts += [f"{r.size} px", f"batch {r.batch}"]
    return f"{r.backend} ({', '.join(parts)})"


@dataclass
class CheckRow:
    runner: str
    against: str
    output: str
    max_abs: float
    max_rel: float
    atol: float
    rtol: float
    passed: bool


def format_check_table(rows: Sequence[CheckRow]) -> str:
    """``qkrope check``'s table: one line per (runner, reference, output), pass/FAIL."""
    head = f"{'runner':<10} {'vs':<10} {'output':<10} {'max abs':>10} {'max rel':>10} " \
           f"{'atol':>10} {'rtol':>9}  result"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.runner:<10} {r.against:<10} {r.output:<10} {r.max_abs:>10.3g} "
                     f"{r.max_rel:>10.3g} {r.atol:>10.3g} {r.rtol:>9.3g}  "
                     f"{'pass' if r.passed else 'FAIL'}")
    return "\n".join(lines)
