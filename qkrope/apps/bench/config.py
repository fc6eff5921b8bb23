"""``qkrope bench``'s configuration: the :class:`Config` of one run, the ``--preset`` table,
the defaults of the CPU and GPU paths, and the flags read into a :class:`Config`
(:func:`config_from_args`; the list flags ``--sizes``, ``--threads`` and ``--attention`` by
their own parsers)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from qkrope import contract
from qkrope.model_io import ATTENTION_BLOCK
from .. import _args
from qkrope.errors import InputError

from ..measure import image_tokens


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
    allow_host_code: bool = False  # --allow-host-code: a version-compatible engine may run


#: CPU threads when --threads is not given, on the CPU path. One thread measures the code, not
#: OpenMP/ORT thread-pool contention with whatever else runs on a small shared machine.
DEFAULT_CPU_THREADS = 1
DTYPE_CHOICES = _args.DTYPE_CHOICES  # the --dtype spellings of every command


#: ``--preset``: the model shape for every device, then what the CPU path adds. The flags given
#: override it.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "qwen": {"all": {"heads": ATTENTION_BLOCK.heads, "head_dim": ATTENTION_BLOCK.head_dim,
                     "sizes": "256,512", "text_len": 128,
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
    dtype = dtypes.canonical(dtype_arg, source="name") if dtype_arg else ("bfloat16" if gpu else "float32")
    threads = pick("threads", None)
    attention = getattr(args, "attention", None)
    cfg = Config(
        sizes=parse_int_list(pick("sizes", None) or ("512,1024" if gpu else "256")),
        batches=parse_int_list(pick("batches", None) or ("1,2" if gpu else "1")),
        dtype=dtype,
        heads=pick("heads", None) or (ATTENTION_BLOCK.heads if gpu else 2),
        head_dim=pick("head_dim", None) or (ATTENTION_BLOCK.head_dim if gpu else 64),
        text_len=pick("text_len", None) or (512 if gpu else 64),
        iters=pick("iters", None) or (50 if gpu else 10),
        warmup=pick("warmup", 10 if gpu else 2),
        device=device, engine=args.engine, plugin=args.plugin,
        engine_no_plugin=args.engine_no_plugin, peak_gbps=args.peak_gbps,
        out=Path(args.out), threads=parse_threads(threads) if threads else None,
        attention=parse_attention_forms(attention) if attention else None,
        profile_runs=int(getattr(args, "profile_runs", DEFAULT_PROFILE_RUNS)),
        cuda_graph=bool(getattr(args, "cuda_graph", False)),
        allow_host_code=bool(getattr(args, "allow_host_code", False)))
    for s in cfg.sizes:
        image_tokens(s)
    default_axes_dims(cfg.head_dim)
    if cfg.iters < 1:
        raise InputError(f"--iters must be >= 1; got {cfg.iters}")
    if cfg.profile_runs < 0:
        raise InputError(f"--profile-runs must be >= 0; got {cfg.profile_runs}")
    return cfg
