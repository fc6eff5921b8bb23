"""The one way this project times the QKNormRoPE kernel (and the PyTorch versions of the op).

Used by ``scripts/bench_kernel.py`` (every row) and by ``qkrope bench``'s ``kernel`` rows. The
bytes formula (:func:`qkrope.apps.measure.qknorm_rope_stream_bytes`), the peak-bandwidth table
(:func:`~qkrope.apps.measure.peak_gbps`), the statistics (:func:`~qkrope.apps.measure.summarize`)
and the machine description (:func:`~qkrope.apps.measure.machine_info`) live in ``measure.py``.

Method (so that the numbers are the kernel's, not Python's):

1. ``K`` distinct buffer sets (q, k, weights, cache, q_out, k_out for every stream of the case)
   whose total size exceeds ``2 x`` the GPU's L2 (:func:`rotation_sets`), so each launch reads
   its inputs from DRAM, not from a cache the previous launch warmed.
2. fused: one call through :func:`qkrope.runtime.kernels.cuda_qk_norm_rope` (which validates
   everything), a spot check of its output against an fp32
   :func:`qkrope.export.qk_norm_rope_reference`, then the C ABI ``qkrope_launch_v3`` is called
   directly through ctypes with argument tuples prepared once per set (:func:`launch_args`); a raw
   launch must reproduce the validated output bit for bit before anything is timed.
3. ``N`` launch units (one launch per stream of the case; the ``block`` case is the img and the
   txt launch of one transformer block) cycling over the ``K`` sets are captured into one CUDA
   graph (capture runs on a side stream; every launch reads the *current* stream, so it lands in
   the capture); warm-up replays, then ``iters`` replays each between two CUDA events; per-unit
   time = elapsed / N; median and p10/p90 over the replays (:func:`time_launches`).
4. torch eager and ``torch.compile`` (static shapes, default mode, compiled and checked before
   capture) of the reference are captured and timed the same way, so kernels are compared with
   kernels. Where capture fails, events around a loop of N launches are used and the row says so.
5. GB/s = the op's minimum DRAM traffic / median time; % of peak against the GPU's data-sheet
   bandwidth (eager and compile move more than the minimum; their GB/s are "effective").
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

from qkrope import contract
from qkrope.model_io import ATTENTION_BLOCK
from qkrope.errors import InputError, QkropeError
from .measure import image_tokens, peak_gbps, qknorm_rope_stream_bytes, summarize

# Qwen-Image attention: 24 heads x 128, 512 text tokens, bf16 activations and weights.
HEADS, HEAD_DIM, TXT_TOKENS = ATTENTION_BLOCK.heads, ATTENTION_BLOCK.head_dim, 512
RESOLUTIONS = (512, 1024)        # image side in px (16 px per token: 1024 and 4096 tokens)
BATCHES = (1, 2)
STREAMS = ("img", "txt", "block")  # block = the img and the txt launch of one transformer block
BACKENDS = ("fused", "eager", "compile")

L2_FACTOR = 2.0                  # the rotated buffer sets together exceed this many L2 sizes
MIN_SETS = 2                     # never time a launch on the buffers the previous one just used
MAX_SETS = 512
DEFAULT_L2_BYTES = 64 << 20      # if the device does not report its L2 size
DEFAULT_LAUNCHES = 20            # launch units per CUDA graph (rounded up to a multiple of K)

# Spot-check tolerance against an fp32 reference: max |diff| / max |ref| (tests/_kernel_cases.py).
REL_TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


class BenchCheckError(QkropeError, RuntimeError):
    """The output that would be timed is wrong: nothing is benchmarked."""


# --------------------------------------------------------------------------------------------
# Cases, sizes, rates (pure; unit tested without a GPU)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One measured row: a resolution, a batch and a stream (``img``, ``txt`` or ``block``)."""

    resolution: int
    batch: int
    stream: str
    heads: int = HEADS
    head_dim: int = HEAD_DIM
    txt_tokens: int = TXT_TOKENS
    rotary_dim: int | None = None   # None: head_dim
    dtype: str = "bfloat16"

    def __post_init__(self):
        if self.stream not in STREAMS:
            raise InputError(f"stream must be one of {', '.join(STREAMS)}; got {self.stream!r}")
        image_tokens(self.resolution)  # validates the resolution
        if self.batch < 1:
            raise InputError(f"batch must be >= 1; got {self.batch}")

    @property
    def stream_tokens(self) -> tuple[int, ...]:
        """Tokens of each launch the case makes (one launch per stream)."""
        img = image_tokens(self.resolution)
        return {"img": (img,), "txt": (self.txt_tokens,),
                "block": (img, self.txt_tokens)}[self.stream]

    @property
    def tokens(self) -> int:
        return sum(self.stream_tokens)

    @property
    def act_bytes(self) -> int:
        return {"float32": 4, "float16": 2, "bfloat16": 2}[self.dtype]

    @property
    def rot(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def bytes(self) -> int:
        """Minimum DRAM traffic of one launch unit, which is also one buffer set's size."""
        return sum(qknorm_rope_stream_bytes(s, self.heads, self.head_dim, batch=self.batch,
                                            act_bytes=self.act_bytes, rotary_dim=self.rot)
                   for s in self.stream_tokens)

    @property
    def label(self) -> str:
        return f"{self.resolution}x{self.resolution} B={self.batch} {self.stream}"


def default_cases(resolutions: Sequence[int] = RESOLUTIONS, batches: Sequence[int] = BATCHES,
                  streams: Sequence[str] = STREAMS, **kw) -> list[Case]:
    return [Case(r, b, s, **kw) for r in resolutions for b in batches for s in streams]


def rotation_sets(set_bytes: int, l2_bytes: int, *, factor: float = L2_FACTOR,
                  min_sets: int = MIN_SETS, max_sets: int = MAX_SETS) -> int:
    """Buffer sets to rotate over: the smallest K with ``K * set_bytes > factor * l2_bytes``,
    at least ``min_sets``, at most ``max_sets``."""
    if set_bytes <= 0:
        raise InputError(f"set_bytes must be positive; got {set_bytes}")
    k = math.floor(factor * max(0, l2_bytes) / set_bytes) + 1
    return max(min_sets, min(max_sets, k))


def graph_launches(requested: int, sets: int) -> int:
    """Launch units per graph: at least ``requested`` and ``sets``, a multiple of ``sets`` (every
    set used equally often)."""
    if requested < 1 or sets < 1:
        raise InputError(f"launches and sets must be >= 1; got {requested}, {sets}")
    return sets * math.ceil(max(requested, sets) / sets)


def rates(nbytes: int, time_us: float | None, peak: float | None) -> tuple[float | None,
                                                                          float | None]:
    """(GB/s, % of peak) of ``nbytes`` moved in ``time_us``; None where unknown."""
    if not time_us or time_us <= 0:
        return None, None
    gbs = nbytes / (time_us * 1e-6) / 1e9
    return gbs, (None if not peak else 100.0 * gbs / peak)


class StreamTensors(NamedTuple):
    q: Any
    k: Any
    q_weight: Any
    k_weight: Any
    cache: Any
    q_out: Any
    k_out: Any


def launch_args(t: StreamTensors, *, eps: float, interleaved: bool, rounding: int,
                norm_scope: int = 0) -> tuple:
    """The C-ABI argument tuple of ``qkrope_launch_v3`` for these tensors, without the stream
    (in the order of ``plugins/kernel/qknorm_rope_capi.h`` and
    :func:`qkrope.runtime.kernels._call`: ..., norm_scope, dtype, the weights' dtype)."""
    from qkrope.runtime.kernels import DTYPE_CODES

    b, s, h, d = t.q.shape
    rows, rot = t.cache.shape
    return (t.q.data_ptr(), t.k.data_ptr(), t.q_weight.data_ptr(), t.k_weight.data_ptr(),
            t.cache.data_ptr(), t.q_out.data_ptr(), t.k_out.data_ptr(), int(b), int(s), int(h),
            int(d), int(rot), int(rows), float(eps), int(bool(interleaved)), int(rounding),
            int(norm_scope), DTYPE_CODES[t.q.dtype], DTYPE_CODES[t.q_weight.dtype])


# --------------------------------------------------------------------------------------------
# Timing core
# --------------------------------------------------------------------------------------------

@dataclass
class Timing:
    times_ms: list[float]     # per launch unit, one value per timed replay
    method: str
    launches: int             # launch units per graph (or per timed loop)
    sets: int
    graph: bool

    def summary(self) -> dict[str, float]:
        return summarize(self.times_ms)


def time_launches(step: Callable[[int], Any], *, sets: int, launches: int, iters: int,
                  warmup: int, cuda: Any = None) -> Timing:
    """Time ``step(i)`` (the work on buffer set ``i``, issued on the current stream).

    Every set is run once on a side stream (lazy initialisation, compilation, allocator), then
    ``launches`` units cycling over the sets are captured into one CUDA graph and the graph is
    replayed: ``warmup`` replays, then ``iters`` replays each between two CUDA events; the time
    of one unit is the replay's elapsed time / ``launches``. If capture fails, the same loop of
    ``launches`` units is timed directly (host overhead then counts) and ``method`` says why.
    ``cuda`` is ``torch.cuda`` (replaceable for the CPU tests)."""
    if cuda is None:
        import torch

        cuda = torch.cuda
    if iters < 1:
        raise InputError(f"iters must be >= 1; got {iters}")
    side = cuda.Stream()
    side.wait_stream(cuda.current_stream())
    with cuda.stream(side):
        for i in range(sets):
            step(i)
    cuda.current_stream().wait_stream(side)
    cuda.synchronize()

    def loop():
        for i in range(launches):
            step(i % sets)

    graph, why = None, ""
    try:
        g = cuda.CUDAGraph()
        with cuda.graph(g):
            loop()
        graph = g
    except Exception as exc:  # noqa: BLE001 - fall back, and say so in the row
        why = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
        try:
            cuda.synchronize()
        except Exception:  # noqa: BLE001 - a broken capture may leave an error behind
            pass
    run = graph.replay if graph is not None else loop
    for _ in range(warmup):
        run()
    cuda.synchronize()
    starts = [cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        run()
        e.record()
    cuda.synchronize()
    times = [s.elapsed_time(e) / launches for s, e in zip(starts, ends)]
    if graph is not None:
        method = (f"CUDA graph of {launches} launch units over {sets} buffer sets, "
                  f"{iters} replays")
    else:
        method = (f"direct launches, events around {launches} units over {sets} buffer sets "
                  f"(CUDA graph capture failed: {why}; host overhead included)")
    del graph
    return Timing(times, method, launches, sets, graph=not why)


# --------------------------------------------------------------------------------------------
# Buffers and backends (GPU)
# --------------------------------------------------------------------------------------------

def l2_bytes(device) -> int:
    import torch

    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or 0) or DEFAULT_L2_BYTES


def make_sets(case: Case, sets: int, *, device, seed: int = 0) -> list[list[StreamTensors]]:
    """``sets`` distinct buffer sets for ``case`` (one StreamTensors per stream): set 0 random
    (bf16 q/k, weights in [0.5, 1.5), an fp32 cos|sin cache with one row per token), the others
    copies of it in their own memory."""
    import torch

    from qkrope import dtypes

    dt = dtypes.torch_dtype(case.dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    first = []
    for s in case.stream_tokens:
        shape = (case.batch, s, case.heads, case.head_dim)
        q = torch.randn(shape, generator=gen, device=device).to(dt)
        k = (torch.randn(shape, generator=gen, device=device) * 3.0).to(dt)
        qw = (torch.rand(case.head_dim, generator=gen, device=device) + 0.5).to(dt)
        kw = (torch.rand(case.head_dim, generator=gen, device=device) + 0.5).to(dt)
        ang = torch.rand(s, case.rot // 2, generator=gen, device=device) * 6.0
        cache = torch.cat([ang.cos(), ang.sin()], -1).contiguous()
        first.append(StreamTensors(q, k, qw, kw, cache, torch.empty_like(q), torch.empty_like(k)))
    out = [first]
    for _ in range(1, sets):
        out.append([StreamTensors(*(x.clone() for x in t)) for t in first])
    return out


def spot_check(outs, t: StreamTensors, *, eps: float, interleaved: bool, dtype: str) -> float:
    """max |out - ref| / max |ref| over q and k against the fp32 reference of the same (rounded)
    inputs; raises :class:`BenchCheckError` above the dtype's tolerance."""
    from qkrope.export.reference import qk_norm_rope_reference

    ref = qk_norm_rope_reference(t.q.float(), t.k.float(), t.q_weight.float(),
                                 t.k_weight.float(), t.cache, eps=eps, interleaved=interleaved,
                                 rounding=0)
    worst = 0.0
    for o, r in zip(outs, ref):
        worst = max(worst, (o.float() - r).abs().max().item() / max(r.abs().max().item(), 1e-30))
    if not worst <= REL_TOL[dtype]:
        raise BenchCheckError(f"output differs from the fp32 reference: max|diff|/max|ref| = "
                              f"{worst:.3g} > {REL_TOL[dtype]:g} ({dtype})")
    return worst


@dataclass
class Options:
    iters: int = 30
    warmup: int = 5
    launches: int = DEFAULT_LAUNCHES
    rounding: int = contract.DEFAULT_ROUNDING
    eps: float = contract.DEFAULT_EPS
    interleaved: bool = contract.DEFAULT_INTERLEAVED
    l2_factor: float = L2_FACTOR
    seed: int = 0


def _fused_step(sets: list[list[StreamTensors]], opts: Options, dtype: str):
    """Validate once, spot-check, prepare the raw ctypes launches; returns (step, max rel err)."""
    import torch

    from qkrope.runtime import kernels

    kw = dict(eps=opts.eps, interleaved=opts.interleaved, rounding=opts.rounding)
    worst = 0.0
    expected = []
    for t in sets[0]:
        outs = kernels.cuda_qk_norm_rope(t.q, t.k, t.q_weight, t.k_weight, t.cache,
                                         out=(t.q_out, t.k_out), **kw)
        torch.cuda.synchronize()
        worst = max(worst, spot_check(outs, t, eps=opts.eps, interleaved=opts.interleaved,
                                      dtype=dtype))
        expected.append((t.q_out.clone(), t.k_out.clone()))
    lib = kernels._load(kernels.CUDA_LIB_ENV, kernels.CUDA_LIB_NAME, kernels.CUDA_BUILD_COMMAND,
                        "qkrope_launch_v3", "qkrope_status_string", cuda=True)
    fn, status_text = lib.qkrope_launch_v3, lib.qkrope_status_string
    prepared = [[launch_args(t, **kw) for t in s] for s in sets]

    def step(i: int) -> None:
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        for args in prepared[i]:
            status = fn(*args, stream)
            if status:
                raise kernels.KernelStatusError(status, status_text(status).decode(),
                                                "qkrope_launch (raw benchmark launch)")

    # the raw path must compute what the validated call computed
    for t in sets[0]:
        t.q_out.zero_()
        t.k_out.zero_()
    step(0)
    torch.cuda.synchronize()
    for t, (eq, ek) in zip(sets[0], expected):
        if not (torch.equal(t.q_out, eq) and torch.equal(t.k_out, ek)):
            raise BenchCheckError("the raw ctypes launch did not reproduce the validated call's "
                                  "output")
    return step, worst


def _torch_step(sets: list[list[StreamTensors]], opts: Options, dtype: str, fn):
    """The reference (eager or compiled) over each stream of a set; spot-checked on set 0."""
    import torch

    kw = dict(eps=opts.eps, interleaved=opts.interleaved, rounding=opts.rounding)
    worst = 0.0
    for t in sets[0]:
        outs = fn(t.q, t.k, t.q_weight, t.k_weight, t.cache, **kw)
        torch.cuda.synchronize()
        worst = max(worst, spot_check(outs, t, eps=opts.eps, interleaved=opts.interleaved,
                                      dtype=dtype))

    def step(i: int) -> None:
        for t in sets[i]:
            fn(t.q, t.k, t.q_weight, t.k_weight, t.cache, **kw)

    return step, worst


def make_compiled():
    """``torch.compile`` of the reference: static shapes, default mode, with room for every
    benchmarked shape in dynamo's recompile cache."""
    import torch
    import torch._dynamo.config as dcfg

    from qkrope.export.reference import qk_norm_rope_reference

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dcfg, name):
            setattr(dcfg, name, max(64, getattr(dcfg, name)))
    return torch.compile(qk_norm_rope_reference, dynamic=False)


def measure(case: Case, backend: str, opts: Options, *, device, peak: float | None,
            l2: int, compiled=None) -> dict:
    """Measure one (case, backend) row; never raises for a failure of the measured code (the
    row's status is "failed" with the reason)."""
    import torch

    row = result_row(case, backend)
    sets = rotation_sets(case.bytes, l2, factor=opts.l2_factor)
    launches = graph_launches(opts.launches, sets)
    row.update(sets=sets, rotation_mb=round(sets * case.bytes / 1e6, 1),
               launches_per_graph=launches, iters=opts.iters)
    bufs = None
    try:
        with torch.cuda.device(device):
            bufs = make_sets(case, sets, device=device, seed=opts.seed)
            if backend == "fused":
                step, err = _fused_step(bufs, opts, case.dtype)
            elif backend == "eager":
                from qkrope.export.reference import qk_norm_rope_reference

                step, err = _torch_step(bufs, opts, case.dtype, qk_norm_rope_reference)
            elif backend == "compile":
                if compiled is None:
                    compiled = make_compiled()
                t0 = time.perf_counter()
                step, err = _torch_step(bufs, opts, case.dtype, compiled)
                row["compile_s"] = round(time.perf_counter() - t0, 2)
            else:
                raise InputError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
            row["max_rel_err"] = err
            timing = time_launches(step, sets=sets, launches=launches, iters=opts.iters,
                                   warmup=opts.warmup)
    except Exception as exc:  # noqa: BLE001 - reported in the row
        row.update(status="failed", reason=f"{type(exc).__name__}: {exc}".replace("\n", " ")[:400])
        return row
    finally:
        del bufs
        # a sticky CUDA error must not turn this row's report into an exception
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
    st = timing.summary()
    row.update(median_us=st["median_ms"] * 1e3, p10_us=st["p10_ms"] * 1e3,
               p90_us=st["p90_ms"] * 1e3, method=timing.method, graph=timing.graph)
    row["gbs"], row["pct_peak"] = rates(case.bytes, row["median_us"], peak)
    return row


def result_row(case: Case, backend: str, **kw) -> dict:
    row = {"resolution": case.resolution, "batch": case.batch, "stream": case.stream,
           "tokens": case.tokens, "heads": case.heads, "head_dim": case.head_dim,
           "dtype": case.dtype, "bytes": case.bytes, "backend": backend, "status": "ok",
           "reason": "", "median_us": None, "p10_us": None, "p90_us": None, "gbs": None,
           "pct_peak": None, "method": ""}
    row.update(kw)
    return row


def device_peak(device, override: float | None = None) -> tuple[float | None, str]:
    """(peak GB/s, where it came from): ``override``, the data-sheet table by GPU name, else the
    device's memory clock x bus width (double data rate) as reported by the driver."""
    import torch

    name = torch.cuda.get_device_name(device)
    if override is not None:
        return float(override), "--peak-gbs"
    table = peak_gbps(name)
    if table is not None:
        return table, f"data sheet ({name})"
    props = torch.cuda.get_device_properties(device)
    clk, width = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clk and width:
        return 2 * clk * 1e3 * width / 8 / 1e9, "memory clock x bus width (not in the table)"
    return None, f"unknown for {name} (pass --peak-gbs)"


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

def _f(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_markdown(rows: Sequence[dict], *, peak: float | None = None,
                    header: Sequence[str] = ()) -> str:
    """One line per (resolution, batch, stream): time (p10-p90), GB/s and % of peak of each
    backend, then the speed-ups of the fused kernel; failures and skips listed with reasons."""
    keys = list(dict.fromkeys((r["resolution"], r["batch"], r["stream"]) for r in rows))
    by = {(r["resolution"], r["batch"], r["stream"], r["backend"]): r for r in rows}
    backends = [b for b in BACKENDS if any(r["backend"] == b for r in rows)]
    head = "| shape | B | stream | tokens | MB |"
    for b in backends:
        head += f" {b} us (p10-p90) | {b} GB/s | {b} % peak |"
    head += "".join(f" fused vs {b} |" for b in backends if b != "fused")
    lines = list(header) + [head, "|" + "---|" * (head.count("|") - 1)]
    for res, batch, stream in keys:
        any_row = next(r for r in rows if (r["resolution"], r["batch"], r["stream"])
                       == (res, batch, stream))
        line = (f"| {res}x{res} | {batch} | {stream} | {any_row['tokens']} | "
                f"{any_row['bytes'] / 1e6:.1f} |")
        for b in backends:
            r = by.get((res, batch, stream, b))
            if r is None or r.get("median_us") is None:
                status = "-" if r is None else r["status"]
                line += f" {status} | - | - |"
            else:
                line += (f" {r['median_us']:.1f} ({r['p10_us']:.1f}-{r['p90_us']:.1f})"
                         f"{'' if r.get('graph', True) else ' *'} | {_f(r['gbs'], '.0f')} | "
                         f"{_f(r['pct_peak'], '.1f')} |")
        fused = by.get((res, batch, stream, "fused"), {}).get("median_us")
        for b in backends:
            if b == "fused":
                continue
            other = by.get((res, batch, stream, b), {}).get("median_us")
            line += f" {other / fused:.2f}x |" if fused and other else " - |"
        lines.append(line)
    notes = [r for r in rows if r["status"] != "ok"]
    if any(not r.get("graph", True) for r in rows if r["status"] == "ok"):
        lines += ["", "\\* not in a CUDA graph (capture failed): events around direct launches, "
                      "host overhead included"]
    if notes:
        lines += ["", "Not measured:"]
        lines += [f"- {r['resolution']}x{r['resolution']} B={r['batch']} {r['stream']} "
                  f"{r['backend']}: {r['status']}, {r['reason']}" for r in notes]
    if peak is None:
        lines += ["", "% of peak: the GPU's peak bandwidth is unknown (pass --peak-gbs)"]
    return "\n".join(lines)


@dataclass
class Recorder:
    """Rows plus run metadata, rewritten atomically to ``path`` after every row (a timeout never
    loses what was measured)."""

    path: Any
    meta: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)

    def add(self, row: dict, phase: str = "running") -> None:
        self.rows.append(row)
        self.save(phase)

    def save(self, phase: str) -> None:
        from qkrope._fileio import write_json_atomic

        if self.path is not None:
            write_json_atomic(self.path, {**self.meta, "phase": phase, "rows": self.rows})
