"""The backends of ``qkrope bench``: the exported block and its inputs, and per backend a
``prepare(size, batch) -> call``: torch eager and torch.compile, ONNX Runtime's CPU provider
(with the separate profiled session of its rows), TensorRT engines through
``qkrope.runtime.load`` (with their inspector's verdict), the engine builds, and the fused
kernel's own rows."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable, Collection, Mapping, Sequence

from qkrope import contract
from qkrope.errors import InputError
from qkrope.runtime.plugin_build import LIBRARY_FILES

from ..measure import BenchRow, PIXELS_PER_TOKEN, image_tokens
from .config import Config
from .inspector import _inspect_engine
from .ort_profile import aggregate_ort_profile, graph_names
from .rows import Key, _row, _skip_all


def _make_block(cfg: Config, info):
    """The exported QwenImageAttention, rebuilt by the exporter's ``build_attention`` from the
    sidecar: eager PyTorch runs the same weights as the ONNX model and the engines."""
    from qkrope.export.onnx_export import build_attention

    return build_attention(info).to(cfg.device).eval()


def _input_roles(info) -> dict[str, str]:
    """role -> input name, as the sidecar records them (:meth:`ModelInfo.roles`)."""
    return info.roles()


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


def ort_attention23_reason() -> str:
    """"" where ONNX Runtime's CPU provider runs an opset-23 ``Attention`` node the way the
    ``onnx23`` export uses it (4-D q/k/v, a bool mask of shape [B, 1, S, S]; probed on a
    1 x 2 x 4 x 8 model), else why it does not."""
    try:
        import numpy as np
        import onnxruntime as ort
        from onnx import TensorProto, helper
    except ImportError as exc:
        return f"ONNX Runtime or onnx is not importable ({exc})"
    try:
        shape = [1, 2, 4, 8]
        io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in "qkv"]
        mask = helper.make_tensor_value_info("mask", TensorProto.BOOL, [1, 1, 4, 4])
        out = helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)
        graph = helper.make_graph([helper.make_node("Attention", ["q", "k", "v", "mask"], ["y"])],
                                  "attention23_probe", io + [mask], [out])
        opset = contract.ATTENTION_MIN_OPSET["onnx23"]
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 10
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        feeds = {n: rng.standard_normal(shape).astype(np.float32) for n in "qkv"}
        feeds["mask"] = np.ones((1, 1, 4, 4), bool)
        feeds["mask"][..., -1] = False  # one key masked: the text-padding case
        (y,) = sess.run(None, feeds)
        if y.shape != tuple(shape):
            return f"ONNX Runtime's opset-23 Attention returned shape {y.shape}, not {shape}"
        return ""
    except Exception as exc:  # noqa: BLE001 - the reason is reported in the skipped rows
        return (f"ONNX Runtime {ort.__version__}'s CPU provider cannot run an opset-23 "
                f"Attention node with a bool mask ({type(exc).__name__}: {exc})")[:300]


def _export_onnx(cfg: Config, path: Path, attention: str = "primitive"):
    """Export the attention block with the project's exporter (``qkrope export``'s function),
    with dynamic batch / token axes (sample batch >= 2 so torch.export does not specialise it),
    in the attention form ``attention`` (at the exporter's default opset for it). Returns its
    ModelInfo."""
    from qkrope import dtypes
    from qkrope.export.onnx_export import export_attention

    side = min(cfg.sizes) // PIXELS_PER_TOKEN
    info, _ = export_attention(path, heads=cfg.heads, head_dim=cfg.head_dim,
                               dtype=dtypes.short_name(cfg.dtype), seed=cfg.seed,
                               img_shapes=[(1, side, side)], txt_len=cfg.text_len,
                               batch=max(2, max(cfg.batches)), attention=attention)
    return info


def _torch_backends(cfg: Config, info, *, compiled: bool, block=None) -> dict[Key, Callable]:
    """``{key: prepare(size, batch) -> call}`` for torch eager (and torch.compile)."""
    import torch

    block = _make_block(cfg, info) if block is None else block

    def eager(size, batch):
        hs, ehs, caches, mask = _make_inputs(cfg, info, size, batch)
        return lambda: block(hs, ehs, caches, mask)

    out: dict[Key, Callable] = {("torch-eager", "sdpa"): eager}
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

        out[("torch-compile", "")] = comp
    return out


def _ort_session(cfg: Config, onnx_path: Path, threads: int | None, *,
                 profile_prefix: Path | None = None):
    """ONNX Runtime CPU session with ``threads`` intra-op threads (one inter-op), no spinning,
    every graph optimisation; profiling on where ``profile_prefix`` is given."""
    import onnxruntime as ort

    if cfg.dtype == "bfloat16":
        raise InputError("ONNX Runtime's CPU provider has no bfloat16 kernels for this graph; "
                         "use --dtype fp32 on the CPU")
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        so.intra_op_num_threads = int(threads)
    so.inter_op_num_threads = 1
    # no spin-waiting after a run: spinning ORT threads would steal the cores from the next
    # (interleaved) torch call
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if profile_prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = str(profile_prefix)
    return ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])


def _ort_backend(cfg: Config, info, onnx_path: Path, threads: int | None = None,
                 form: str = "primitive") -> dict[Key, Callable]:
    """``{("onnxruntime-cpu", form): prepare}``: ONNX Runtime CPU with ``threads`` threads."""
    sess = _ort_session(cfg, onnx_path, threads)

    def prepare(size, batch):
        feeds = _make_feeds(cfg, info, size, batch)
        return lambda: sess.run(None, feeds)

    return {("onnxruntime-cpu", form): prepare}


def profile_ort(cfg: Config, info, onnx_path: Path, size: int, batch: int,
                threads: int | None, workdir: Path, *, runs: int,
                names: tuple[set[str], list[str]] | None = None) -> dict:
    """ONNX Runtime's per-op profile of one row: a separate session with profiling on (so the
    timed sessions are not perturbed), one warm-up run and ``runs`` profiled runs, aggregated by
    :func:`aggregate_ort_profile`. The trace file is removed."""
    prefix = workdir / f"ort-profile-{onnx_path.stem}-{threads or 'default'}t-{size}px-b{batch}"
    sess = _ort_session(cfg, onnx_path, threads, profile_prefix=prefix)
    feeds = _make_feeds(cfg, info, size, batch)
    sess.run(None, feeds)  # warm-up, left out of the sums
    for _ in range(runs):
        sess.run(None, feeds)
    trace = Path(sess.end_profiling())
    try:
        events = json.loads(trace.read_text())
    finally:
        trace.unlink(missing_ok=True)
    nodes, functions = names if names is not None else graph_names(onnx_path)
    prof = aggregate_ort_profile(events, runs=runs, graph_nodes=nodes, functions=functions)
    prof["threads"] = threads
    return prof


def _engine_backend(cfg: Config, backend: str, form: str, engine: str, plugin: str | None, info,
                    extras: dict[Key, dict], workdir: Path | None = None,
                    span_nodes: Sequence[str] = ()) -> dict[Key, Callable]:
    """``{(backend, form): prepare}`` for a TensorRT engine through ``qkrope.runtime.load``;
    its inspector's verdict on fused attention goes to ``extras``. A version-compatible engine
    loads only with the caller's ``--allow-host-code`` (``cfg.allow_host_code``)."""
    from qkrope import runtime

    runner = runtime.load(engine, plugin=plugin, cuda_graph=cfg.cuda_graph,
                          allow_host_code=cfg.allow_host_code)
    key = (backend, form)
    dump = workdir / f"layers.{backend}.{form}.json" if workdir is not None else None
    fused, basis = _inspect_engine(runner, dump, span_nodes)
    extras[key] = {"fused_attention": fused, "fused_attention_basis": basis}

    def prepare(size, batch):
        hs, ehs, caches, mask = _make_inputs(cfg, info, size, batch)
        return lambda: runner(hs, ehs, caches, mask)

    return {key: prepare}


def _have_tensorrt() -> bool:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return True


def _build_engines(cfg: Config, onnx_paths: Mapping[str, Path], workdir: Path,
                   log: Callable[[str], None], skip: Collection[Key] = ()
                   ) -> dict[Key, tuple[str | None, str]]:
    """From the exported block of each attention form, build the no-plugin engines (first:
    nothing registered yet) and then the plugin engines, with one profile covering every
    benchmarked size and batch, and detailed layer information for the inspector. Returns
    ``{(backend, form): (engine path or None, reason it is None)}``; ``skip`` keys are not
    built (an engine was given)."""
    from qkrope.runtime import engine as E

    out: dict[Key, tuple[str | None, str]] = {}
    limits = dict(max_batch=max(cfg.batches), max_img_tokens=image_tokens(max(cfg.sizes)),
                  max_txt_tokens=cfg.text_len, progress=False, profiling_verbosity="detailed")
    plan = [("trt-function-body", form, dict(use_plugin=False), "function body, no plugin")
            for form in onnx_paths] + \
           [("trt-plugin", form, dict(plugin=cfg.plugin), "QKNormRoPE plugin")
            for form in onnx_paths]
    for backend, form, kw, what in plan:
        if (backend, form) in skip:
            continue
        suffix = ".noplugin.engine" if backend == "trt-function-body" else ".engine"
        eng = workdir / f"attention.{form}{suffix}"
        log(f"building {eng} (TensorRT, {form} attention, {what})")
        try:
            E.build_engine(onnx_paths[form], eng, E.BuildOptions(**kw, **limits))
            out[(backend, form)] = (str(eng), "")
        except Exception as exc:  # noqa: BLE001
            out[(backend, form)] = (None, f"engine build failed: {type(exc).__name__}: {exc}"[:300])
    return out


def _bench_kernel(cfg: Config, rows: list[BenchRow], machine: dict) -> None:
    """``kernel`` rows: the fused kernel's img + txt launches of one block, timed by the one
    kernel-timing method (:mod:`qkrope.apps.kernel_bench`: raw C-ABI launches in a CUDA
    graph over buffer sets larger than 2 x L2, after a validated and checked call)."""
    import torch

    from .. import kernel_bench as kb
    from qkrope.runtime.kernels import cuda_library_path

    if cuda_library_path() is None:
        _skip_all(cfg, rows, "kernel", f"{LIBRARY_FILES['kernels'][0]} not built (cmake -S plugins/kernel "
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
