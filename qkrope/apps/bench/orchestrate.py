"""One ``qkrope bench`` run, step by step: the attention forms it can measure, a work folder, one
export per form, then on a GPU the TensorRT, torch and kernel rows, on the CPU one set of ONNX
Runtime and torch eager rows per thread count (with ONNX Runtime's profile); every row it cannot
measure is listed as skipped with the reason. Last, ``bench.md``, ``bench.json`` and
``bench.png``."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from qkrope._fileio import plain_mode

from ..measure import BenchRow, format_bench_table, image_tokens, machine_info
from .backends import (_bench_kernel, _build_engines, _engine_backend, _export_onnx,
                       _have_tensorrt, _make_block, _ort_backend, _torch_backends,
                       ort_attention23_reason, profile_ort)
from .config import ATTENTION_FORMS, Config, thread_counts
from .inspector import attention_span_nodes
from .ort_profile import attach_ratios, format_profiles, graph_names, profile_summary
from .plot import write_plot
from .rows import REQUIRES_CUDA, REQUIRES_TRT, Key, _measure, _skip_all

#: the TensorRT rows' backends, in the order their engines are built (no plugin first)
TRT_BACKENDS = ("trt-function-body", "trt-plugin")


def run_bench(cfg: Config, *, log: Callable[[str], None] = print) -> list[BenchRow]:
    """Measure every row that this machine can, and report the others as skipped. torch's
    thread count and grad mode are restored afterwards."""
    import torch

    for size in cfg.sizes:
        image_tokens(size)  # validate early
    saved_threads, saved_grad = torch.get_num_threads(), torch.is_grad_enabled()
    try:
        torch.set_grad_enabled(False)
        return _run_bench(cfg, log)
    finally:
        torch.set_num_threads(saved_threads)
        torch.set_grad_enabled(saved_grad)


def resolve_forms(cfg: Config) -> tuple[list[str], dict[str, str]]:
    """``(forms to export and measure, {form: why its rows are skipped})``. ``--attention``
    given: those forms (one that cannot run is skipped with the reason). Not given: both where
    they can run, else ``primitive``; a form left out is still listed as skipped with why."""
    wanted = list(cfg.attention) if cfg.attention else list(ATTENTION_FORMS)
    forms, skipped = [], {}
    for form in wanted:
        reason = ""
        if form == "onnx23" and not cfg.device.startswith("cuda"):
            reason = ort_attention23_reason()
        if reason:
            skipped[form] = reason
        else:
            forms.append(form)
    return forms, skipped


@dataclass
class _Export:
    path: Path
    info: Any = None
    error: str = ""


def _export_forms(cfg: Config, forms: Sequence[str], workdir: Path,
                  log: Callable[[str], None]) -> dict[str, _Export]:
    """One export per attention form (``attention.<form>.onnx``), each checked against the node
    contract like every consumer of an ONNX file does before ONNX Runtime or TensorRT opens it."""
    from qkrope.runtime.onnx_file import checked_onnx_model

    out: dict[str, _Export] = {}
    for form in forms:
        ex = out[form] = _Export(workdir / f"attention.{form}.onnx")
        log(f"exporting the block ({form} attention) to {ex.path}")
        try:
            ex.info = _export_onnx(cfg, ex.path, attention=form)
        except Exception as exc:  # noqa: BLE001
            ex.error = f"ONNX export failed ({type(exc).__name__}: {exc})"[:300]
            continue
        try:
            checked_onnx_model(ex.path, require_nodes=True)
        except Exception as exc:  # noqa: BLE001
            ex.info, ex.error = None, f"exported model refused ({type(exc).__name__}: {exc})"[:300]
    return out


def _run_bench(cfg: Config, log: Callable[[str], None]) -> list[BenchRow]:
    import torch

    on_gpu = cfg.device.startswith("cuda")
    sets = thread_counts(cfg)
    if on_gpu and len(sets) > 1:
        log(f"note: the GPU rows do not depend on CPU threads; measuring with {sets[0]} only")
        sets = sets[:1]
    machine = machine_info(cfg.device)
    machine["cpu_threads"] = str(sets[0] or torch.get_num_threads())
    with contextlib.suppress(OSError):
        load1 = os.getloadavg()[0]
        machine["load_avg_1min"] = f"{load1:.2f}"
        if not on_gpu and load1 > (os.cpu_count() or 1) - 0.5:
            log(f"warning: the machine is busy (1-min load {load1:.2f} on {os.cpu_count()} "
                f"cores); CPU timings will be noisy")
    rows: list[BenchRow] = []
    if cfg.out is not None:
        cfg.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="qkrope-bench-", dir=cfg.out))
    os.chmod(workdir, plain_mode(folder=True))  # it may be kept: the umask's mode, not 0700
    try:
        rows = _bench_in(cfg, workdir, rows, machine, sets, on_gpu, log)
    except BaseException:  # a failed or interrupted run leaves no work folder behind
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    kept = [p.name for p in workdir.iterdir()
            if p.suffix == ".engine" or (p.name.startswith("layers.") and p.suffix == ".json")]
    if kept:
        log(f"kept the exported models, engines and TensorRT layer information in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


@dataclass
class _Run:
    """What the steps of one run inside its work folder share."""

    cfg: Config
    workdir: Path
    rows: list[BenchRow]  # every row so far; skip_or adds the skipped ones here
    machine: dict
    log: Callable[[str], None]
    exports: dict[str, _Export]
    info: Any = None  # the sidecar of the first form that exported (eager PyTorch's block)
    export_error: str = ""  # why info is None
    block: Any = None  # build_attention of info (None where that failed: skip_or says why)

    def skip_or(self, keys: Sequence[Key], make: Callable[[], dict], machine: dict | None = None
                ) -> dict:
        """``make()`` -> backends, or every row of ``keys`` skipped with the reason."""
        machine = self.machine if machine is None else machine
        if self.info is None:
            for b, form in keys:
                _skip_all(self.cfg, self.rows, b, self.export_error, machine, attention=form)
            return {}
        try:
            return make()
        except Exception as exc:  # noqa: BLE001
            for b, form in keys:
                _skip_all(self.cfg, self.rows, b, f"{type(exc).__name__}: {exc}"[:300], machine,
                          attention=form)
            return {}


def _bench_in(cfg: Config, workdir: Path, rows: list[BenchRow], machine: dict,
              sets: Sequence[int | None], on_gpu: bool, log: Callable[[str], None]
              ) -> list[BenchRow]:
    """The body of :func:`_run_bench` inside its work folder: the plan, one export per form,
    then the GPU rows or the CPU's thread sets."""
    forms, form_skips = resolve_forms(cfg)
    _log_plan(cfg, machine, sets, forms, form_skips, log)
    run = _export_all(cfg, workdir, rows, machine, log, forms)
    if on_gpu:
        _bench_gpu(run, forms, sets[0])
    else:
        _bench_cpu(run, sets, form_skips)
    return rows


def _log_plan(cfg: Config, machine: dict, sets: Sequence[int | None], forms: Sequence[str],
              form_skips: dict[str, str], log: Callable[[str], None]) -> None:
    log(f"machine: {json.dumps(machine)}")
    log(f"config: sizes {cfg.sizes} px, batches {cfg.batches}, {cfg.heads} heads x "
        f"{cfg.head_dim}, text {cfg.text_len} tokens, {cfg.dtype}, {cfg.iters} iters "
        f"({cfg.warmup} warm-up), CPU thread sets {[t or 'default' for t in sets]}, attention "
        f"{forms or '-'}{f' (skipped: {sorted(form_skips)})' if form_skips else ''}, backends "
        f"interleaved")
    for form, reason in form_skips.items():
        log(f"{form} attention skipped: {reason}")


def _export_all(cfg: Config, workdir: Path, rows: list[BenchRow], machine: dict,
                log: Callable[[str], None], forms: Sequence[str]) -> _Run:
    """One export per form: the ONNX Runtime rows, the engines and eager PyTorch
    (build_attention from the sidecar of the first form that exported) all run the same
    weights."""
    exports = _export_forms(cfg, forms, workdir, log)
    good = [ex for ex in exports.values() if ex.info is not None]
    run = _Run(cfg, workdir, rows, machine, log, exports, info=good[0].info if good else None,
               export_error="; ".join(ex.error for ex in exports.values() if ex.error)
               or "no attention form to export")
    if run.info is not None:
        with contextlib.suppress(Exception):  # a failure here is reported by skip_or later
            run.block = _make_block(cfg, run.info)
    return run


def _bench_gpu(run: _Run, forms: Sequence[str], threads: int | None) -> None:
    """The GPU rows: the TensorRT engines of every form and torch eager / torch.compile timed
    interleaved, each engine's row noting its inspector's verdict, then the kernel's rows."""
    import torch

    cfg = run.cfg
    if threads:
        torch.set_num_threads(threads)
    extras: dict[Key, dict] = {}
    backends = _engine_backends(run, forms, extras)
    backends.update(run.skip_or([("torch-eager", "sdpa"), ("torch-compile", "")],
                                lambda: _torch_backends(cfg, run.info, compiled=True,
                                                        block=run.block)))
    _measure(cfg, run.rows, run.machine, backends, extras)
    for r in run.rows:
        if r.backend in TRT_BACKENDS and r.status == "ok" and r.fused_attention_basis:
            r.note = f"fused attention: {r.fused_attention} ({r.fused_attention_basis})"
    _bench_kernel(cfg, run.rows, run.machine)


def _engine_backends(run: _Run, forms: Sequence[str], extras: dict[Key, dict]
                     ) -> dict[Key, Callable]:
    """The TensorRT backends, with and without the plugin, of every form: the engines given
    (``--engine`` / ``--engine-no-plugin`` stand for the first form's) or built here; an engine
    that is neither, or TensorRT missing, leaves skipped rows with the reason."""
    cfg = run.cfg
    backends: dict[Key, Callable] = {}
    if not _have_tensorrt():
        for b in TRT_BACKENDS:
            for form in forms:
                _skip_all(cfg, run.rows, b, REQUIRES_TRT, run.machine, attention=form)
        return backends
    given = {(b, forms[0]): e for b, e in (("trt-plugin", cfg.engine),
                                           ("trt-function-body", cfg.engine_no_plugin))
             if e and forms}
    plugins = {"trt-plugin": cfg.plugin, "trt-function-body": None}
    exports = run.exports
    paths = {f: ex.path for f, ex in exports.items() if ex.info is not None}
    built = _build_engines(cfg, paths, run.workdir, run.log, skip=given) if paths else {}
    for form in forms:
        span = (attention_span_nodes(exports[form].path)
                if exports[form].info is not None else [])
        for b in TRT_BACKENDS:
            key = (b, form)
            path, reason = ((given[key], "") if key in given else
                            built.get(key, (None, exports[form].error or "not built")))
            if path is None:
                _skip_all(cfg, run.rows, b, reason, run.machine, attention=form)
                continue
            finfo = exports[form].info or run.info
            backends.update(run.skip_or([key], lambda b=b, form=form, path=path, finfo=finfo,
                                        span=span:
                                        _engine_backend(cfg, b, form, path, plugins[b], finfo,
                                                        extras, run.workdir, span)))
    return backends


def _bench_cpu(run: _Run, sets: Sequence[int | None], form_skips: dict[str, str]) -> None:
    """The CPU rows: one set of rows per thread count, the GPU-only rows listed as skipped."""
    cfg = run.cfg
    for b in TRT_BACKENDS:
        _skip_all(cfg, run.rows, b, REQUIRES_CUDA + "; " + REQUIRES_TRT
                  if not _have_tensorrt() else REQUIRES_CUDA, run.machine)
    names: dict[str, tuple[set[str], list[str]]] = {}  # graph_names of each form's export
    for threads in sets:
        set_rows = _cpu_set(run, threads, names, form_skips)
        run.rows += set_rows
    _skip_all(cfg, run.rows, "torch-compile", REQUIRES_CUDA + " (CPU Inductor is not the "
              "deployment target; measured on the GPU only)", run.machine)
    _skip_all(cfg, run.rows, "kernel", REQUIRES_CUDA, run.machine)


def _cpu_set(run: _Run, threads: int, names: dict[str, tuple[set[str], list[str]]],
             form_skips: dict[str, str]) -> list[BenchRow]:
    """One thread set: ONNX Runtime (each form) and torch eager with ``threads`` threads timed
    interleaved, then ONNX Runtime's profile of its rows, the ratios to eager, and the rows of
    the forms that cannot run."""
    import torch

    cfg = run.cfg
    torch.set_num_threads(int(threads))
    m = {**run.machine, "cpu_threads": str(threads)}
    with contextlib.suppress(OSError):  # the load this set started under
        m["load_avg_1min"] = f"{os.getloadavg()[0]:.2f}"
    set_rows: list[BenchRow] = []
    backends = {}
    for form, ex in run.exports.items():
        if ex.info is None:
            _skip_all(cfg, set_rows, "onnxruntime-cpu", ex.error, m, attention=form)
            continue
        with contextlib.suppress(Exception):
            names.setdefault(form, graph_names(ex.path))
        backends.update(run.skip_or([("onnxruntime-cpu", form)],
                                    lambda ex=ex, form=form: _ort_backend(
                                        cfg, ex.info, ex.path, threads, form), m))
    backends.update(run.skip_or([("torch-eager", "sdpa")],
                                lambda: _torch_backends(cfg, run.info, compiled=False,
                                                        block=run.block), m))
    run.log(f"timing {threads} thread(s): "
            f"{', '.join(f'{b} ({f})' if f else b for b, f in backends)}")
    _measure(cfg, set_rows, m, backends)
    del backends  # the timed sessions go before the profiled ones open
    if cfg.profile_runs > 0:
        _profile_rows(run, set_rows, threads, names)
    attach_ratios(set_rows)
    for form, reason in form_skips.items():
        _skip_all(cfg, set_rows, "onnxruntime-cpu", reason, m, attention=form)
    return set_rows


def _profile_rows(run: _Run, set_rows: Sequence[BenchRow], threads: int,
                  names: dict[str, tuple[set[str], list[str]]]) -> None:
    """ONNX Runtime's profile of each measured ``onnxruntime-cpu`` row of a set (its own
    profiled session, :func:`profile_ort`); a failure is the row's profile error."""
    cfg = run.cfg
    for r in set_rows:
        if r.backend != "onnxruntime-cpu" or r.status != "ok":
            continue
        ex = run.exports[r.attention]
        try:
            r.profile = profile_ort(cfg, ex.info, ex.path, r.size, r.batch, threads,
                                    run.workdir, runs=cfg.profile_runs,
                                    names=names.get(r.attention))
            run.log(f"profile {r.attention}, {threads} thread(s), {r.size} px: "
                    f"{profile_summary(r.profile)}")
        except Exception as exc:  # noqa: BLE001
            r.profile = {"error": f"{type(exc).__name__}: {exc}"[:300]}


def write_outputs(rows: Sequence[BenchRow], out: Path, cfg: Config | None = None) -> dict[str, Path]:
    """bench.md (table + machine + ORT profiles), bench.json (every row), bench.png (plot)."""
    out.mkdir(parents=True, exist_ok=True)
    table = format_bench_table(rows)
    machine = next((r.machine for r in rows if r.status == "ok"), rows[0].machine if rows else {})
    machine = {k: v for k, v in machine.items() if k != "cpu_threads"}
    md = ["# qkrope bench", "", "Machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()),
          ""]
    if cfg is not None:
        sets = ", ".join(str(t or "default") for t in thread_counts(cfg))
        forms = sorted({r.attention for r in rows if r.backend.startswith(("onnxruntime", "trt"))
                        and r.attention}, key=lambda f: ATTENTION_FORMS.index(f)
                       if f in ATTENTION_FORMS else 99)
        md += [f"Config: {cfg.heads} heads x {cfg.head_dim}, text {cfg.text_len} tokens, "
               f"{cfg.dtype}, median of {cfg.iters} calls after {cfg.warmup} warm-up, "
               f"CPU thread sets {sets}, attention forms {', '.join(forms) or '-'}", ""]
    md += [table, ""]
    profiles = format_profiles(rows)
    if profiles:
        md += [profiles, ""]
    paths = {"markdown": out / "bench.md", "json": out / "bench.json", "png": out / "bench.png"}
    paths["markdown"].write_text("\n".join(md))
    paths["json"].write_text(json.dumps([asdict(r) for r in rows], indent=1))
    write_plot(rows, paths["png"])
    return paths
