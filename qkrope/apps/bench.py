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
``qkrope.runtime.inputs.make_inputs`` inputs. Every row carries the machine it ran on.

Thread sets (CPU): ``--threads 1,all`` (``all`` = the CPUs this process may run on) measures
each count as its own set of rows: torch (``torch.set_num_threads``) and ONNX Runtime
(``intra_op_num_threads``) use the same count within a set, and each row says which
(``threads``). Without ``--threads`` the CPU path uses one thread.

Attention forms: ``--attention primitive,onnx23`` exports the block once per form
(``export_attention(attention=...)``: MatMul/Softmax/MatMul, or opset-23 ``Attention`` nodes) and
gives every ONNX Runtime / TensorRT row its form (``attention``; torch eager's is ``sdpa``). By
default both forms where the exporter has the option and ONNX Runtime's CPU provider runs an
opset-23 ``Attention`` (probed on a tiny model), else ``primitive`` with the ``onnx23`` rows
listed as skipped and why.

ONNX Runtime's profile: after each thread set is timed, a *separate* profiled session per form
and size (``SessionOptions.enable_profiling``; one warm-up run, then ``--profile-runs`` runs, the
warm-up left out of the sums) gives per-op-type kernel time per run, its share of all kernel
time, and the node count (``profile.top_ops`` of each ``onnxruntime-cpu`` row); the inlined
QKNormRoPE function body is reported as a group of its own (``profile.groups``;
:func:`classify_profiled_node` says how its nodes are recognised). Each ONNX Runtime row also has
``ort_vs_eager``: its median over torch eager's in the same set (below 1: ONNX Runtime faster);
where it is above 1 the row's note names the profile's top ops.

TensorRT (GPU): an engine with and without the plugin per attention form, built with
``ProfilingVerbosity.DETAILED`` (``BuildOptions.profiling_verbosity``), and ``fused_attention``
from the engine inspector's layer information (:func:`fused_attention_from_inspector` states the
basis; the layer information is kept next to the engines as ``layers.<backend>.<form>.json``).

Defaults: on a CPU-only machine small (2 heads x 64, 256 px, 64 text tokens, fp32, one thread),
so the command finishes in seconds. ``--preset qwen`` is the real head configuration as the
issue measured it: 24 heads x 128, 256 and 512 px (256 and 1024 image tokens), 128 text tokens,
batch 1, and on the CPU fp32, threads ``1,all``, 5 timed calls after 2 warm-up (about two minutes
on two cores); explicit flags override the preset.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Mapping, Sequence

from qkrope import contract
from qkrope.model_io import QWEN_IMAGE
from qkrope.apps.export import DTYPES
from qkrope.errors import InputError

from .measure import (BenchRow, PIXELS_PER_TOKEN, format_bench_table, image_tokens,
                      machine_info, summarize, time_interleaved)


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


#: the attention forms of the export (``export_attention(attention=...)``), stated once there
ATTENTION_FORMS = contract.ATTENTION_FORMS
#: ONNX Runtime profiled runs per row (after one warm-up run), unless --profile-runs says
DEFAULT_PROFILE_RUNS = 3


def available_threads() -> int:
    """The CPUs this process may run on (its affinity mask; ``os.cpu_count()`` where there is
    none): what ``--threads all`` means."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def parse_threads(text: str | int | Sequence[int | str]) -> list[int]:
    """``"1,all"`` -> ``[1, available_threads()]``: positive counts or ``all``, in the order
    given, each count once (``1,all`` on a one-CPU machine is one set)."""
    items = [text] if isinstance(text, int) else (
        text.replace(" ", "").split(",") if isinstance(text, str) else list(text))
    out: list[int] = []
    for item in items:
        if isinstance(item, str) and item.lower() == "all":
            n = available_threads()
        else:
            try:
                n = int(item)
            except (TypeError, ValueError):
                n = 0
            if n <= 0:
                raise InputError(f"--threads takes positive counts or 'all', comma-separated "
                                 f"(such as 1,all); got {text!r}")
        if n not in out:
            out.append(n)
    if not out:
        raise InputError(f"--threads takes positive counts or 'all', comma-separated; got {text!r}")
    return out


def parse_attention_forms(text: str | Sequence[str]) -> list[str]:
    """``"primitive,onnx23"`` -> ``["primitive", "onnx23"]`` (each once, order kept)."""
    items = text.replace(" ", "").split(",") if isinstance(text, str) else list(text)
    forms = list(dict.fromkeys(i for i in items if i))
    bad = [f for f in forms if f not in ATTENTION_FORMS]
    if bad or not forms:
        raise InputError(f"--attention takes {', '.join(ATTENTION_FORMS)} (comma-separated); "
                         f"got {text!r}")
    return forms


# --------------------------------------------------------------------------------------------
# ONNX Runtime's profile and TensorRT's layer information (pure; unit tested)
# --------------------------------------------------------------------------------------------

#: the group of the inlined function bodies' nodes in :func:`aggregate_ort_profile`
REST_OF_GRAPH = "rest of the graph"


def _body_group(functions: Sequence[str], name: str | None = None) -> str:
    if name is None:
        name = functions[0] if len(functions) == 1 else "inlined functions"
    return f"{name} function body"


def classify_profiled_node(name: str, op: str, *, graph_nodes: Collection[str] = (),
                           functions: Sequence[str] = ()) -> str:
    """The group of one profiled node: ``"<Function> function body"`` or :data:`REST_OF_GRAPH`.

    What an ONNX Runtime trace looks like (1.31, checked on the exported block): ORT inlines a
    model-local function (QKNormRoPE has no kernel there) before optimising. The inlined nodes
    keep the body's node names prefixed with ``_inlfunc_<Function>[_token_<n>]_``, and the
    body's value names are prefixed the same way; a body node without a name (models exported
    before the body's nodes were named) comes out nameless, and the profiler names a nameless
    node ``<OpType>_<index>``
    (``Mul_121``). Every node of the exported graph itself has a name (the torch exporter's
    ``node_...``), which ORT keeps, or extends with a ``/<Fusion>/`` suffix when it fuses nodes
    (``node_matmul/MatMulScaleFusion/``). So a node is in a function body when its name has
    the ``_inlfunc_`` prefix, or is ``<its op type>_<digits>`` and not a node name of the
    exported graph; anything else (the graph's nodes, nodes ORT's optimisers made) is the
    rest of the graph."""
    if name.startswith("_inlfunc_"):
        for f in sorted(functions, key=len, reverse=True):
            if name.startswith(f"_inlfunc_{f}"):
                return _body_group(functions, f)
        return _body_group(functions, name[len("_inlfunc_"):].split("_", 1)[0] or None)
    if name in graph_nodes or name.split("/", 1)[0] in graph_nodes:
        return REST_OF_GRAPH
    if re.fullmatch(re.escape(op) + r"_\d+", name):
        return _body_group(functions)
    return REST_OF_GRAPH


def aggregate_ort_profile(events: Sequence[Mapping[str, Any]], *, runs: int | None = None,
                          graph_nodes: Collection[str] = (), functions: Sequence[str] = (),
                          top: int = 8) -> dict:
    """Per-op-type kernel time of an ONNX Runtime profile (the list ``end_profiling()`` wrote).

    The ``"Node"`` events named ``<node>_kernel_time`` are the kernels (older releases also
    write ``_fence_before/after`` events; they are left out). Only those inside the last
    ``runs`` ``model_run`` events count (so the warm-up runs before them do not); times are per
    run. Returns ``{"runs", "total_us" (kernel time per run), "run_us" (mean model_run time,
    which adds the executor's own overhead), "top_ops": [{"op", "us_per_run", "share_pct",
    "nodes"}] (the ``top`` largest op types, then one ``"(N other op types)"`` entry, so the
    shares add up to 100), "groups": [the same by :func:`classify_profiled_node`]}``."""
    windows = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
               if e.get("cat") == "Session" and e.get("name") == "model_run"]
    if runs is not None and 0 < runs < len(windows):
        windows = windows[-runs:]
    nodes = [e for e in events if e.get("cat") == "Node"]
    kernels = [e for e in nodes if str(e.get("name", "")).endswith("_kernel_time")] or nodes
    if windows:
        kernels = [e for e in kernels
                   if any(a <= float(e.get("ts", -1)) <= b for a, b in windows)]
    n_runs = len(windows) or (runs or 1)
    by_op: dict[str, list] = {}
    by_group: dict[str, list] = {}
    for e in kernels:
        name = str(e.get("name", ""))
        if name.endswith("_kernel_time"):
            name = name[: -len("_kernel_time")]
        op = str((e.get("args") or {}).get("op_name") or name)
        dur = float(e.get("dur", 0))
        group = classify_profiled_node(name, op, graph_nodes=graph_nodes, functions=functions)
        for table, key in ((by_op, op), (by_group, group)):
            acc = table.setdefault(key, [0.0, set()])
            acc[0] += dur
            acc[1].add(name)
    total = sum(v[0] for v in by_op.values())

    def entries(table: dict, key: str, limit: int | None) -> list[dict]:
        ranked = sorted(table.items(), key=lambda kv: (-kv[1][0], kv[0]))
        keep, rest = (ranked, []) if limit is None else (ranked[:limit], ranked[limit:])
        out = [{key: k, "us_per_run": v[0] / n_runs,
                "share_pct": 100.0 * v[0] / total if total else 0.0, "nodes": len(v[1])}
               for k, v in keep]
        if rest:
            dur = sum(v[0] for _, v in rest)
            out.append({key: f"({len(rest)} other op types)", "us_per_run": dur / n_runs,
                        "share_pct": 100.0 * dur / total if total else 0.0,
                        "nodes": sum(len(v[1]) for _, v in rest)})
        return out

    run_us = (sum(b - a for a, b in windows) / len(windows)) if windows else None
    return {"runs": n_runs, "total_us": total / n_runs, "run_us": run_us,
            "top_ops": entries(by_op, "op", top), "groups": entries(by_group, "group", None)}


def profile_summary(profile: Mapping[str, Any] | None, *, ops: int = 4) -> str:
    """One line: the top op types with their share, the function-body group, the totals."""
    if not profile:
        return "no profile"
    tops = [o for o in profile.get("top_ops", []) if not str(o["op"]).startswith("(")][:ops]
    text = ", ".join(f"{o['op']} {o['share_pct']:.1f}%" for o in tops)
    bodies = [g for g in profile.get("groups", []) if g["group"] != REST_OF_GRAPH]
    for g in bodies:
        text += f"; {g['group']} {g['share_pct']:.1f}% ({g['nodes']} nodes)"
    run = profile.get("run_us")
    text += (f"; kernels {profile['total_us'] / 1e3:.1f} ms per run"
             + (f" of {run / 1e3:.1f} ms" if run else "")
             + f" ({profile['runs']} profiled run{'s' * (profile['runs'] != 1)})")
    return text


_FUSED_KERNEL = re.compile(r"fmha|mha|flash|attention", re.IGNORECASE)
#: fused_attention values: a kernel named so; the span inside one Myelin region; separate
#: kernels; the information cannot tell
VERDICTS = ("yes", "likely", "no", "unknown")


def attention_span_nodes(onnx_path: Path) -> list[str]:
    """The names of the nodes a fused attention must swallow: every Softmax (primitive form)
    and every ``Attention`` node (onnx23) of the model's main graph."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    return [n.name for n in model.graph.node
            if n.name and n.domain in ("", "ai.onnx") and n.op_type in ("Softmax", "Attention")]


def fused_attention_from_inspector(info: str | Mapping[str, Any],
                                   span_nodes: Sequence[str] = ()) -> tuple[str, str]:
    """Whether a TensorRT engine runs attention as a fused kernel, from its inspector's layer
    information (``IEngineInspector.get_engine_information(LayerInformationFormat.JSON)``).
    Returns ``(verdict, basis)``, the verdict one of :data:`VERDICTS`.

    ``span_nodes``: the ONNX names of the model's Softmax / Attention nodes
    (:func:`attention_span_nodes`); the metadata of a TensorRT layer lists the ONNX nodes it
    came from, so a name there places that node inside the layer. Rules, in this order:

    1. **yes**: a layer's ``TacticName`` mentions ``fmha``/``mha``/``flash``/``attention``
       (TensorRT's fused multi-head attention kernels are named so);
    2. **likely**: a layer that swallowed a span node without naming its kernel: a Myelin
       region (``LayerType`` ``Myelin`` or a ``{ForeignNode[...]}`` name) or an
       ``IAttentionLayer`` (``LayerType`` ``Attention``). TensorRT fuses attention there, but
       Myelin may still run BMM1, Softmax and BMM2 as separate kernels and the inspector does
       not list the kernels inside, so this is an inference, said as such;
    3. **no**: a softmax is a layer of its own outside Myelin (``LayerType`` or name
       ``softmax``): BMM1, Softmax and BMM2 run as separate kernels;
    4. **unknown** otherwise: in particular an engine built without
       ``ProfilingVerbosity.DETAILED`` lists layer names only.

    A node's *name* saying ``attention`` is never evidence (only its identity as a span node
    is)."""
    data = json.loads(info) if isinstance(info, (str, bytes)) else info
    layers = list((data or {}).get("Layers", []) or [])
    if not layers:
        return "unknown", "the inspector listed no layers"
    detailed = any(isinstance(l, Mapping) for l in layers)

    def text(layer, key):
        v = layer.get(key, "") if isinstance(layer, Mapping) else ""
        return v if isinstance(v, str) else json.dumps(v)

    def name(layer):
        return layer if isinstance(layer, str) else text(layer, "Name")

    def onnx_nodes(layer):  # the ONNX nodes a layer came from, by its metadata
        meta = text(layer, "Metadata")
        return set(re.findall(r"\[ONNX Layer: ([^\]]+)\]", meta)) | {name(layer)}

    def is_myelin(layer):
        return text(layer, "LayerType").lower() == "myelin" or "{foreignnode[" in name(layer).lower()

    for layer in layers:
        m = _FUSED_KERNEL.search(text(layer, "TacticName"))
        if m:
            return "yes", (f"layer {name(layer)!r}: tactic {text(layer, 'TacticName')!r} names a "
                           f"fused attention kernel")
    span = set(span_nodes)
    for layer in layers:
        kind = text(layer, "LayerType")
        if is_myelin(layer) or kind.lower() == "attention":
            inside = sorted(onnx_nodes(layer) & span)
            if inside:
                where = "Myelin region" if is_myelin(layer) else "IAttention layer"
                return "likely", (f"{inside[0]} inside the {where} {name(layer)[:120]!r} "
                                  f"(inferred: the inspector does not list the kernels inside)")
    for layer in layers:
        if is_myelin(layer):
            continue
        if "softmax" in text(layer, "LayerType").lower() or "softmax" in name(layer).lower():
            return "no", (f"softmax is its own layer {name(layer)!r}"
                          + (f" ({text(layer, 'LayerType')})" if detailed else "")
                          + ": the attention runs as separate kernels")
    if not detailed:
        return "unknown", ("layer names only (engine built without ProfilingVerbosity.DETAILED):"
                           " no attention kernel or softmax named")
    return "unknown", ("no attention kernel, no layer holding the model's Softmax/Attention "
                       "node, and no softmax layer found")


def attach_ratios(rows: Sequence[BenchRow]) -> None:
    """Set ``ort_vs_eager`` (ONNX Runtime median / torch-eager median of the same thread set,
    size, batch and dtype) on every measured ``onnxruntime-*`` row, and a note saying whether
    ONNX Runtime is no slower than eager; where it is slower the note names the top ops of the
    row's profile."""
    eager = {(r.threads, r.size, r.batch, r.dtype): r for r in rows
             if r.backend == "torch-eager" and r.status == "ok" and r.median_ms}
    for r in rows:
        if not r.backend.startswith("onnxruntime") or r.status != "ok" or not r.median_ms:
            continue
        e = eager.get((r.threads, r.size, r.batch, r.dtype))
        if e is None:
            continue
        r.ort_vs_eager = r.median_ms / e.median_ms
        if r.ort_vs_eager <= 1.0:
            verdict = f"ONNX Runtime no slower than torch eager ({r.ort_vs_eager:.2f}x)"
        else:
            verdict = (f"ONNX Runtime slower than torch eager ({r.ort_vs_eager:.2f}x); "
                       f"profile: {profile_summary(r.profile)}")
        r.note = f"{r.note}; {verdict}" if r.note else verdict


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
    # CPU threads for torch and ONNX Runtime: one count or a list (one set of rows each);
    # None: 1 on the CPU, torch's default on a GPU
    threads: int | Sequence[int] | None = None
    # attention forms to export and measure (ATTENTION_FORMS); None: both where they run
    attention: Sequence[str] | None = None
    profile_runs: int = DEFAULT_PROFILE_RUNS  # ONNX Runtime profiled runs per row; 0: none
    cuda_graph: bool = False  # TensorRT rows replay a CUDA graph per shapes (qkrope.runtime.load)


#: CPU threads when --threads is not given, on the CPU path. One thread measures the code, not
#: OpenMP/ORT thread-pool contention with whatever else runs on a small shared machine.
DEFAULT_CPU_THREADS = 1
# the --dtype spellings of every command (qkrope.apps.export.DTYPES: qkrope.dtypes' short names)
DTYPE_CHOICES = DTYPES

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


#: ``--preset``: the model shape for every device, then what the CPU path adds. The flags given
#: override it.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "qwen": {"all": {"heads": QWEN_IMAGE.heads, "head_dim": QWEN_IMAGE.head_dim, "sizes": "256,512", "text_len": 128,
                     "batches": "1"},
             "cpu": {"dtype": "fp32", "threads": "1,all", "iters": 5, "warmup": 2}},
}


def thread_counts(cfg: Config) -> list[int | None]:
    """The thread sets: ``--threads`` (one count or a list), else ``[1]`` on the CPU path, else
    ``[None]`` (torch's default; the GPU rows do not depend on it)."""
    if cfg.threads:
        return list(parse_threads(cfg.threads))
    return [None] if cfg.device.startswith("cuda") else [DEFAULT_CPU_THREADS]


def cpu_threads(cfg: Config) -> int | None:
    """The first thread set's count (:func:`thread_counts`)."""
    return thread_counts(cfg)[0]


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


Key = tuple  # (backend, attention form or "") of one series of rows


def _row(cfg: Config, backend: str, size: int, batch: int, machine: dict, **kw) -> BenchRow:
    if "threads" not in kw:
        t = machine.get("cpu_threads")
        kw["threads"] = int(t) if t not in (None, "") else None
    return BenchRow(backend=backend, size=size, img_tokens=image_tokens(size), txt_tokens=cfg.text_len,
               batch=batch, dtype=cfg.dtype, device=machine.get("gpu") or machine.get("cpu", ""),
               machine=machine, **kw)


def _measured(cfg: Config, key: Key, size: int, batch: int, machine: dict,
              times: list[float], **kw) -> BenchRow:
    st = summarize(times)
    return _row(cfg, key[0], size, batch, machine, attention=key[1], median_ms=st["median_ms"],
                p10_ms=st["p10_ms"], p90_ms=st["p90_ms"], iters=int(st["n"]), **kw)


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


def graph_names(onnx_path: Path) -> tuple[set[str], list[str]]:
    """(the node names of the model's main graph, its model-local functions' names), for
    :func:`classify_profiled_node`."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    return {n.name for n in model.graph.node if n.name}, [f.name for f in model.functions]


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


def _inspect_engine(runner, dump: Path | None = None, span_nodes: Sequence[str] = ()
                    ) -> tuple[str, str]:
    """``fused_attention_from_inspector`` of a loaded TensorRT runner's engine (and the layer
    information written to ``dump``)."""
    engine, trt = getattr(runner, "engine", None), getattr(runner, "trt", None)
    if engine is None or trt is None:
        return "unknown", "the runner exposes no TensorRT engine to inspect"
    try:
        inspector = engine.create_engine_inspector()
        info = inspector.get_engine_information(trt.LayerInformationFormat.JSON)
    except Exception as exc:  # noqa: BLE001
        return "unknown", f"engine inspector failed ({type(exc).__name__}: {exc})"[:300]
    if dump is not None:
        with contextlib.suppress(OSError):
            dump.write_text(info if isinstance(info, str) else json.dumps(info))
    try:
        return fused_attention_from_inspector(info, span_nodes)
    except (ValueError, TypeError) as exc:
        return "unknown", f"unreadable inspector JSON ({type(exc).__name__}: {exc})"[:300]


def _engine_backend(cfg: Config, backend: str, form: str, engine: str, plugin: str | None, info,
                    extras: dict[Key, dict], workdir: Path | None = None,
                    span_nodes: Sequence[str] = ()) -> dict[Key, Callable]:
    """``{(backend, form): prepare}`` for a TensorRT engine through ``qkrope.runtime.load``;
    its inspector's verdict on fused attention goes to ``extras``."""
    from qkrope import runtime

    runner = runtime.load(engine, plugin=plugin, cuda_graph=cfg.cuda_graph)
    key = (backend, form)
    dump = workdir / f"layers.{backend}.{form}.json" if workdir is not None else None
    fused, basis = _inspect_engine(runner, dump, span_nodes)
    extras[key] = {"fused_attention": fused, "fused_attention_basis": basis}

    def prepare(size, batch):
        hs, ehs, caches, mask = _make_inputs(cfg, info, size, batch)
        return lambda: runner(hs, ehs, caches, mask)

    return {key: prepare}


def _measure(cfg: Config, rows: list[BenchRow], machine: dict,
             backends: Mapping[Key, Callable[[int, int], Callable[[], Any]]],
             extras: Mapping[Key, dict] | None = None) -> None:
    """Measure ``backends`` size by size, interleaved (:func:`time_interleaved`)."""
    cuda = cfg.device.startswith("cuda")
    extras = extras or {}
    for size in cfg.sizes:
        for batch in cfg.batches:
            calls, failed = {}, {}
            for key, prepare in backends.items():
                try:
                    calls[key] = prepare(size, batch)
                except Exception as exc:  # noqa: BLE001 - a failed row must not end the bench
                    failed[key] = exc
            results = time_interleaved(calls, iters=cfg.iters, warmup=cfg.warmup, cuda=cuda)
            for key in backends:
                res = failed.get(key, results.get(key))
                extra = dict(extras.get(key, {}))
                if isinstance(res, BaseException):
                    rows.append(_row(cfg, key[0], size, batch, machine, attention=key[1],
                                     status="failed", reason=f"{type(res).__name__}: {res}"[:300],
                                     **extra))
                else:
                    rows.append(_measured(cfg, key, size, batch, machine, res, **extra))


def _skip_all(cfg: Config, rows: list[BenchRow], backend: str, reason: str, machine: dict,
              attention: str = "") -> None:
    for size in cfg.sizes:
        for batch in cfg.batches:
            rows.append(_row(cfg, backend, size, batch, machine, status="skipped", reason=reason,
                             attention=attention))


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
    try:
        torch.set_grad_enabled(False)
        return _run_bench(cfg, log)
    finally:
        torch.set_num_threads(saved_threads)
        torch.set_grad_enabled(saved_grad)


@dataclass
class _Export:
    path: Path
    info: Any = None
    error: str = ""


def _export_forms(cfg: Config, forms: Sequence[str], workdir: Path,
                  log: Callable[[str], None]) -> dict[str, _Export]:
    """One export per attention form (``attention.<form>.onnx``), each checked against the node
    contract like every consumer of an ONNX file does before ONNX Runtime or TensorRT opens it."""
    from qkrope.runtime.trt_utils import checked_onnx_model

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


def _bench_in(cfg: Config, workdir: Path, rows: list[BenchRow], machine: dict,
              sets: Sequence[int | None], on_gpu: bool, log: Callable[[str], None]
              ) -> list[BenchRow]:
    """The body of :func:`_run_bench` inside its work folder."""
    import torch

    forms, form_skips = resolve_forms(cfg)
    log(f"machine: {json.dumps(machine)}")
    log(f"config: sizes {cfg.sizes} px, batches {cfg.batches}, {cfg.heads} heads x "
        f"{cfg.head_dim}, text {cfg.text_len} tokens, {cfg.dtype}, {cfg.iters} iters "
        f"({cfg.warmup} warm-up), CPU thread sets {[t or 'default' for t in sets]}, attention "
        f"{forms or '-'}{f' (skipped: {sorted(form_skips)})' if form_skips else ''}, backends "
        f"interleaved")
    for form, reason in form_skips.items():
        log(f"{form} attention skipped: {reason}")

    # One export per form: the ONNX Runtime rows, the engines and eager PyTorch (build_attention
    # from the sidecar of the first form that exported) all run the same weights.
    exports = _export_forms(cfg, forms, workdir, log)
    good = [ex for ex in exports.values() if ex.info is not None]
    info = good[0].info if good else None
    export_error = "; ".join(ex.error for ex in exports.values() if ex.error) or \
        "no attention form to export"

    def skip_or(keys: Sequence[Key], make, machine_=machine):
        """``make()`` -> backends, or every row of ``keys`` skipped with the reason."""
        if info is None:
            for b, form in keys:
                _skip_all(cfg, rows, b, export_error, machine_, attention=form)
            return {}
        try:
            return make()
        except Exception as exc:  # noqa: BLE001
            for b, form in keys:
                _skip_all(cfg, rows, b, f"{type(exc).__name__}: {exc}"[:300], machine_,
                          attention=form)
            return {}

    block = None
    if info is not None:
        with contextlib.suppress(Exception):  # a failure here is reported by skip_or below
            block = _make_block(cfg, info)
    trt_names = ("trt-function-body", "trt-plugin")
    if on_gpu:
        if sets[0]:
            torch.set_num_threads(sets[0])
        backends: dict[Key, Callable] = {}
        extras: dict[Key, dict] = {}
        if not _have_tensorrt():
            for b in trt_names:
                for form in forms:
                    _skip_all(cfg, rows, b, REQUIRES_TRT, machine, attention=form)
        else:
            # --engine / --engine-no-plugin stand for the first form's engines
            given = {(b, forms[0]): e for b, e in (("trt-plugin", cfg.engine),
                                                   ("trt-function-body", cfg.engine_no_plugin))
                     if e and forms}
            plugins = {"trt-plugin": cfg.plugin, "trt-function-body": None}
            paths = {f: ex.path for f, ex in exports.items() if ex.info is not None}
            built = _build_engines(cfg, paths, workdir, log, skip=given) if paths else {}
            for form in forms:
                span = (attention_span_nodes(exports[form].path)
                        if exports[form].info is not None else [])
                for b in trt_names:
                    key = (b, form)
                    path, reason = ((given[key], "") if key in given else
                                    built.get(key, (None, exports[form].error or "not built")))
                    if path is None:
                        _skip_all(cfg, rows, b, reason, machine, attention=form)
                        continue
                    finfo = exports[form].info or info
                    backends.update(skip_or([key], lambda b=b, form=form, path=path, finfo=finfo,
                                            span=span:
                                            _engine_backend(cfg, b, form, path, plugins[b], finfo,
                                                            extras, workdir, span)))
        backends.update(skip_or([("torch-eager", "sdpa"), ("torch-compile", "")],
                                lambda: _torch_backends(cfg, info, compiled=True, block=block)))
        _measure(cfg, rows, machine, backends, extras)
        for r in rows:
            if r.backend in trt_names and r.status == "ok" and r.fused_attention_basis:
                r.note = f"fused attention: {r.fused_attention} ({r.fused_attention_basis})"
        _bench_kernel(cfg, rows, machine)
    else:
        for b in trt_names:
            _skip_all(cfg, rows, b, REQUIRES_CUDA + "; " + REQUIRES_TRT
                      if not _have_tensorrt() else REQUIRES_CUDA, machine)
        names = {}
        for threads in sets:
            torch.set_num_threads(int(threads))
            m = {**machine, "cpu_threads": str(threads)}
            with contextlib.suppress(OSError):  # the load this set started under
                m["load_avg_1min"] = f"{os.getloadavg()[0]:.2f}"
            set_rows: list[BenchRow] = []
            backends = {}
            for form, ex in exports.items():
                if ex.info is None:
                    _skip_all(cfg, set_rows, "onnxruntime-cpu", ex.error, m, attention=form)
                    continue
                with contextlib.suppress(Exception):
                    names.setdefault(form, graph_names(ex.path))
                backends.update(skip_or([("onnxruntime-cpu", form)],
                                        lambda ex=ex, form=form: _ort_backend(
                                            cfg, ex.info, ex.path, threads, form), m))
            backends.update(skip_or([("torch-eager", "sdpa")],
                                    lambda: _torch_backends(cfg, info, compiled=False,
                                                            block=block), m))
            log(f"timing {threads} thread(s): {', '.join(f'{b} ({f})' if f else b for b, f in backends)}")
            _measure(cfg, set_rows, m, backends)
            del backends  # the timed sessions go before the profiled ones open
            if cfg.profile_runs > 0:
                for r in set_rows:
                    if r.backend != "onnxruntime-cpu" or r.status != "ok":
                        continue
                    ex = exports[r.attention]
                    try:
                        r.profile = profile_ort(cfg, ex.info, ex.path, r.size, r.batch, threads,
                                                workdir, runs=cfg.profile_runs,
                                                names=names.get(r.attention))
                        log(f"profile {r.attention}, {threads} thread(s), {r.size} px: "
                            f"{profile_summary(r.profile)}")
                    except Exception as exc:  # noqa: BLE001
                        r.profile = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            attach_ratios(set_rows)
            for form, reason in form_skips.items():
                _skip_all(cfg, set_rows, "onnxruntime-cpu", reason, m, attention=form)
            rows += set_rows
        _skip_all(cfg, rows, "torch-compile", REQUIRES_CUDA + " (CPU Inductor is not the "
                  "deployment target; measured on the GPU only)", machine)
        _skip_all(cfg, rows, "kernel", REQUIRES_CUDA, machine)
    return rows


def format_profiles(rows: Sequence[BenchRow]) -> str:
    """One line per profiled ONNX Runtime row: its top ops and the function-body group."""
    lines = []
    for r in rows:
        if r.profile is None:
            continue
        what = (f"error: {r.profile['error']}" if "error" in r.profile
                else profile_summary(r.profile))
        ratio = f" [{r.ort_vs_eager:.2f}x eager]" if r.ort_vs_eager is not None else ""
        lines.append(f"- {r.attention}, {r.threads} thread(s), {r.size} px, batch {r.batch}"
                     f"{ratio}: {what}")
    return "\n".join(["ONNX Runtime profile (kernel time by op type, share of all kernels):", ""]
                     + lines) if lines else ""


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
                    "CPU machine: ONNX Runtime CPU vs torch eager (ratio and ONNX Runtime's "
                    "per-op profile), and the GPU rows listed as skipped with the reason. Each "
                    "attention form (--attention) and thread count (--threads) is its own set "
                    "of rows. Writes bench.md, bench.json and bench.png to --out.")
    p.add_argument("--model", default="attention", choices=["attention"],
                   help="what to benchmark (the Qwen-Image joint attention block)")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="qwen: 24 heads x 128, sizes 256,512, text 128 tokens, batch 1; on the "
                        "CPU also fp32, --threads 1,all, 5 iters after 2 warm-up (about two "
                        "minutes on 2 cores). Flags given override it")
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
    p.add_argument("--attention", default=None,
                   help="attention forms of the export, comma-separated: primitive "
                        "(MatMul/Softmax/MatMul) and/or onnx23 (opset-23 Attention); one set of "
                        "ONNX Runtime / TensorRT rows each. Default: both where the exporter and "
                        "ONNX Runtime's CPU provider support onnx23, else primitive (the onnx23 "
                        "rows then say why they were skipped)")
    p.add_argument("--engine", default=None, help="TensorRT engine with the plugin, of the first "
                                                  "--attention form (default: export and build "
                                                  "one per form when TensorRT exists)")
    p.add_argument("--engine-no-plugin", default=None,
                   help="TensorRT engine of the same ONNX built without the plugin")
    p.add_argument("--plugin", default=None, help="the plugin library (libqkrope_plugin.so)")
    p.add_argument("--peak-gbps", type=float, default=None,
                   help="the GPU's peak memory bandwidth in GB/s (default: from a table of "
                        "known GPUs; H200 4800)")
    p.add_argument("--threads", default=None,
                   help=f"CPU threads for torch and ONNX Runtime: a count or a comma-separated "
                        f"list, 'all' = every CPU this process may use (e.g. 1,all); each count "
                        f"is its own set of rows. Default: {DEFAULT_CPU_THREADS} on the CPU, so "
                        f"that the numbers measure the code rather than thread-pool contention; "
                        f"torch's default on a GPU")
    p.add_argument("--profile-runs", type=int, default=DEFAULT_PROFILE_RUNS,
                   help="ONNX Runtime profiled runs per row (a separate session after the "
                        f"timing, one warm-up run first); 0 turns the profile off (default "
                        f"{DEFAULT_PROFILE_RUNS})")
    p.add_argument("--cuda-graph", action="store_true",
                   help="the TensorRT rows replay a CUDA graph captured once per input shapes "
                        "(qkrope.runtime.load(..., cuda_graph=True); TensorRT's diffusion demo "
                        "does so by default)")
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
    preset = PRESETS[args.preset] if getattr(args, "preset", None) else {}
    given = {**preset.get("all", {}), **({} if gpu else preset.get("cpu", {}))}

    def pick(name: str, default):
        value = getattr(args, name, None)
        return value if value is not None else given.get(name, default)

    dtype_arg = pick("dtype", None)
    dtype = dtypes.canonical(dtype_arg) if dtype_arg else ("bfloat16" if gpu else "float32")
    threads = pick("threads", None)
    attention = getattr(args, "attention", None)
    cfg = Config(
        sizes=parse_int_list(pick("sizes", None) or ("512,1024" if gpu else "256")),
        batches=parse_int_list(pick("batches", None) or ("1,2" if gpu else "1")),
        dtype=dtype,
        heads=pick("heads", None) or (QWEN_IMAGE.heads if gpu else 2),
        head_dim=pick("head_dim", None) or (QWEN_IMAGE.head_dim if gpu else 64),
        text_len=pick("text_len", None) or (512 if gpu else 64),
        iters=pick("iters", None) or (50 if gpu else 10),
        warmup=pick("warmup", 10 if gpu else 2),
        device=device, engine=args.engine, plugin=args.plugin,
        engine_no_plugin=args.engine_no_plugin, peak_gbps=args.peak_gbps,
        out=Path(args.out), threads=parse_threads(threads) if threads else None,
        attention=parse_attention_forms(attention) if attention else None,
        profile_runs=int(getattr(args, "profile_runs", DEFAULT_PROFILE_RUNS)),
        cuda_graph=bool(getattr(args, "cuda_graph", False)))
    for s in cfg.sizes:
        image_tokens(s)
    default_axes_dims(cfg.head_dim)
    if cfg.iters < 1:
        raise InputError(f"--iters must be >= 1; got {cfg.iters}")
    if cfg.profile_runs < 0:
        raise InputError(f"--profile-runs must be >= 0; got {cfg.profile_runs}")
    return cfg


def run(args: argparse.Namespace) -> int:
    from qkrope import _preflight as pre  # before torch: a wrong path answers at once

    for flag, value in (("--engine", args.engine), ("--engine-no-plugin", args.engine_no_plugin)):
        if value is not None:
            pre.engine(value, command=f"bench {flag}", flag=flag, onnx_ok=True)
    pre.input_file(args.plugin, flag="--plugin",
                   fix="build it with `qkrope build-plugin`, or pass the path of "
                       "libqkrope_plugin.so")
    cfg = config_from_args(args)
    cfg.out.mkdir(parents=True, exist_ok=True)
    rows = run_bench(cfg)
    paths = write_outputs(rows, cfg.out, cfg)
    print(format_bench_table(rows))
    profiles = format_profiles(rows)
    if profiles:
        print()
        print(profiles)
    print(f"wrote {paths['markdown']}, {paths['json']}, {paths['png']}")
    sys.stdout.flush()
    failed = [r for r in rows if r.status == "failed"]
    return 1 if failed else 0
