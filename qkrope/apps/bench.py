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
kernel                 the fused kernel's img + txt launches alone: GB/s vs peak   GPU + lib
=====================  ==========================================================  ===========

Sizes are image side lengths in pixels: Qwen-Image has 16 px per latent token (VAE /8, patch 2),
so 512 -> 32x32 = 1024 image tokens and 1024 -> 64x64 = 4096. Timing: size by size, warm-up
calls, then ``--iters`` rounds in which every backend is called once (rotating order, so load
changes hit all backends alike), each call timed alone (CUDA events on a GPU, ``perf_counter`` on
the CPU), median reported with p10/p90. The ``kernel`` rows use the project's one kernel-timing
method instead (:mod:`qkrope.apps.kernel_bench`, also behind ``scripts/bench_kernel.py``: raw
C-ABI launches captured in a CUDA graph, rotating over buffers larger than 2 x L2). All
backends run the one exported block (eager PyTorch is ``build_attention`` of its sidecar) on
``qkrope.runtime.inputs.make_inputs`` inputs. On the CPU, torch and ONNX Runtime use one thread unless
``--threads`` says otherwise (the table says which). Every row carries the machine it ran on.

On a CPU-only machine the defaults are small (2 heads x 64, 256 px, 64 text tokens, fp32) so the
command finishes in seconds; choose ``--sizes/--heads/--head-dim/--text-len`` to go bigger.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from qkrope.errors import InputError

from .measure import (BenchRow, PIXELS_PER_TOKEN, format_bench_table, image_tokens, machine_info, peak_gbps, summarize, time_interleaved)


REQUIRES_CUDA = "requires CUDA (no GPU visible to torch)"
REQUIRES_TRT = "requires TensorRT (Python package 'tensorrt' not importable)"


# --------------------------------------------------------------------------------------------
# Pure helpers (unit tested)
# --------------------------------------------------------------------------------------------


def parse_int_list(text: str | Sequence[int]) -> list[int]:
    if not isinstance(text, str):
        return [int(x) for x in text]
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError as exc:
        raise InputError(f"expected comma-separated integers such as 512,1024; got {text!r}") \
            from exc
    if not vals or any(v <= 0 for v in vals):
        raise InputError(f"expected positive comma-separated integers; got {text!r}")
    return vals


# --------------------------------------------------------------------------------------------
# Rows, machine, table, plot
# --------------------------------------------------------------------------------------------


def write_plot(rows: Sequence[BenchRow], path: Path) -> Path:
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
    threads: int | None = None   # CPU threads for torch and ONNX Runtime (None: 1 on the CPU)


#: CPU threads when --threads is not given, on the CPU path. One thread measures the code, not
#: OpenMP/ORT thread-pool contention with whatever else runs on a small shared machine.
DEFAULT_CPU_THREADS = 1
# qkrope.dtypes' short and full names, spelled out so that `qkrope bench --help` imports no torch
# (tests/test_cli_help.py checks them against qkrope.dtypes.NAME_BY_SHORT).
DTYPE_CHOICES = sorted({"fp32", "fp16", "bf16", "float32", "float16", "bfloat16"})

# torch-importing names of this module's API, imported on first use (`qkrope bench --help` stays
# light; the functions below import them where they need them).
_LAZY = {"dtypes": ("qkrope", "dtypes"),
         "default_axes_dims": ("qkrope.runtime.caches", "default_axes_dims"),
         "checked_onnx_model": ("qkrope.runtime.trt_utils", "checked_onnx_model")}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cpu_threads(cfg: Config) -> int | None:
    """Threads for torch and ONNX Runtime: ``--threads``, else 1 on the CPU path, else None
    (torch's default; the GPU rows do not depend on it)."""
    if cfg.threads:
        return int(cfg.threads)
    return None if cfg.device.startswith("cuda") else DEFAULT_CPU_THREADS


def _block_config(info) -> dict:
    """The exporter's config for the block (``build_attention`` rebuilds the exported weights)."""
    return {**info.config, "dtype": info.dtype}


def _make_block(cfg: Config, info):
    """The exported QwenImageAttention, rebuilt by the exporter's ``build_attention`` from the
    sidecar: eager PyTorch runs the same weights as the ONNX model and the engines."""
    from qkrope.export.onnx_export import build_attention

    return build_attention(_block_config(info)).to(cfg.device).eval()


def _input_roles(info) -> dict[str, str]:
    """role -> input name, by the runner's own mapping (:func:`runner.assign_roles`)."""
    from qkrope.runtime.runner import assign_roles, spec_from_shape

    return assign_roles([spec_from_shape(t.name, t.dtype, t.shape) for t in info.inputs])


def _make_feeds(cfg: Config, info, size: int, batch: int):
    """Inputs for every graph input by name (numpy; :func:`qkrope.runtime.inputs.make_inputs`: the model's
    dtypes, Qwen-Image caches for this image, a text mask)."""
    side = size // PIXELS_PER_TOKEN
    from qkrope.runtime.inputs import make_inputs

    return make_inputs(info, [(1, side, side)], cfg.text_len, batch, seed=cfg.seed + size + batch)


def _make_inputs(cfg: Config, info, size: int, batch: int):
    """``(hidden_states, encoder_hidden_states, (img_cache, txt_cache), mask)`` as torch tensors
    on the device, from :func:`_make_feeds`."""
    from qkrope.runtime.inputs import to_torch

    feeds = _make_feeds(cfg, info, size, batch)
    roles = _input_roles(info)
    t = {role: to_torch(feeds[name]).to(cfg.device) for role, name in roles.items()}
    return (t["hidden_states"], t["encoder_hidden_states"], (t["img_cache"], t["txt_cache"]),
            t.get("encoder_hidden_states_mask"))


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


def _row(cfg: Config, backend: str, size: int, batch: int, machine: dict, **kw) -> BenchRow:
    return BenchRow(backend=backend, size=size, img_tokens=image_tokens(size), txt_tokens=cfg.text_len,
               batch=batch, dtype=cfg.dtype, device=machine.get("gpu") or machine.get("cpu", ""),
               machine=machine, **kw)


def _measured(cfg: Config, backend: str, size: int, batch: int, machine: dict,
              times: list[float]) -> BenchRow:
    st = summarize(times)
    return _row(cfg, backend, size, batch, machine, median_ms=st["median_ms"],
                p10_ms=st["p10_ms"], p90_ms=st["p90_ms"], iters=int(st["n"]))


def _export_onnx(cfg: Config, path: Path):
    """Export the attention block with the project's exporter (``qkrope export``'s function),
    with dynamic batch / token axes (sample batch >= 2 so torch.export does not specialise it).
    Returns its ModelInfo."""
    from qkrope import dtypes
    from qkrope.export.onnx_export import export_attention

    side = min(cfg.sizes) // PIXELS_PER_TOKEN
    info, _ = export_attention(path, heads=cfg.heads, head_dim=cfg.head_dim,
                               dtype=dtypes.short_name(cfg.dtype), seed=cfg.seed,
                               img_shapes=[(1, side, side)], txt_len=cfg.text_len,
                               batch=max(2, max(cfg.batches)))
    return info


def _torch_backends(cfg: Config, info, *, compiled: bool) -> dict[str, Callable]:
    """``{backend: prepare(size, batch) -> call}`` for torch eager (and torch.compile)."""
    import torch

    block = _make_block(cfg, info)

    def eager(size, batch):
        hs, ehs, caches, mask = _make_inputs(cfg, info, size, batch)
        return lambda: block(hs, ehs, caches, mask)

    out = {"torch-eager": eager}
    if compiled:
        compiled_block = torch.compile(block, dynamic=False)

        def comp(size, batch):
            hs, ehs, caches, mask = _make_inputs(cfg, info, size, batch)

            def call():
                # the reference maths only while the compiled block runs (eager keeps the op)
                with _reference_inlined():
                    return compiled_block(hs, ehs, caches, mask)

            for _ in range(2):  # compilation for this shape, outside the warm-up count
                call()
            return call

        out["torch-compile"] = comp
    return out


def _ort_backend(cfg: Config, info, onnx_path: Path) -> dict[str, Callable]:
    """``{"onnxruntime-cpu": prepare}``: ONNX Runtime CPU with the bench's thread count."""
    import onnxruntime as ort

    if cfg.dtype == "bfloat16":
        raise InputError("ONNX Runtime's CPU provider has no bfloat16 kernels for this graph; "
                         "use --dtype fp32 on the CPU")
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    threads = cpu_threads(cfg)
    if threads:
        so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    # no spin-waiting after a run: spinning ORT threads would steal the cores from the next
    # (interleaved) torch call
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])

    def prepare(size, batch):
        feeds = _make_feeds(cfg, info, size, batch)
        return lambda: sess.run(None, feeds)

    return {"onnxruntime-cpu": prepare}


def _engine_backend(cfg: Config, backend: str, engine: str, plugin: str | None, info):
    """``{backend: prepare}`` for a TensorRT engine through ``qkrope.runtime.load``."""
    from qkrope import runtime

    runner = runtime.load(engine, plugin=plugin)

    def prepare(size, batch):
        hs, ehs, caches, mask = _make_inputs(cfg, info, size, batch)
        return lambda: runner(hs, ehs, caches, mask)

    return {backend: prepare}


def _measure(cfg: Config, rows: list[BenchRow], machine: dict,
             backends: Mapping[str, Callable[[int, int], Callable[[], Any]]]) -> None:
    """Measure ``backends`` size by size, interleaved (:func:`time_interleaved`)."""
    cuda = cfg.device.startswith("cuda")
    for size in cfg.sizes:
        for batch in cfg.batches:
            calls, failed = {}, {}
            for name, prepare in backends.items():
                try:
                    calls[name] = prepare(size, batch)
                except Exception as exc:  # noqa: BLE001 - a failed row must not end the bench
                    failed[name] = exc
            results = time_interleaved(calls, iters=cfg.iters, warmup=cfg.warmup, cuda=cuda)
            for name in backends:
                res = failed.get(name, results.get(name))
                if isinstance(res, BaseException):
                    rows.append(_row(cfg, name, size, batch, machine, status="failed",
                                     reason=f"{type(res).__name__}: {res}"[:300]))
                else:
                    rows.append(_measured(cfg, name, size, batch, machine, res))


def _skip_all(cfg: Config, rows: list[BenchRow], backend: str, reason: str, machine: dict) -> None:
    for size in cfg.sizes:
        for batch in cfg.batches:
            rows.append(_row(cfg, backend, size, batch, machine, status="skipped", reason=reason))


def _have_tensorrt() -> bool:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return True


def _build_engines(cfg: Config, onnx_path: Path, workdir: Path, log: Callable[[str], None]
                   ) -> dict[str, tuple[str | None, str]]:
    """From the exported block, build the no-plugin engine (first: nothing registered yet)
    and the plugin engine, with one profile covering every benchmarked size and batch.
    Returns ``{backend: (engine path or None, reason it is None)}``."""
    from qkrope.runtime import engine as E

    out: dict[str, tuple[str | None, str]] = {}
    limits = dict(max_batch=max(cfg.batches), max_img_tokens=image_tokens(max(cfg.sizes)),
                  max_txt_tokens=cfg.text_len)
    eng_np = workdir / "attention.noplugin.engine"
    log(f"building {eng_np} (TensorRT, function body, no plugin)")
    try:
        E.build_engine(onnx_path, eng_np, E.BuildOptions(use_plugin=False, progress=False,
                                                         **limits))
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


def _bench_kernel(cfg: Config, rows: list[BenchRow], machine: dict) -> None:
    """``kernel`` rows: the fused kernel's img + txt launches of one block, timed by the one
    kernel-timing method (:mod:`qkrope.apps.kernel_bench`: raw C-ABI launches in a CUDA
    graph over buffer sets larger than 2 x L2, after a validated and checked call)."""
    import torch

    from . import kernel_bench as kb
    from qkrope.runtime.kernels import cuda_library_path

    if cuda_library_path() is None:
        _skip_all(cfg, rows, "kernel", "libqkrope_kernels.so not built (cmake -S plugins/kernel "
                  "-B build/kernel -DQKROPE_WITH_CUDA=ON && cmake --build build/kernel)", machine)
        return
    device = torch.device(cfg.device)
    peak, _ = kb.device_peak(device, cfg.peak_gbps)
    l2 = kb.l2_bytes(device)
    opts = kb.Options(iters=cfg.iters, warmup=cfg.warmup, seed=cfg.seed)
    for size in cfg.sizes:
        for batch in cfg.batches:
            case = kb.Case(size, batch, "block", heads=cfg.heads, head_dim=cfg.head_dim,
                           txt_tokens=cfg.text_len, dtype=cfg.dtype)
            r = kb.measure(case, "fused", opts, device=device, peak=peak, l2=l2)
            if r["status"] != "ok":
                rows.append(_row(cfg, "kernel", size, batch, machine, status="failed",
                                 reason=r["reason"]))
                continue
            row = _row(cfg, "kernel", size, batch, machine, median_ms=r["median_us"] * 1e-3,
                       p10_ms=r["p10_us"] * 1e-3, p90_ms=r["p90_us"] * 1e-3, iters=r["iters"])
            row.note = f"img + txt launch per block; {r['method']}"
            row.gbps = r["gbs"]
            row.peak_fraction = None if r["pct_peak"] is None else r["pct_peak"] / 100.0
            rows.append(row)


def run_bench(cfg: Config, *, log: Callable[[str], None] = print) -> list[BenchRow]:
    """Measure every row that this machine can, and report the others as skipped. torch's
    thread count and grad mode are restored afterwards."""
    import torch

    for size in cfg.sizes:
        image_tokens(size)  # validate early
    saved_threads, saved_grad = torch.get_num_threads(), torch.is_grad_enabled()
    threads = cpu_threads(cfg)
    try:
        if threads:
            torch.set_num_threads(threads)
        torch.set_grad_enabled(False)
        return _run_bench(cfg, log)
    finally:
        torch.set_num_threads(saved_threads)
        torch.set_grad_enabled(saved_grad)


def _run_bench(cfg: Config, log: Callable[[str], None]) -> list[BenchRow]:
    import torch

    from qkrope.runtime.trt_utils import checked_onnx_model

    on_gpu = cfg.device.startswith("cuda")
    machine = machine_info(cfg.device)
    machine["cpu_threads"] = str(torch.get_num_threads())
    with contextlib.suppress(OSError):
        load1 = os.getloadavg()[0]
        machine["load_avg_1min"] = f"{load1:.2f}"
        if not on_gpu and load1 > (os.cpu_count() or 1) - 0.5:
            log(f"warning: the machine is busy (1-min load {load1:.2f} on {os.cpu_count()} "
                f"cores); CPU timings will be noisy even with {torch.get_num_threads()} "
                f"thread(s)")
    rows: list[BenchRow] = []
    if cfg.out is not None:
        cfg.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="qkrope-bench-", dir=cfg.out))
    log(f"machine: {json.dumps(machine)}")
    log(f"config: sizes {cfg.sizes} px, batches {cfg.batches}, {cfg.heads} heads x "
        f"{cfg.head_dim}, text {cfg.text_len} tokens, {cfg.dtype}, {cfg.iters} iters "
        f"({cfg.warmup} warm-up), {torch.get_num_threads()} CPU thread(s), backends interleaved")

    # One export: the ONNX Runtime rows, the engines and eager PyTorch (build_attention from its
    # sidecar) all run the same weights.
    onnx_path = workdir / "attention.onnx"
    try:
        info = _export_onnx(cfg, onnx_path)
        export_error = ""
    except Exception as exc:  # noqa: BLE001
        info, export_error = None, f"ONNX export failed ({type(exc).__name__}: {exc})"[:300]
    if info is not None:
        # like every consumer of an ONNX file: its QKNormRoPE nodes within the node contract
        # before ONNX Runtime or TensorRT opens it
        try:
            checked_onnx_model(onnx_path, require_nodes=True)
        except Exception as exc:  # noqa: BLE001
            info, export_error = None, f"exported model refused ({type(exc).__name__}: {exc})"[:300]

    def skip_or(names, make):
        """``make()`` -> backends, or every row of ``names`` skipped with the reason."""
        if info is None:
            for b in names:
                _skip_all(cfg, rows, b, export_error, machine)
            return {}
        try:
            return make()
        except Exception as exc:  # noqa: BLE001
            for b in names:
                _skip_all(cfg, rows, b, f"{type(exc).__name__}: {exc}"[:300], machine)
            return {}

    backends: dict[str, Callable] = {}
    if on_gpu:
        given = {"trt-plugin": cfg.engine, "trt-function-body": cfg.engine_no_plugin}
        plugins = {"trt-plugin": cfg.plugin, "trt-function-body": None}
        if not _have_tensorrt():
            for b in given:
                _skip_all(cfg, rows, b, REQUIRES_TRT, machine)
        else:
            built: dict[str, tuple[str | None, str]] = {}
            if not all(given.values()) and info is not None:
                # build the missing ones (the no-plugin engine before the plugin is loaded)
                built = _build_engines(cfg, onnx_path, workdir, log)
            for b in ("trt-function-body", "trt-plugin"):
                path, reason = ((given[b], "") if given[b] else
                                built.get(b, (None, export_error or "not built")))
                if path is None:
                    _skip_all(cfg, rows, b, reason, machine)
                else:
                    backends.update(skip_or([b], lambda b=b, path=path: _engine_backend(
                        cfg, b, path, plugins[b], info)))
        backends.update(skip_or(["torch-eager", "torch-compile"],
                                lambda: _torch_backends(cfg, info, compiled=True)))
        _measure(cfg, rows, machine, backends)
        _bench_kernel(cfg, rows, machine)
    else:
        for b in ("trt-plugin", "trt-function-body"):
            _skip_all(cfg, rows, b, REQUIRES_CUDA + "; " + REQUIRES_TRT
                      if not _have_tensorrt() else REQUIRES_CUDA, machine)
        backends.update(skip_or(["onnxruntime-cpu"], lambda: _ort_backend(cfg, info, onnx_path)))
        backends.update(skip_or(["torch-eager"],
                                lambda: _torch_backends(cfg, info, compiled=False)))
        _measure(cfg, rows, machine, backends)
        _skip_all(cfg, rows, "torch-compile", REQUIRES_CUDA + " (CPU Inductor is not the "
                  "deployment target; measured on the GPU only)", machine)
        _skip_all(cfg, rows, "kernel", REQUIRES_CUDA, machine)
    if on_gpu and any(p.suffix == ".engine" for p in workdir.iterdir()):
        log(f"kept the exported model and engines in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


def write_outputs(rows: Sequence[BenchRow], out: Path, cfg: Config | None = None) -> dict[str, Path]:
    """bench.md (table + machine), bench.json (every row), bench.png (plot)."""
    out.mkdir(parents=True, exist_ok=True)
    table = format_bench_table(rows)
    machine = next((r.machine for r in rows if r.status == "ok"), rows[0].machine if rows else {})
    md = ["# qkrope bench", "", "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()),
          ""]
    if cfg is not None:
        md += [f"Config: {cfg.heads} heads x {cfg.head_dim}, text {cfg.text_len} tokens, "
               f"{cfg.dtype}, median of {cfg.iters} calls after {cfg.warmup} warm-up, "
               f"{cpu_threads(cfg) or 'default'} CPU thread(s)", ""]
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
    p.add_argument("--dtype", default=None, choices=DTYPE_CHOICES,
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
                   help=f"CPU threads for torch and ONNX Runtime (default: "
                        f"{DEFAULT_CPU_THREADS} on the CPU, so that the numbers measure the code "
                        f"rather than thread-pool contention; torch's default on a GPU)")
    p.add_argument("--out", default="bench-out", help="output directory (default bench-out)")
    p.set_defaults(func=run)
    return p


def config_from_args(args: argparse.Namespace) -> Config:
    import torch

    from qkrope import dtypes
    from qkrope.runtime.caches import default_axes_dims

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.startswith("cuda")
    if gpu and not torch.cuda.is_available():
        raise InputError(f"--device {device} requested but torch sees no CUDA GPU "
                           f"(torch {torch.__version__}); use --device cpu")
    dtype = dtypes.canonical(args.dtype) if args.dtype else ("bfloat16" if gpu else "float32")
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
    default_axes_dims(cfg.head_dim)
    if cfg.iters < 1:
        raise InputError(f"--iters must be >= 1; got {cfg.iters}")
    return cfg


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    cfg.out.mkdir(parents=True, exist_ok=True)
    rows = run_bench(cfg)
    paths = write_outputs(rows, cfg.out, cfg)
    print(format_bench_table(rows))
    print(f"wrote {paths['markdown']}, {paths['json']}, {paths['png']}")
    sys.stdout.flush()
    failed = [r for r in rows if r.status == "failed"]
    return 1 if failed else 0
