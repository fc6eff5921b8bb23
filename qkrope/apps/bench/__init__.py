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

The modules: :mod:`.config` (the :class:`Config`, ``--preset``, defaults, flag parsing),
:mod:`.backends` (the exported block, its inputs and each backend), :mod:`.rows` (rows from
timings, skips and failures), :mod:`.ort_profile` (ONNX Runtime's per-op profile),
:mod:`.inspector` (TensorRT's fused-attention verdict), :mod:`.plot` (``bench.png``) and
:mod:`.orchestrate` (one run, step by step, and its output files); this module is the command
(:func:`add_parser`, :func:`run`) and re-exports their names.
"""

from __future__ import annotations

import argparse
import sys

from qkrope._lazy import lazy_names

from .. import _args
from ..measure import format_bench_table
# every part's names, importable from here as they were before the parts had modules (the
# tests patch a name in the module that looks it up)
from .backends import (_bench_kernel, _build_engines, _engine_backend,
                       _export_onnx, _have_tensorrt, _input_roles, _make_block, _make_feeds,
                       _make_inputs, _ort_backend, _ort_session, _reference_inlined,
                       _torch_backends, ort_attention23_reason, profile_ort)
from .config import (ATTENTION_FORMS, DEFAULT_CPU_THREADS, DEFAULT_PROFILE_RUNS,
                     DTYPE_CHOICES, PRESETS, Config, available_threads, config_from_args,
                     cpu_threads, parse_attention_forms, parse_int_list, parse_threads,
                     thread_counts)
from .inspector import (_FUSED_KERNEL, VERDICTS, _inspect_engine, attention_span_nodes,
                        fused_attention_from_inspector)
from .orchestrate import (TRT_BACKENDS, _bench_in, _Export, _export_forms,
                          _run_bench, resolve_forms, run_bench, write_outputs)
from .ort_profile import (REST_OF_GRAPH, _body_group, aggregate_ort_profile,
                          attach_ratios, classify_profiled_node, format_profiles, graph_names,
                          profile_summary)
from .plot import write_plot
from .rows import REQUIRES_CUDA, REQUIRES_TRT, Key, _measure, _measured, _row, _skip_all


# torch-importing names of this module's API, imported on first use (`qkrope bench --help` stays
# light; the functions below import them where they need them).
_LAZY = {"default_axes_dims": "qkrope.runtime.caches",
         "checked_onnx_model": "qkrope.runtime.onnx_file"}
__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
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
    _args.add_dtype(p, "activation dtype; default bf16 on a GPU, fp32 on the CPU", default=None)
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
    _args.add_engine(p, "the one with the plugin, of the first --attention form (default: "
                        "export and build one per form when TensorRT exists)")
    _args.add_engine(p, "the same ONNX built without the plugin", flag="--engine-no-plugin")
    from qkrope.runtime.plugin_build import DEFAULT_PLUGIN_HELP

    _args.add_plugin(p, DEFAULT_PLUGIN_HELP)
    _args.add_allow_host_code(p, "with --engine / --engine-no-plugin: ")
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


def _check_host_code(args: argparse.Namespace) -> None:
    """A version-compatible --engine / --engine-no-plugin without --allow-host-code: one line
    before any work (:func:`qkrope.runtime.loader_tensorrt.check_host_code`, the check
    ``qkrope.runtime.load`` makes again when it loads the engine)."""
    if args.allow_host_code:
        return
    from qkrope.runtime.loader_tensorrt import check_host_code
    from qkrope.sidecars import EngineInfo

    for engine in (args.engine, args.engine_no_plugin):
        if engine is not None:
            check_host_code(EngineInfo.load(engine), engine, False)


def run(args: argparse.Namespace) -> int:
    for flag in ("--engine", "--engine-no-plugin"):  # before torch: a wrong path answers at once
        _args.check_engine(args, "bench", flag=flag)
    _args.check_plugin(args)
    _check_host_code(args)
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
