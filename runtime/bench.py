"""``qkrope bench``: latency of the Qwen-Image attention block and the fused kernel's bandwidth.

Rows (each one is measured, or reported as skipped with the reason):

=====================  ==========================================================  ===========
backend                what runs                                                   needs
=====================  ==========================================================  ===========
trt-plugin             TensorRT engine with the fused QKNormRoPE plugin            GPU + TRT
trt-function-body      TensorRT engine of the same ONNX without the plugin (the    GPU + TRT
                       parser inlines the model-local function body)
torch-eager            ``QwenImageAttention`` in eager PyTorch                     -
torch-compile          ``torch.compile`` of the block with the *reference* maths   GPU
                       inlined (the custom op is opaque to Inductor, so the
                       reference is patched in to give the compiler a fair chance)
onnxruntime-cpu        the exported ONNX (function body) under ONNX Runtime CPU    CPU runs
kernel                 ``cuda_qk_norm_rope`` alone: achieved GB/s vs the GPU peak   GPU + lib
=====================  ==========================================================  ===========

Sizes are image side lengths in pixels: Qwen-Image has 16 px per latent token (VAE /8, patch 2),
so 512 -> 32x32 = 1024 image tokens and 1024 -> 64x64 = 4096. Timing: warm-up calls, then
``--iters`` timed calls, each timed alone (CUDA events on a GPU, ``perf_counter`` on the CPU),
median reported with p10/p90. Every row carries the machine it ran on.

On a CPU-only machine the defaults are small (2 heads x 64, 256 px, 64 text tokens, fp32) so the
command finishes in seconds; choose ``--sizes/--heads/--head-dim/--text-len`` to go bigger.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

PIXELS_PER_TOKEN = 16

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

REQUIRES_CUDA = "requires CUDA (no GPU visible to torch)"
REQUIRES_TRT = "requires TensorRT (Python package 'tensorrt' not importable)"


# --------------------------------------------------------------------------------------------
# Pure helpers (unit tested)
# --------------------------------------------------------------------------------------------

def image_tokens(size_px: int, pixels_per_token: int = PIXELS_PER_TOKEN) -> int:
    """Image tokens of a square ``size_px`` image: ``(size_px / 16) ** 2``."""
    if size_px <= 0 or size_px % pixels_per_token:
        raise ValueError(f"image size must be a positive multiple of {pixels_per_token} px; "
                         f"got {size_px}")
    side = size_px // pixels_per_token
    return side * side


def qknorm_rope_bytes(img_tokens: int, txt_tokens: int, heads: int, head_dim: int, *,
                      batch: int = 1, act_bytes: int = 2, rotary_dim: int | None = None,
                      cache_bytes: int = 4) -> int:
    """Minimum DRAM traffic of the op over both streams of one attention block.

    Per stream with S tokens: q and k read, q_out and k_out written (4 x B*S*H*D activations),
    the two RMSNorm weights ([D] each, activation dtype) and the S cache rows it uses
    (S x rotary_dim fp32; rows are shared across the batch, so read once).
    """
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    total = 0
    for s in (img_tokens, txt_tokens):
        total += 4 * batch * s * heads * head_dim * act_bytes
        total += 2 * head_dim * act_bytes
        total += s * rotary_dim * cache_bytes
    return total


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


def summarize(times_ms: Sequence[float]) -> dict[str, float]:
    """median / mean / min / p10 / p90 / stdev of per-call times (ms)."""
    if not times_ms:
        raise ValueError("no timings to summarise")
    xs = sorted(float(t) for t in times_ms)

    def pct(p: float) -> float:  # linear interpolation, like numpy's default
        pos = (len(xs) - 1) * p
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"median_ms": statistics.median(xs), "mean_ms": statistics.fmean(xs),
            "min_ms": xs[0], "p10_ms": pct(0.10), "p90_ms": pct(0.90),
            "stdev_ms": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


def parse_int_list(text: str | Sequence[int]) -> list[int]:
    if not isinstance(text, str):
        return [int(x) for x in text]
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError as exc:
        raise ValueError(f"expected comma-separated integers such as 512,1024; got {text!r}") \
            from exc
    if not vals or any(v <= 0 for v in vals):
        raise ValueError(f"expected positive comma-separated integers; got {text!r}")
    return vals


def qwen_axes_dim(head_dim: int) -> tuple[int, int, int]:
    """Qwen-Image's RoPE axes split (16, 56, 56) for D = 128, scaled for other head dims."""
    if head_dim == 128:
        return (16, 56, 56)
    if head_dim % 8 or head_dim < 8:
        raise ValueError(f"head_dim must be a multiple of 8 for the benchmark; got {head_dim}")
    a0 = 2 * max(1, head_dim // 16)
    rest = head_dim - a0
    a1 = 2 * (rest // 4)
    return (a0, a1, rest - a1)


# --------------------------------------------------------------------------------------------
# Rows, machine, table, plot
# --------------------------------------------------------------------------------------------

@dataclass
class Row:
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


def machine_info(device: str = "cpu") -> dict[str, str]:
    """CPU model, GPU name and the versions of torch / ONNX Runtime / TensorRT."""
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
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def format_table(rows: Sequence[Row]) -> str:
    """Markdown table of the measured rows, then the skipped rows with their reasons."""
    head = ("| backend | size | img tok | txt tok | batch | dtype | median ms | p10 ms | p90 ms | "
            "iters | GB/s | % peak | device |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if r.status != "ok":
            continue
        pct = None if r.peak_fraction is None else 100.0 * r.peak_fraction
        lines.append(f"| {r.backend} | {r.size} | {r.img_tokens} | {r.txt_tokens} | {r.batch} | "
                     f"{r.dtype} | {_fmt(r.median_ms)} | {_fmt(r.p10_ms)} | {_fmt(r.p90_ms)} | "
                     f"{r.iters} | {_fmt(r.gbps, '.0f')} | {_fmt(pct, '.1f')} | {r.device} |")
    skipped = [r for r in rows if r.status != "ok"]
    if skipped:
        lines += ["", "Not measured:", ""]
        seen = set()
        for r in skipped:
            key = (r.backend, r.status, r.reason)
            if key in seen:
                continue
            seen.add(key)
            n = sum(1 for x in skipped if (x.backend, x.status, x.reason) == key)
            lines.append(f"- {r.backend}: {r.status}, {r.reason} ({n} row{'s' * (n != 1)})")
    return "\n".join(lines)


def write_plot(rows: Sequence[Row], path: Path) -> Path:
    """Bar chart of median latency per (size, batch) and backend, as a PNG (matplotlib Agg)."""
    from qkrope._deps import require

    mpl = require("matplotlib", "qkrope bench's plot")
    mpl.use("Agg", force=True)
    plt = require("matplotlib.pyplot", "qkrope bench's plot")
    ok = [r for r in rows if r.status == "ok" and r.median_ms is not None
          and r.backend != "kernel"]
    groups = sorted({(r.size, r.batch) for r in ok})
    backends = list(dict.fromkeys(r.backend for r in ok))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(groups) + 2), 3.8), dpi=100)
    width = 0.8 / max(1, len(backends))
    for i, b in enumerate(backends):
        xs, ys = [], []
        for g, (size, batch) in enumerate(groups):
            hit = [r for r in ok if r.backend == b and (r.size, r.batch) == (size, batch)]
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
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------

def time_cpu(fn: Callable[[], Any], *, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def time_cuda(fn: Callable[[], Any], *, iters: int, warmup: int) -> list[float]:
    """Per-call times in ms with CUDA events on the current stream (each call timed alone)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


# --------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------

@dataclass
class Config:
    sizes: list[int]
    batches: list[int]
    dtype: str
    heads: int
    head_dim: int
    text_len: int
    iters: int
    warmup: int
    device: str
    engine: str | None = None
    plugin: str | None = None
    engine_no_plugin: str | None = None
    peak_gbps: float | None = None
    out: Path | None = None
    seed: int = 0
    threads: int | None = None


_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
           "half": "float16", "fp32": "float32", "float32": "float32", "float": "float32"}


def _torch_dtype(name: str):
    import torch

    return getattr(torch, _DTYPES[name])


def _make_block(cfg: Config):
    import torch

    from qkrope.export import QwenImageAttention

    torch.manual_seed(cfg.seed)
    block = QwenImageAttention(cfg.heads * cfg.head_dim, cfg.heads, cfg.head_dim, validate=False)
    with torch.no_grad():  # non-trivial norm weights
        for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            getattr(block, n).weight.uniform_(0.5, 1.5)
    return block.eval().to(device=cfg.device, dtype=_torch_dtype(cfg.dtype))


def _make_inputs(cfg: Config, size: int, batch: int):
    import torch

    from qkrope.runtime import build_qwen_rope_caches

    side = size // PIXELS_PER_TOKEN
    gen = torch.Generator().manual_seed(cfg.seed + size + batch)
    c = cfg.heads * cfg.head_dim
    dt = _torch_dtype(cfg.dtype)
    hs = torch.randn(batch, side * side, c, generator=gen).to(cfg.device, dt)
    ehs = torch.randn(batch, cfg.text_len, c, generator=gen).to(cfg.device, dt)
    caches = build_qwen_rope_caches([(1, side, side)], cfg.text_len,
                                    axes_dim=qwen_axes_dim(cfg.head_dim), device=cfg.device)
    # The text mask is passed everywhere (as diffusers' pipeline does), all ones, so every
    # backend runs the same masked attention.
    mask = torch.ones(batch, cfg.text_len, dtype=torch.bool, device=cfg.device)
    return hs, ehs, (caches[0], caches[1]), mask


@contextlib.contextmanager
def _reference_inlined():
    """Make QwenImageAttention call the plain-torch reference instead of the opaque custom op,
    so torch.compile sees (and can fuse) the arithmetic."""
    from qkrope.export import attention as attn_mod
    from qkrope.export.reference import qk_norm_rope_reference

    saved = attn_mod.qk_norm_rope
    attn_mod.qk_norm_rope = qk_norm_rope_reference
    try:
        yield
    finally:
        attn_mod.qk_norm_rope = saved


def _row(cfg: Config, backend: str, size: int, batch: int, machine: dict, **kw) -> Row:
    return Row(backend=backend, size=size, img_tokens=image_tokens(size), txt_tokens=cfg.text_len,
               batch=batch, dtype=cfg.dtype, device=machine.get("gpu") or machine.get("cpu", ""),
               machine=machine, **kw)


def _measured(cfg: Config, backend: str, size: int, batch: int, machine: dict,
              times: list[float]) -> Row:
    st = summarize(times)
    return _row(cfg, backend, size, batch, machine, median_ms=st["median_ms"],
                p10_ms=st["p10_ms"], p90_ms=st["p90_ms"], iters=int(st["n"]))


def _timer(cfg: Config):
    return time_cuda if cfg.device.startswith("cuda") else time_cpu


_SHORT_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def _export_onnx(cfg: Config, path: Path) -> Path:
    """Export the attention block with the project's exporter (``qkrope export``'s function),
    with dynamic batch / token axes (sample batch >= 2 so torch.export does not specialise it)."""
    from qkrope.export.onnx_export import export_attention

    side = min(cfg.sizes) // PIXELS_PER_TOKEN
    export_attention(path, heads=cfg.heads, head_dim=cfg.head_dim, dtype=_SHORT_DTYPE[cfg.dtype],
                     seed=cfg.seed, img_shapes=[(1, side, side)], txt_len=cfg.text_len,
                     batch=max(2, max(cfg.batches)))
    return path


def _bench_torch(cfg: Config, rows: list[Row], machine: dict, *, compiled: bool) -> None:
    import torch

    backend = "torch-compile" if compiled else "torch-eager"
    block = _make_block(cfg)
    fn_block = block
    if compiled:
        fn_block = torch.compile(block, dynamic=False)
    ctx = _reference_inlined() if compiled else contextlib.nullcontext()
    with ctx, torch.inference_mode():
        for size in cfg.sizes:
            for batch in cfg.batches:
                hs, ehs, caches, mask = _make_inputs(cfg, size, batch)
                try:
                    times = _timer(cfg)(lambda: fn_block(hs, ehs, caches, mask), iters=cfg.iters,
                                        warmup=cfg.warmup + (2 if compiled else 0))
                except Exception as exc:  # noqa: BLE001 - a failed row must not end the bench
                    rows.append(_row(cfg, backend, size, batch, machine, status="failed",
                                     reason=f"{type(exc).__name__}: {exc}"[:300]))
                    continue
                rows.append(_measured(cfg, backend, size, batch, machine, times))


def _bench_onnxruntime(cfg: Config, rows: list[Row], machine: dict, workdir: Path) -> None:
    import onnxruntime as ort

    backend = "onnxruntime-cpu"
    onnx_path = workdir / "attention.onnx"
    try:
        _export_onnx(cfg, onnx_path)
    except Exception as exc:  # noqa: BLE001
        for size in cfg.sizes:
            for batch in cfg.batches:
                rows.append(_row(cfg, backend, size, batch, machine, status="skipped",
                                 reason=f"ONNX export failed ({type(exc).__name__}: {exc})"[:300]))
        return
    import torch

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Same thread count as torch, and no spin-waiting after a run: spinning ORT threads would
    # steal the cores from the next torch measurement.
    so.intra_op_num_threads = torch.get_num_threads()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    types = {i.name: i.type for i in sess.get_inputs()}
    for size in cfg.sizes:
        for batch in cfg.batches:
            hs, ehs, (img_cache, txt_cache), mask = _make_inputs(cfg, size, batch)
            feeds = _ort_feeds(types, hs, ehs, img_cache, txt_cache, mask)
            try:
                times = time_cpu(lambda: sess.run(None, feeds), iters=cfg.iters,
                                 warmup=cfg.warmup)
            except Exception as exc:  # noqa: BLE001
                rows.append(_row(cfg, backend, size, batch, machine, status="failed",
                                 reason=f"{type(exc).__name__}: {exc}"[:300]))
                continue
            rows.append(_measured(cfg, backend, size, batch, machine, times))
    del sess


def _ort_feeds(types: Mapping[str, str], hs, ehs, img_cache, txt_cache, mask) -> dict:
    """Feeds by input name: *mask* -> all ones, *cache* -> the stream's cache (img/txt in the
    name), encoder/txt -> encoder_hidden_states, anything else -> hidden_states."""

    def np_(t):
        t = t.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":
            raise ValueError("ONNX Runtime's CPU provider has no bfloat16 kernels for this graph; "
                             "use --dtype fp32 on the CPU")
        return t.numpy()

    by_role = {}
    for n, onnx_type in types.items():
        low = n.lower()
        if "mask" in low:
            by_role[n] = mask if onnx_type == "tensor(bool)" else mask.to(hs.dtype)
            continue
        if "cache" in low or "rotary" in low or "rope" in low:
            by_role[n] = img_cache if ("img" in low or "image" in low or low.endswith("_0")) \
                else txt_cache
        elif "encoder" in low or "txt" in low or "text" in low:
            by_role[n] = ehs
        else:
            by_role[n] = hs
    return {n: np_(t) for n, t in by_role.items()}


def _skip_all(cfg: Config, rows: list[Row], backend: str, reason: str, machine: dict) -> None:
    for size in cfg.sizes:
        for batch in cfg.batches:
            rows.append(_row(cfg, backend, size, batch, machine, status="skipped", reason=reason))


def _have_tensorrt() -> bool:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return True


def _bench_engine(cfg: Config, rows: list[Row], machine: dict, backend: str,
                  engine: str | None, plugin: str | None) -> None:
    """Time a TensorRT engine through ``qkrope.runtime.load`` (torch CUDA tensors in/out)."""
    if engine is None:
        _skip_all(cfg, rows, backend, "no engine given (--engine / --engine-no-plugin; build "
                  "them with `qkrope build`)", machine)
        return
    try:
        from qkrope import runtime

        runner = runtime.load(engine, plugin=plugin)
    except Exception as exc:  # noqa: BLE001
        _skip_all(cfg, rows, backend, f"cannot load {engine}: {type(exc).__name__}: {exc}"[:300],
                  machine)
        return
    for size in cfg.sizes:
        for batch in cfg.batches:
            hs, ehs, caches, mask = _make_inputs(cfg, size, batch)
            try:
                times = time_cuda(lambda: runner(hs, ehs, caches, mask),
                                  iters=cfg.iters, warmup=cfg.warmup)
            except Exception as exc:  # noqa: BLE001
                rows.append(_row(cfg, backend, size, batch, machine, status="failed",
                                 reason=f"{type(exc).__name__}: {exc}"[:300]))
                continue
            rows.append(_measured(cfg, backend, size, batch, machine, times))


def build_function_body_engine(onnx_path: str | os.PathLike, engine_path: str | os.PathLike, *,
                               max_batch: int | None = None, max_img_tokens: int | None = None,
                               max_txt_tokens: int | None = None) -> dict:
    """Build an engine from the same ONNX file *without* the plugin: the parser then inlines the
    model-local ``qkrope::QKNormRoPE`` function body (standard layers). This must run in a
    process where the plugin library has not been loaded (TensorRT 10.7-10.14 prefer any
    registered plugin), and no ENABLE_PLUGIN_OVERRIDE parser flag is set. Returns the sidecar
    (also written next to the engine; its ``plugin`` is null)."""
    from qkrope.export import contract
    from qkrope.runtime import engine as E
    from qkrope.runtime import trt_utils as tu

    trt = E.import_tensorrt("qkrope bench (TensorRT on the function body)")
    if trt.get_plugin_registry().get_creator(contract.PLUGIN_NAME, contract.PLUGIN_VERSION,
                                             contract.PLUGIN_NAMESPACE) is not None:
        raise RuntimeError("the QKNormRoPE plugin is already registered in this process, so the "
                           "parser would use it; build the function-body engine first or in a "
                           "fresh process")
    model = tu.load_model_description(onnx_path)
    profile = E.plan_profile(model, E.BuildOptions(max_batch=max_batch,
                                                   max_img_tokens=max_img_tokens,
                                                   max_txt_tokens=max_txt_tokens))
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = E.network_creation_flags(trt)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT's ONNX parser rejected {onnx_path}: {errors}")
    ours, _ = E.find_plugin_layers(network, trt)
    if ours:
        raise RuntimeError(f"the no-plugin network still has {len(ours)} QKNormRoPE plugin "
                           "layer(s); it would not measure the function body")
    config = builder.create_builder_config()
    trt_profile = builder.create_optimization_profile()
    for name, levels in profile.items():
        trt_profile.set_shape(name, levels["min"], levels["opt"], levels["max"])
    config.add_optimization_profile(trt_profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError("TensorRT failed to build the function-body engine (see its log)")
    tu.write_atomic(engine_path, serialized)
    inputs, outputs = E.network_io(network)
    sidecar = E.engine_sidecar(
        trt_version=trt.__version__, onnx_path=str(Path(onnx_path).resolve()), model=model,
        profile=profile, inputs=inputs, outputs=outputs, plugin_path=None, plugin_sha256=None,
        version_compatible=False, builder_optimization_level=None, strongly_typed=bool(flags),
        plugin_layers=0, parser_flags=[], gpu=tu.gpu_info())
    tu.write_json_atomic(tu.engine_sidecar_path(engine_path), sidecar)
    return sidecar


def _build_engines(cfg: Config, workdir: Path, log: Callable[[str], None]
                   ) -> dict[str, tuple[str | None, str]]:
    """Export the block once, then build the no-plugin engine (first: nothing registered yet)
    and the plugin engine, with one profile covering every benchmarked size and batch.
    Returns ``{backend: (engine path or None, reason it is None)}``."""
    from qkrope.runtime import engine as E

    out: dict[str, tuple[str | None, str]] = {}
    try:
        onnx_path = _export_onnx(cfg, workdir / "attention.onnx")
    except Exception as exc:  # noqa: BLE001
        reason = f"ONNX export failed: {type(exc).__name__}: {exc}"[:300]
        return {"trt-plugin": (None, reason), "trt-function-body": (None, reason)}
    limits = dict(max_batch=max(cfg.batches), max_img_tokens=image_tokens(max(cfg.sizes)),
                  max_txt_tokens=cfg.text_len)
    eng_np = workdir / "attention.noplugin.engine"
    log(f"building {eng_np} (TensorRT, function body, no plugin)")
    try:
        build_function_body_engine(onnx_path, eng_np, **limits)
        out["trt-function-body"] = (str(eng_np), "")
    except Exception as exc:  # noqa: BLE001
        out["trt-function-body"] = (None, f"engine build failed: {type(exc).__name__}: {exc}"[:300])
    eng = workdir / "attention.engine"
    log(f"building {eng} (TensorRT + QKNormRoPE plugin)")
    try:
        E.build_engine(onnx_path, eng, E.BuildOptions(plugin=cfg.plugin, progress=False,
                                                      **limits))
        out["trt-plugin"] = (str(eng), "")
    except Exception as exc:  # noqa: BLE001
        out["trt-plugin"] = (None, f"engine build failed: {type(exc).__name__}: {exc}"[:300])
    return out


def _graph_or_direct(fn: Callable[[], Any], reps: int = 10) -> tuple[Callable[[], Any], int, str]:
    """Capture ``reps`` calls of ``fn`` in a CUDA graph so the kernel time is not hidden behind
    Python/ctypes launch overhead (a 1024x1024 block is ~25 us of work); fall back to direct
    calls when capture fails."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
    except Exception as exc:  # noqa: BLE001
        torch.cuda.synchronize()
        return fn, 1, f"direct launches (CUDA graph capture failed: {exc})"[:200]
    return graph.replay, reps, f"CUDA graph of {reps} calls (img + txt launch each)"


def _bench_kernel(cfg: Config, rows: list[Row], machine: dict) -> None:
    import torch

    try:
        from qkrope.runtime.kernels import cuda_qk_norm_rope, cuda_library_path
    except ImportError as exc:
        _skip_all(cfg, rows, "kernel", f"qkrope.runtime.kernels unavailable ({exc})", machine)
        return
    if cuda_library_path() is None:
        _skip_all(cfg, rows, "kernel", "libqkrope_kernels.so not built (cmake -S plugins/kernel "
                  "-B build/kernel -DQKROPE_WITH_CUDA=ON && cmake --build build/kernel)", machine)
        return
    peak = peak_gbps(machine.get("gpu"), cfg.peak_gbps)
    dt = _torch_dtype(cfg.dtype)
    act = torch.tensor([], dtype=dt).element_size()
    for size in cfg.sizes:
        for batch in cfg.batches:
            s_img = image_tokens(size)
            _, _, (img_cache, txt_cache), _ = _make_inputs(cfg, size, 1)
            bufs = []
            for s, cache in ((s_img, img_cache), (cfg.text_len, txt_cache)):
                q = torch.randn(batch, s, cfg.heads, cfg.head_dim, device=cfg.device, dtype=dt)
                k = torch.randn_like(q)
                w = torch.rand(cfg.head_dim, device=cfg.device, dtype=dt) + 0.5
                bufs.append((q, k, w, w.clone(), cache, (torch.empty_like(q),
                                                         torch.empty_like(k))))

            def both():
                for q, k, qw, kw, cache, out in bufs:
                    cuda_qk_norm_rope(q, k, qw, kw, cache, out=out)

            try:
                fn, reps, note = _graph_or_direct(both)
                times = [t / reps for t in time_cuda(fn, iters=cfg.iters, warmup=cfg.warmup)]
            except Exception as exc:  # noqa: BLE001
                rows.append(_row(cfg, "kernel", size, batch, machine, status="failed",
                                 reason=f"{type(exc).__name__}: {exc}"[:300]))
                continue
            row = _measured(cfg, "kernel", size, batch, machine, times)
            row.note = note
            nbytes = qknorm_rope_bytes(s_img, cfg.text_len, cfg.heads, cfg.head_dim,
                                       batch=batch, act_bytes=act,
                                       rotary_dim=img_cache.shape[1])
            row.gbps = nbytes / (row.median_ms * 1e-3) / 1e9
            row.peak_fraction = None if peak is None else row.gbps / peak
            rows.append(row)


def run_bench(cfg: Config, *, log: Callable[[str], None] = print) -> list[Row]:
    """Measure every row that this machine can, and report the others as skipped."""
    import torch

    for size in cfg.sizes:
        image_tokens(size)  # validate early
    on_gpu = cfg.device.startswith("cuda")
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    machine = machine_info(cfg.device)
    machine["cpu_threads"] = str(torch.get_num_threads())
    with contextlib.suppress(OSError):
        load1 = os.getloadavg()[0]
        machine["load_avg_1min"] = f"{load1:.2f}"
        if not on_gpu and load1 > (os.cpu_count() or 1) - 0.5:
            log(f"warning: the machine is busy (1-min load {load1:.2f} on {os.cpu_count()} "
                "cores); CPU timings will be noisy. --threads 1 is steadier on a shared machine")
    rows: list[Row] = []
    if cfg.out is not None:
        cfg.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="qkrope-bench-", dir=cfg.out))
    log(f"machine: {json.dumps(machine)}")
    log(f"config: sizes {cfg.sizes} px, batches {cfg.batches}, {cfg.heads} heads x "
        f"{cfg.head_dim}, text {cfg.text_len} tokens, {cfg.dtype}, {cfg.iters} iters "
        f"({cfg.warmup} warm-up)")
    torch.set_grad_enabled(False)

    if on_gpu:
        given = {"trt-plugin": cfg.engine, "trt-function-body": cfg.engine_no_plugin}
        plugins = {"trt-plugin": cfg.plugin, "trt-function-body": None}
        if not _have_tensorrt():
            for b in given:
                _skip_all(cfg, rows, b, REQUIRES_TRT, machine)
        else:
            built: dict[str, tuple[str | None, str]] = {}
            if not all(given.values()):
                # build the missing ones (the no-plugin engine before the plugin is loaded)
                built = _build_engines(cfg, workdir, log)
            for b in ("trt-function-body", "trt-plugin"):
                path, reason = (given[b], "") if given[b] else built.get(b, (None, "not built"))
                if path is None:
                    _skip_all(cfg, rows, b, reason, machine)
                else:
                    _bench_engine(cfg, rows, machine, b, path, plugins[b])
        _bench_torch(cfg, rows, machine, compiled=False)
        _bench_torch(cfg, rows, machine, compiled=True)
        _bench_kernel(cfg, rows, machine)
    else:
        for b in ("trt-plugin", "trt-function-body"):
            _skip_all(cfg, rows, b, REQUIRES_CUDA + "; " + REQUIRES_TRT
                      if not _have_tensorrt() else REQUIRES_CUDA, machine)
        _bench_onnxruntime(cfg, rows, machine, workdir)
        _bench_torch(cfg, rows, machine, compiled=False)
        _skip_all(cfg, rows, "torch-compile", REQUIRES_CUDA + " (CPU Inductor is not the "
                  "deployment target; measured on the GPU only)", machine)
        _skip_all(cfg, rows, "kernel", REQUIRES_CUDA, machine)
    if any(workdir.iterdir()) and on_gpu:
        log(f"kept the exported model and engines in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


def write_outputs(rows: Sequence[Row], out: Path, cfg: Config | None = None) -> dict[str, Path]:
    """bench.md (table + machine), bench.json (every row), bench.png (plot)."""
    out.mkdir(parents=True, exist_ok=True)
    table = format_table(rows)
    machine = next((r.machine for r in rows if r.status == "ok"), rows[0].machine if rows else {})
    md = ["# qkrope bench", "", "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()),
          ""]
    if cfg is not None:
        md += [f"Config: {cfg.heads} heads x {cfg.head_dim}, text {cfg.text_len} tokens, "
               f"{cfg.dtype}, median of {cfg.iters} calls after {cfg.warmup} warm-up", ""]
    md += [table, ""]
    paths = {"markdown": out / "bench.md", "json": out / "bench.json", "png": out / "bench.png"}
    paths["markdown"].write_text("\n".join(md))
    paths["json"].write_text(json.dumps([asdict(r) for r in rows], indent=1))
    write_plot(rows, paths["png"])
    return paths


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench", help="benchmark the attention block (TensorRT plugin vs no plugin vs torch) "
                      "and the kernel's bandwidth",
        description="Latency of the Qwen-Image attention block: TensorRT with the fused plugin, "
                    "TensorRT on the ONNX function body (no plugin), torch eager and "
                    "torch.compile, plus the fused kernel's achieved bandwidth, on a GPU. On a "
                    "CPU machine: ONNX Runtime CPU vs torch eager at small default sizes, and "
                    "the GPU rows listed as skipped with the reason. Writes bench.md, "
                    "bench.json and bench.png to --out.")
    p.add_argument("--model", default="attention", choices=["attention"],
                   help="what to benchmark (the Qwen-Image joint attention block)")
    p.add_argument("--sizes", default=None,
                   help="image side lengths in px, comma-separated (16 px per token); default "
                        "512,1024 on a GPU, 256 on the CPU")
    p.add_argument("--batches", default=None, help="batch sizes; default 1,2 on a GPU, 1 on "
                                                   "the CPU")
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES),
                   help="activation dtype; default bf16 on a GPU, fp32 on the CPU")
    p.add_argument("--heads", type=int, default=None, help="default 24 (GPU), 2 (CPU)")
    p.add_argument("--head-dim", type=int, default=None, help="default 128 (GPU), 64 (CPU)")
    p.add_argument("--text-len", type=int, default=None, help="default 512 (GPU), 64 (CPU)")
    p.add_argument("--iters", type=int, default=None, help="timed calls; default 50 (GPU), "
                                                           "10 (CPU)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls; default 10 / 2")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if "
                                                  "available)")
    p.add_argument("--engine", default=None, help="TensorRT engine with the plugin (default: "
                                                  "export and build one when TensorRT exists)")
    p.add_argument("--engine-no-plugin", default=None,
                   help="TensorRT engine of the same ONNX built without the plugin")
    p.add_argument("--plugin", default=None, help="the plugin library (libqkrope_plugin.so)")
    p.add_argument("--peak-gbps", type=float, default=None,
                   help="the GPU's peak memory bandwidth in GB/s (default: from a table of "
                        "known GPUs; H200 4800)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch and ONNX Runtime (default: torch's default)")
    p.add_argument("--out", default="bench-out", help="output directory (default bench-out)")
    p.set_defaults(func=run)
    return p


def config_from_args(args: argparse.Namespace) -> Config:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.startswith("cuda")
    if gpu and not torch.cuda.is_available():
        raise RuntimeError(f"--device {device} requested but torch sees no CUDA GPU "
                           f"(torch {torch.__version__}); use --device cpu")
    dtype = _DTYPES[args.dtype] if args.dtype else ("bfloat16" if gpu else "float32")
    cfg = Config(
        sizes=parse_int_list(args.sizes or ("512,1024" if gpu else "256")),
        batches=parse_int_list(args.batches or ("1,2" if gpu else "1")),
        dtype=dtype,
        heads=args.heads or (24 if gpu else 2),
        head_dim=args.head_dim or (128 if gpu else 64),
        text_len=args.text_len or (512 if gpu else 64),
        iters=args.iters or (50 if gpu else 10),
        warmup=args.warmup if args.warmup is not None else (10 if gpu else 2),
        device=device, engine=args.engine, plugin=args.plugin,
        engine_no_plugin=args.engine_no_plugin, peak_gbps=args.peak_gbps,
        out=Path(args.out), threads=args.threads)
    for s in cfg.sizes:
        image_tokens(s)
    qwen_axes_dim(cfg.head_dim)
    if cfg.iters < 1:
        raise ValueError(f"--iters must be >= 1; got {cfg.iters}")
    return cfg


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    cfg.out.mkdir(parents=True, exist_ok=True)
    rows = run_bench(cfg)
    paths = write_outputs(rows, cfg.out, cfg)
    print(format_table(rows))
    print(f"wrote {paths['markdown']}, {paths['json']}, {paths['png']}")
    sys.stdout.flush()
    failed = [r for r in rows if r.status == "failed"]
    return 1 if failed else 0
