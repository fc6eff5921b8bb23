"""One interface over a TensorRT engine and an ONNX model: :func:`load`.

    runner = qkrope.runtime.load("attn.engine")            # or "attn.onnx" (ONNX Runtime)
    img_out, txt_out = runner(hidden_states, encoder_hidden_states,
                              image_rotary_emb=(img_cache, txt_cache))
    img_out, txt_out = runner.run_qwen(hidden_states, encoder_hidden_states,
                                       img_shapes=[(1, 64, 64)])

Every call is checked **before** anything executes: the RoPE caches with
:func:`~qkrope.runtime.validate_cos_sin_caches` (head_dim from the model), then every input's
dtype, rank, dimensions (static ones, the engine profile's min/max, shared axes such as batch),
device and contiguity. Failures raise :class:`RopeCacheError` (the cache pair) or
:class:`RunnerInputError` (everything else), both RuntimeErrors whose message says what was
received, what was expected and the fix. Nothing is converted or copied silently.

Threads, streams, buffers:

- TensorRT: per calling thread (``threading.local``) one ``torch.cuda.Stream`` and one
  ``IExecutionContext`` per optimisation profile, created on first use and bound to its profile
  with ``set_optimization_profile_async`` on that stream; each call runs on the first profile
  whose [min, max] holds its shapes (shapes no profile holds are refused, naming the profiles).
  ``cuda_graph=True`` replays a CUDA graph captured once per (profile, shapes). The engine is
  shared. The runner
  makes its stream wait for the caller's current stream, enqueues with ``execute_async_v3``, and
  makes the caller's current stream wait for it, so results are ordered on the caller's stream
  without a host synchronisation.
- Outputs are allocated per (thread, output, shape) and reused while that shape is one of the
  last :data:`BUFFERS_PER_NAME` (2) used: the tensors a call returns may be overwritten by a
  later call with the same shapes on the same thread. Pass ``copy_outputs=True`` to :func:`load`
  (or ``.clone()`` them) to keep them.
- ONNX Runtime: one ``InferenceSession`` (thread-safe ``run``), by default with memory patterns
  off (:func:`default_session_options`); inputs and outputs are bound
  zero-copy with ``IOBinding`` from torch tensors by pointer and ONNX element type. That is how
  bfloat16 works (numpy has no bfloat16): no conversion happens anywhere. ONNX Runtime's CPU
  execution provider has no bfloat16 kernels for most ops, so bf16 models need the CUDA provider
  (or export in float32 for CPU use).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from qkrope.errors import InputFileNotFoundError, QkropeError
from qkrope.sidecars import EngineInfo, engine_sidecar_path
from qkrope._deps import MissingDependencyError, require

from qkrope import dtypes, quantization
from . import trt_utils as tu
from .caches import (QWEN_AXES_DIM, RopeCacheError, build_qwen_rope_caches,
                     validate_cos_sin_caches)
# The model's I/O description and its readers (moved; imported here for this module's users)
from qkrope.model_io import (ROLES, ModelIO, TensorSpec, _has, assign_roles,  # noqa: F401
                             spec_from_shape)
from .io_specs import engine_model_io, onnx_model_io  # noqa: F401

#: Output (and default-mask) buffers a thread keeps per tensor name: those of the last two
#: shapes, so that a true-CFG pipeline alternating two text lengths reuses both, while calls with
#: ever new shapes (a pipeline over many image sizes) hold a bounded amount of memory.
BUFFERS_PER_NAME = 2
#: CUDA graphs (with their static input and output buffers) a thread keeps with
#: ``cuda_graph=True``: those of the last four sets of input shapes used (a true-CFG pair at two
#: resolutions); an older set is captured again when it comes back.
GRAPHS_PER_THREAD = 4


class RunnerError(QkropeError, RuntimeError):
    """The runner cannot be created or cannot run (missing library, bad engine, failed enqueue)."""


class RunnerInputError(RunnerError, ValueError):
    """An input does not match the model. The message says received / expected / fix."""


def _torch_dtype_name(t: torch.Tensor) -> str:
    return dtypes.canonical(t.dtype)


# --------------------------------------------------------------------------------------------
# Checks (pure; run before any execution)
# --------------------------------------------------------------------------------------------

def check_inputs(io: ModelIO, feeds: Mapping[str, Any], *, device: torch.device) -> dict[str, int]:
    """Check every fed tensor against ``io``; returns the value of every named axis.

    Raises RunnerInputError naming the input, what was received, what was expected, the fix.
    """
    role_of = {v: k for k, v in io.roles.items()}
    axis_values: dict[str, tuple[int, str]] = {}
    for spec in io.inputs:
        if spec.name not in feeds or feeds[spec.name] is None:
            raise RunnerInputError(
                f"the model input {spec.name!r} ({spec.describe()}) was not given. Fix: pass it "
                f"({'as ' + role_of[spec.name] + '=' if spec.name in role_of else 'in extra_inputs='}...)")
        t = feeds[spec.name]
        label = role_of.get(spec.name, spec.name)
        if label != spec.name:
            label = f"{label} (model input {spec.name!r})"
        if not isinstance(t, torch.Tensor):
            raise RunnerInputError(f"{label} must be a torch.Tensor; got {type(t).__name__}. Fix: "
                                   f"torch.as_tensor(...)")
        if t.layout != torch.strided:
            kind = "sparse" if t.is_sparse or "sparse" in str(t.layout) else "non-strided"
            raise RunnerInputError(
                f"{label} is a {kind} tensor ({t.layout}, shape {tuple(t.shape)}); the model "
                f"takes dense tensors. Fix: pass {label.split()[0]}.to_dense()")
        if t.device != device and not (t.device.type == device.type == "cuda"
                                       and _same_cuda(t.device, device)):
            raise RunnerInputError(
                f"{label} is on {t.device} but hidden_states is on {device}; all inputs must be on "
                f"one device. Fix: {label.split()[0]}.to({str(device)!r})")
        got_dtype = _torch_dtype_name(t)
        if got_dtype != spec.dtype and role_of.get(spec.name) == "encoder_hidden_states_mask":
            raise RunnerInputError(
                f"{label} has dtype {got_dtype}; the model expects {spec.dtype} [batch, "
                f"txt_tokens]. Fix: pass mask.to(torch.{spec.dtype})"
                + (" (True = attend; for a 1/0 float mask use mask > 0)"
                   if spec.dtype == "bool" else ""))
        if got_dtype != spec.dtype:
            short = {v: k for k, v in dtypes.NAME_BY_SHORT.items()}
            other = (f" (or re-export with `qkrope export --dtype {short[got_dtype]}` for "
                     f"{got_dtype} activations)"
                     if got_dtype in short and spec.dtype in short
                     and role_of.get(spec.name) in ("hidden_states", "encoder_hidden_states")
                     else "")
            raise RunnerInputError(
                f"{label} has dtype {got_dtype}; the model expects {spec.dtype} (precision is fixed "
                f"at export). Fix: cast it to the model's dtype {spec.dtype}: "
                f"{label.split()[0]}.to(torch.{spec.dtype}){other}")
        if t.dim() != spec.rank:
            raise RunnerInputError(f"{label} has shape {tuple(t.shape)} ({t.dim()}-D); the model "
                                   f"expects {spec.rank}-D {spec.describe()}. Fix: reshape it")
        for i, (n, (lo, hi), ax) in enumerate(zip(t.shape, spec.dims, spec.axes)):
            if lo == hi and n != lo:
                what = "hidden size" if (i == spec.rank - 1 and role_of.get(spec.name) in (
                    "hidden_states", "encoder_hidden_states")) else f"dimension {i}"
                raise RunnerInputError(
                    f"{label} has shape {tuple(t.shape)}: {what} is {n}, the model's is {lo} "
                    f"(expected {spec.describe()}). Fix: feed tensors of the model this "
                    f"engine/ONNX file was exported from")
            axis = f" ({ax})" if ax else ""
            if n < 1 <= lo:
                raise RunnerInputError(
                    f"{label} has shape {tuple(t.shape)}: dimension {i}{axis} is 0, and the "
                    f"model needs at least 1 there (expected {spec.describe()}): an empty "
                    f"{ax or 'dimension'} cannot run. Fix: pass at least one "
                    f"{'batch item' if ax == 'batch' else 'element'} in dimension {i}")
            if (n < lo or (hi is not None and n > hi)) and io.profile_bounds:
                raise RunnerInputError(
                    f"{label} has shape {tuple(t.shape)}: dimension {i}{axis} = {n} is outside the "
                    f"range {lo}..{hi} this engine was built for (expected {spec.describe()}). Fix: "
                    f"rebuild with `qkrope build` and larger --max-batch/--max-img-tokens/"
                    f"--max-txt-tokens (or --min/--opt/--max shapes)")
            if n < lo or (hi is not None and n > hi):
                raise RunnerInputError(
                    f"{label} has shape {tuple(t.shape)}: dimension {i}{axis} = {n} is outside "
                    f"the model's range {lo}..{hi if hi is not None else ''} (expected "
                    f"{spec.describe()}). Fix: pass a size in that range")
            if ax is not None:
                if ax in axis_values and axis_values[ax][0] != n:
                    other_n, other = axis_values[ax]
                    raise RunnerInputError(
                        f"{ax} mismatch: {label} has {n} in dimension {i} but {other} has "
                        f"{other_n}. Fix: give all inputs the same {ax}")
                axis_values.setdefault(ax, (n, label))
        if not t.is_contiguous():
            raise RunnerInputError(f"{label} must be contiguous; got strides {t.stride()} for "
                                   f"shape {tuple(t.shape)}. Fix: pass {label.split()[0]}"
                                   f".contiguous()")
    unknown = sorted(set(feeds) - {s.name for s in io.inputs})
    if unknown:
        raise RunnerInputError(f"unknown input(s) {', '.join(unknown)}; the model's inputs are "
                               f"{', '.join(s.name for s in io.inputs)}. Fix: drop them from "
                               f"extra_inputs")
    _check_cache_rows(io, feeds)
    return {ax: v for ax, (v, _) in axis_values.items()}


# cache role -> (the activation role of the same stream, its token dimension, stream name)
_CACHE_STREAMS = {"img_cache": ("hidden_states", "image"),
                  "txt_cache": ("encoder_hidden_states", "text")}


def _check_cache_rows(io: ModelIO, feeds: Mapping[str, Any]) -> None:
    """A RoPE cache needs one row per token of its stream: rows >= tokens (whatever the path
    that put the cache in ``feeds``, and even when the model's axes are unnamed)."""
    for cache_role, (act_role, stream) in _CACHE_STREAMS.items():
        cache = feeds.get(io.roles.get(cache_role, ""))
        act = feeds.get(io.roles.get(act_role, ""))
        # only [batch, tokens, dim] activations have a token count (a 2-D tensor is a rank
        # error, reported as such by the per-input check)
        if not (isinstance(cache, torch.Tensor) and isinstance(act, torch.Tensor)
                and cache.dim() >= 1 and act.dim() == 3):
            continue
        rows, tokens = int(cache.shape[0]), int(act.shape[1])
        if rows < tokens:
            raise RunnerInputError(
                f"{cache_role} (model input {io.roles[cache_role]!r}) has {rows} rows but "
                f"{act_role} has {tokens} {stream} tokens: a RoPE cache needs one row per token. "
                f"Fix: build the cache for these sizes (qkrope.runtime.build_qwen_rope_caches or "
                f"runner.run_qwen)")


def _same_cuda(a: torch.device, b: torch.device) -> bool:
    cur = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (a.index if a.index is not None else cur) == (b.index if b.index is not None else cur)


def check_roles(hidden_states, encoder_hidden_states, mask) -> None:
    """Checks that do not depend on the model: types, ranks, batch, mask shape."""
    for name, t in (("hidden_states", hidden_states),
                    ("encoder_hidden_states", encoder_hidden_states)):
        if not isinstance(t, torch.Tensor):
            raise RunnerInputError(f"{name} must be a torch.Tensor [batch, tokens, dim]; got "
                                   f"{type(t).__name__}. Fix: torch.as_tensor({name})")
        if t.dim() != 3:
            raise RunnerInputError(f"{name} must be 3-D [batch, tokens, dim]; got shape "
                                   f"{tuple(t.shape)}. Fix: add the batch dimension "
                                   f"({name}.unsqueeze(0)) or flatten heads into dim")
    b, s_txt = encoder_hidden_states.shape[0], encoder_hidden_states.shape[1]
    if hidden_states.shape[0] != b:
        raise RunnerInputError(
            f"batch mismatch: hidden_states has batch {hidden_states.shape[0]}, "
            f"encoder_hidden_states has {b}. Fix: give both the same batch (e.g. repeat the "
            f"prompt embedding for classifier-free guidance)")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (b, s_txt):
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise RunnerInputError(
                f"encoder_hidden_states_mask must be [batch, txt_tokens] = {(b, s_txt)} (1 = "
                f"attend); got {got}. Fix: one row per batch item, one column per text token")


# --------------------------------------------------------------------------------------------
# The common runner
# --------------------------------------------------------------------------------------------

class Runner:
    """Base class: argument mapping and checks; subclasses implement :meth:`_execute`."""

    backend = "?"

    def __init__(self, io: ModelIO, *, copy_outputs: bool = False):
        self.io = io
        self.copy_outputs = copy_outputs
        self._local = threading.local()
        missing = [r for r in ("hidden_states", "encoder_hidden_states", "img_cache", "txt_cache")
                   if r not in io.roles]
        if missing:
            raise RunnerError(
                f"cannot tell which model inputs are {', '.join(missing)} (inputs: "
                f"{', '.join(s.name for s in io.inputs)}; from {io.source}). Fix: export with "
                f"`qkrope export`, whose input names the runner knows")
        if io.head_dim is None:
            raise RunnerError(f"the model's head_dim is unknown ({io.source} has no config and no "
                              f"QKNormRoPE weights). Fix: keep the sidecar JSON next to the model")

    @property
    def input_names(self) -> list[str]:
        return [s.name for s in self.io.inputs]

    @property
    def output_names(self) -> list[str]:
        return [s.name for s in self.io.outputs]

    def _buffers(self) -> dict:
        if not hasattr(self._local, "buffers"):
            self._local.buffers = {}
        return self._local.buffers

    def _kept_buffer(self, name: str, key: tuple, make) -> torch.Tensor:
        """The buffer of ``name`` for ``key`` (shape, dtype, device): reused while it is one of
        the :data:`BUFFERS_PER_NAME` keys of ``name`` used last on this thread, else made anew
        and the least recently used one dropped, so that calls with ever new shapes hold a
        bounded amount of memory."""
        kept = self._buffers().setdefault(name, OrderedDict())
        buf = kept.get(key)
        if buf is None:
            buf = kept[key] = make()
            while len(kept) > BUFFERS_PER_NAME:
                kept.popitem(last=False)
        else:
            kept.move_to_end(key)
        return buf

    def _output_buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
        """Reused per (thread, output, shape, dtype, device) among the last shapes used
        (:meth:`_kept_buffer`)."""
        return self._kept_buffer(name, (shape, dtype, device),
                                 lambda: torch.empty(shape, dtype=dtype, device=device))

    def prepare(self, hidden_states, encoder_hidden_states, image_rotary_emb,
                encoder_hidden_states_mask=None, timestep=None, *,
                extra_inputs: Mapping[str, torch.Tensor] | None = None,
                full_check: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """Validate everything and return ``(feeds by model input name, axis values)``."""
        check_roles(hidden_states, encoder_hidden_states, encoder_hidden_states_mask)
        device = hidden_states.device
        caches = validate_cos_sin_caches(
            image_rotary_emb, head_dim=self.io.head_dim, img_seq_len=hidden_states.shape[1],
            txt_seq_len=encoder_hidden_states.shape[1], device=device, full=full_check)
        self._check_device(device)
        roles = self.io.roles
        feeds: dict[str, Any] = {roles["hidden_states"]: hidden_states,
                                 roles["encoder_hidden_states"]: encoder_hidden_states,
                                 roles["img_cache"]: caches.img, roles["txt_cache"]: caches.txt}
        if encoder_hidden_states_mask is not None:
            if "encoder_hidden_states_mask" not in roles:
                raise RunnerInputError(
                    "encoder_hidden_states_mask was given but this model has no mask input (it "
                    "was exported without one, so every text token is attended). Fix: drop the "
                    "mask, or re-export with a mask input")
            feeds[roles["encoder_hidden_states_mask"]] = encoder_hidden_states_mask
        elif "encoder_hidden_states_mask" in roles:
            spec = self.io.input(roles["encoder_hidden_states_mask"])
            b, s = encoder_hidden_states.shape[:2]
            feeds[spec.name] = self._ones_mask((b, s), dtypes.torch_dtype(spec.dtype), device)
        if timestep is not None:
            if "timestep" not in roles:
                raise RunnerInputError("timestep was given but this model has no timestep input "
                                       "(an attention block takes none). Fix: drop it")
            feeds[roles["timestep"]] = timestep
        elif "timestep" in roles:
            raise RunnerInputError(f"this model needs timestep (input {roles['timestep']!r}, "
                                   f"{self.io.input(roles['timestep']).describe()}). Fix: pass "
                                   f"timestep=...")
        role_of = {v: k for k, v in roles.items()}
        for name, t in (extra_inputs or {}).items():
            if name in role_of or name in feeds:
                role = role_of.get(name)
                how = ("image_rotary_emb=(img_cache, txt_cache)" if role in ("img_cache",
                                                                              "txt_cache")
                       else f"{role}=..." if role else "its argument")
                raise RunnerInputError(
                    f"extra_inputs names {name!r}, which is the model's {role or 'input'} "
                    f"{'input ' if role else ''}and is passed (and checked) through the runner's "
                    f"own argument; extra_inputs may not replace it. Fix: pass it as {how} and "
                    f"keep extra_inputs for inputs the runner has no argument for")
            feeds[name] = t
        axes = check_inputs(self.io, feeds, device=device)
        return feeds, axes

    def _ones_mask(self, shape, dtype, device) -> torch.Tensor:
        return self._kept_buffer("__mask__", (tuple(shape), dtype, device),
                                 lambda: torch.ones(shape, dtype=dtype, device=device))

    def __call__(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                 image_rotary_emb: Any, encoder_hidden_states_mask: torch.Tensor | None = None,
                 timestep: torch.Tensor | None = None, *,
                 extra_inputs: Mapping[str, torch.Tensor] | None = None,
                 full_check: bool = False):
        """Run the model. Returns the outputs in model order: a tuple ``(img_out, txt_out)`` for an
        attention block, a single tensor for a one-output model.

        ``image_rotary_emb`` is the ``(img_cache, txt_cache)`` pair (``[rows, rotary_dim]``
        float32 on the activations' device; convert other formats with ``to_cos_sin_caches``).
        ``full_check=True`` also checks cache values (synchronises the device).
        """
        feeds, axes = self.prepare(hidden_states, encoder_hidden_states, image_rotary_emb,
                                   encoder_hidden_states_mask, timestep,
                                   extra_inputs=extra_inputs, full_check=full_check)
        outs = self._execute(feeds, axes, hidden_states.device)
        if self.copy_outputs:
            outs = [o.clone() for o in outs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def run_qwen(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, *,
                 img_shapes: Sequence[Sequence[int]], txt_len: int | None = None,
                 mask: torch.Tensor | None = None, timestep: torch.Tensor | None = None, **kw):
        """Build Qwen-Image's caches from ``img_shapes`` (latent patches, e.g. ``[(1, 64, 64)]``)
        and the text length (default: ``encoder_hidden_states.shape[1]``), memoised per shape and
        device by :func:`build_qwen_rope_caches`, then call the runner. The RoPE axes widths are
        the model's ``axes_dims_rope`` (sidecar config), Qwen-Image's (16, 56, 56) by default.
        A ``txt_len`` shorter than the text tokens is reported by the cache check (overflow)."""
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
            check_roles(hidden_states, encoder_hidden_states, None)
        txt = int(txt_len) if txt_len is not None else int(encoder_hidden_states.shape[1])
        axes_dim = tuple(self.io.config.axes_dims_rope or QWEN_AXES_DIM)
        caches = build_qwen_rope_caches(img_shapes, txt, axes_dim=axes_dim,
                                        device=hidden_states.device)
        if caches.img.shape[0] != hidden_states.shape[1]:
            raise RunnerInputError(
                f"img_shapes {list(img_shapes)} give {caches.img.shape[0]} image tokens but "
                f"hidden_states has {hidden_states.shape[1]}. Fix: pass the latent patch grid of "
                f"this batch (frames, height/2/8..., width...) so that sum(f*h*w) = tokens")
        return self(hidden_states, encoder_hidden_states, caches, mask, timestep, **kw)

    # backend hooks
    def _check_device(self, device: torch.device) -> None:
        raise NotImplementedError

    def _execute(self, feeds: dict[str, torch.Tensor], axes: dict[str, int],
                 device: torch.device) -> list[torch.Tensor]:
        raise NotImplementedError


# --------------------------------------------------------------------------------------------
# ONNX Runtime
# --------------------------------------------------------------------------------------------

def default_session_options(ort=None):
    """The ``onnxruntime.SessionOptions`` :func:`load` uses when none are given: ONNX Runtime's
    defaults except ``enable_mem_pattern = False``.

    A memory pattern is the allocation plan ONNX Runtime records for one set of input shapes and
    replays as one block from its arena; with shapes that change from call to call (a pipeline:
    two text lengths under true CFG, a new image size per request) every new set of shapes adds
    its block, so resident memory grows with the number of shapes seen (measured with
    ``scripts/memory_growth.py`` on a tiny transformer, 12 calls alternating two image sizes and
    two text lengths: peak RSS +36 % after the first four calls with patterns, +0 % without).
    The CPU arena stays on: its size is set by the largest call (flat across those 12 calls)
    and it saves an allocation per tensor."""
    ort = ort if ort is not None else require("onnxruntime", "the ONNX Runtime runner")
    so = ort.SessionOptions()
    so.enable_mem_pattern = False
    return so


def _check_providers(ort, providers, provider_options) -> None:
    """Provider names ONNX Runtime has here (it would otherwise warn and quietly run on the CPU)
    and one options dict per provider."""
    names = [p if isinstance(p, str) else (p[0] if isinstance(p, (tuple, list)) and p else p)
             for p in providers]
    available = ort.get_available_providers()
    unknown = [n for n in names if not isinstance(n, str) or n not in available]
    if unknown:
        raise RunnerError(
            f"providers {unknown} are not available in this onnxruntime ({ort.__version__}); "
            f"it has {available}. Fix: pick from those (onnxruntime-gpu for "
            f"CUDAExecutionProvider: pip install 'qkrope[cuda]')")
    if provider_options is not None:
        if not isinstance(provider_options, (list, tuple)) or len(provider_options) != len(
                names) or not all(isinstance(o, Mapping) for o in provider_options):
            raise RunnerError(
                f"provider_options must be a list of one dict per provider ({len(names)}: "
                f"{names}); got {provider_options!r}. Fix: e.g. providers=['CUDAExecutionProvider'"
                f"], provider_options=[{{'arena_extend_strategy': 'kSameAsRequested'}}]")


def ort_load_error(path: str, providers, exc: Exception, *,
                   action: str = "could not load") -> RunnerError:
    """ONNX Runtime's failure (to create a session, by default) as one line with the fix."""
    text = " ".join(str(exc).split())
    for prefix in ("[ONNXRuntimeError] :",):
        if text.startswith(prefix):
            text = text[len(prefix):].lstrip(" 0123456789:").strip()
    text = text[:400]
    if "NOT_IMPLEMENTED" in str(exc) or "Could not find an implementation" in str(exc):
        return RunnerError(
            f"ONNX Runtime ({', '.join(map(str, providers))}) has no kernel for an "
            f"op of {path} in its dtype: {text}. ONNX Runtime's CPU provider has no "
            f"bfloat16 MatMul/Gemm. Fix: use onnxruntime-gpu with "
            f"providers=['CUDAExecutionProvider'], export with --dtype fp32 for CPU use, "
            f"or build a TensorRT engine")
    if "xternal data" in text:
        fix = ("keep the model's external-data files next to it, under the names the model "
               "records (relative, inside its folder), or re-export it with `qkrope export`")
    else:
        fix = f"re-export it with `qkrope export --out {path}`"
    return RunnerError(f"ONNX Runtime {action} {path} ({type(exc).__name__}: {text}). "
                       f"Fix: {fix}")


def default_providers() -> list[str]:
    import onnxruntime as ort

    avail = ort.get_available_providers()
    return (["CUDAExecutionProvider", "CPUExecutionProvider"]
            if "CUDAExecutionProvider" in avail else ["CPUExecutionProvider"])


class OrtRunner(Runner):
    """ONNX Runtime backend (CPU or CUDA execution provider); zero-copy IOBinding."""

    backend = "onnxruntime"

    def __init__(self, path: str | os.PathLike, *, providers: Sequence | None = None,
                 session_options=None, provider_options: Sequence[Mapping] | None = None,
                 copy_outputs: bool = False):
        ort = require("onnxruntime", "the ONNX Runtime runner")
        self.path = str(path)
        # First: a readable model whose QKNormRoPE nodes keep the node contract (the plugin
        # creator would refuse what ONNX Runtime's function body would silently run), and a
        # sidecar in its schema, before ONNX Runtime sees the file.
        model = tu.checked_onnx_model(self.path)
        onnx_model_io(self.path, model=model)
        if isinstance(providers, str):
            providers = [providers]
        self.providers = list(providers) if providers else default_providers()
        _check_providers(ort, self.providers, provider_options)
        if session_options is not None and not isinstance(session_options, ort.SessionOptions):
            raise RunnerError(f"sess_options must be an onnxruntime.SessionOptions; got "
                              f"{type(session_options).__name__}. Fix: so = "
                              f"onnxruntime.SessionOptions(); so.enable_mem_pattern = False; "
                              f"load(..., sess_options=so)")
        self.session_options = (session_options if session_options is not None
                                else default_session_options(ort))
        # an FP8 (Q/DQ) export runs only with ONNX Runtime's Q/DQ fusions off
        self.session_options = quantization.ort_session_options(model, self.session_options)
        try:
            self.session = ort.InferenceSession(
                self.path, sess_options=self.session_options, providers=self.providers,
                provider_options=None if provider_options is None else [
                    dict(o) for o in provider_options])
        except Exception as exc:  # noqa: BLE001 - ONNX Runtime's Fail/InvalidGraph/... classes
            raise ort_load_error(self.path, self.providers, exc) from exc
        self.onnx_codes = dtypes.ONNX_BY_NAME
        super().__init__(onnx_model_io(self.path, self.session, model=model),
                         copy_outputs=copy_outputs)
        self._cuda_ok = "CUDAExecutionProvider" in self.session.get_providers()

    def _check_device(self, device: torch.device) -> None:
        if device.type == "cuda" and not self._cuda_ok:
            raise RunnerInputError(
                f"the inputs are on {device} but this ONNX Runtime session runs on "
                f"{self.session.get_providers()}. Fix: pass CPU tensors, or install "
                f"onnxruntime-gpu and load with providers=['CUDAExecutionProvider']")
        if device.type not in ("cpu", "cuda"):
            raise RunnerInputError(f"the inputs are on {device}; this runner takes cpu or cuda "
                                   f"tensors. Fix: move them with .to('cpu') or .to('cuda')")

    def _resolve(self, spec: TensorSpec, axes: Mapping[str, int]) -> tuple[int, ...] | None:
        shape = []
        for (lo, hi), ax in zip(spec.dims, spec.axes):
            if lo == hi:
                shape.append(lo)
            elif ax is not None and ax in axes:
                shape.append(axes[ax])
            else:
                return None
        return tuple(shape)

    def _execute(self, feeds, axes, device):
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # ORT runs on its own stream
        shapes = [self._resolve(spec, axes) for spec in self.io.outputs]
        for spec, shape in zip(self.io.outputs, shapes):
            if shape is None and spec.dtype == "bfloat16":
                # Known before anything runs: ORT would allocate the output itself, and a
                # bfloat16 OrtValue cannot be read back through numpy.
                raise RunnerError(
                    f"cannot bind the bfloat16 output {spec.name} ({spec.describe()}): its shape "
                    f"does not follow from the inputs' named axes, and ONNX Runtime's own "
                    f"bfloat16 output cannot be read back. Fix: keep the sidecar JSON (axis "
                    f"names) next to the model, or re-export it with `qkrope export`")
        binding = self.session.io_binding()
        dev_id = (device.index or 0) if device.type == "cuda" else 0
        for name, t in feeds.items():
            binding.bind_input(name, device.type, dev_id, self.onnx_codes[_torch_dtype_name(t)],
                               list(t.shape), t.data_ptr())
        outs: list[torch.Tensor | None] = []
        for spec, shape in zip(self.io.outputs, shapes):
            if shape is None:
                binding.bind_output(spec.name, device.type, dev_id)
                outs.append(None)
            else:
                buf = self._output_buffer(spec.name, shape, dtypes.torch_dtype(spec.dtype), device)
                binding.bind_output(spec.name, device.type, dev_id,
                                    self.onnx_codes[spec.dtype], list(shape), buf.data_ptr())
                outs.append(buf)
        self.session.run_with_iobinding(binding)
        if any(o is None for o in outs):
            ort_values = binding.get_outputs()
            for i, o in enumerate(outs):
                if o is None:
                    outs[i] = torch.from_numpy(ort_values[i].numpy()).to(device)
        return outs


# --------------------------------------------------------------------------------------------
# TensorRT
# --------------------------------------------------------------------------------------------

class TorchCuda:
    """The CUDA operations of :class:`TensorRTRunner` (streams, events, CUDA graphs), in one
    place so that the bookkeeping around them is tested with a stand-in where there is no GPU."""

    def new_stream(self, device):
        return torch.cuda.Stream(device=device)

    def current_stream(self, device):
        return torch.cuda.current_stream(device)

    def handle(self, stream) -> int:
        return stream.cuda_stream

    def wait(self, waiter, waited) -> None:
        waiter.wait_stream(waited)

    def record(self, tensor, stream) -> None:
        tensor.record_stream(stream)

    def stream_scope(self, stream):
        return torch.cuda.stream(stream)

    def new_graph(self):
        return torch.cuda.CUDAGraph()

    def capture(self, graph, stream):
        """Context manager: capture what is enqueued on ``stream`` into ``graph``."""
        return torch.cuda.graph(graph, stream=stream)

    def replay(self, graph, stream) -> None:
        with torch.cuda.stream(stream):
            graph.replay()


class TensorRTRunner(Runner):
    """TensorRT backend: shared engine; per thread, one CUDA stream and one execution context
    per optimisation profile (created on first use, bound to its profile with
    ``set_optimization_profile_async`` on the thread's stream). Each call runs on the first
    profile whose [min, max] holds its shapes; shapes no profile holds are refused naming the
    profiles.

    ``cuda_graph=True`` (off by default: not yet verified on a GPU in this project's CI)
    captures ``execute_async_v3`` once per (thread, profile, input shapes) into a
    ``torch.cuda.CUDAGraph`` over static input and output buffers and replays it on later calls
    with the same shapes (inputs are copied into the static buffers first). The returned
    outputs are those static buffers: overwritten by the next call with the same shapes, as
    without graphs. A thread keeps the graphs of its last :data:`GRAPHS_PER_THREAD` sets of
    shapes (memory stays bounded when shapes keep changing)."""

    backend = "tensorrt"

    def __init__(self, path: str | os.PathLike, *, plugin: str | os.PathLike | None = None,
                 copy_outputs: bool = False, verbose: bool = False, cuda_graph: bool = False):
        from .engine import import_tensorrt, load_plugin_library
        from .plugin_build import resolve_plugin_library

        # the sidecar first: a pair that does not identify itself is refused without TensorRT
        sidecar = EngineInfo.load(path) if engine_sidecar_path(path).exists() else None
        trt = import_tensorrt("the TensorRT runner (qkrope.runtime.load of an engine)")
        if not torch.cuda.is_available():
            raise MissingDependencyError(
                "the TensorRT runner needs a CUDA GPU and a CUDA build of torch; none is "
                "available here. Fix: run on a GPU machine (e.g. an NGC TensorRT container), or "
                "load the .onnx file to use ONNX Runtime")
        self.path = str(path)
        vc = bool(sidecar and sidecar.version_compatible)
        self.logger = trt.Logger(trt.Logger.VERBOSE if verbose else trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.plugin_path = None
        if vc:
            # A version-compatible engine carries its (VC) plugin library; TensorRT loads it on
            # deserialisation, which needs host code to be allowed. `plugin` is not loaded.
            self.runtime.engine_host_code_allowed = True
        else:
            # the sidecar's library unless `plugin` is given; warn if it is not the one the
            # engine was built with
            self.plugin_path = str(resolve_plugin_library(
                plugin, sidecar.plugin if sidecar else None, kind="plugin",
                check_hash="warn"))
            load_plugin_library(trt, self.plugin_path, version_compatible=False)
        data = Path(path).read_bytes()
        engine = self.runtime.deserialize_cuda_engine(data)
        if engine is None:
            side = sidecar
            raise RunnerError(
                f"TensorRT could not deserialise {path} (see its log above): it was built by "
                f"TensorRT {side.tensorrt_version if side else '?'} for "
                f"{((side.gpu if side else None) or {}).get('name', '?')}; engines only load on the "
                f"same TensorRT version and GPU (or with --version-compatible). Fix: rebuild with "
                f"`qkrope build`")
        self._setup(engine, trt, sidecar, copy_outputs=copy_outputs, cuda_graph=cuda_graph,
                    device=torch.device("cuda", torch.cuda.current_device()))

    def _setup(self, engine, trt, sidecar, *, copy_outputs: bool = False,
               cuda_graph: bool = False, device=None, cuda=None) -> None:
        """Everything after deserialisation (also how the tests make a runner over a fake
        engine and a stand-in for :class:`TorchCuda`)."""
        self.trt, self.engine, self.sidecar = trt, engine, sidecar
        if sidecar is not None:
            sidecar.check_engine_name(getattr(engine, "name", None), sidecar.source or "engine")
        Runner.__init__(self, engine_model_io(engine, trt, sidecar), copy_outputs=copy_outputs)
        self.device = device
        self.cuda = cuda if cuda is not None else TorchCuda()
        self.cuda_graph = bool(cuda_graph)
        names = set(self.input_names)
        self.profile_ranges = []
        for k in range(max(int(getattr(engine, "num_optimization_profiles", 1)), 1)):
            prof = {}
            for n in self.input_names:
                lo, _opt, hi = engine.get_tensor_profile_shape(n, k)
                prof[n] = ([int(d) for d in lo], [int(d) for d in hi])
            self.profile_ranges.append(prof)
        labels = list(sidecar.profile_labels) if sidecar is not None else []
        self.profile_labels = (labels if len(labels) == len(self.profile_ranges)
                               else [""] * len(self.profile_ranges))
        assert names == set(self.profile_ranges[0])

    def _check_device(self, device: torch.device) -> None:
        if device.type != "cuda" or not _same_cuda(device, self.device):
            raise RunnerInputError(
                f"the inputs are on {device} but the TensorRT engine runs on {self.device}. Fix: "
                f"move them with .to({str(self.device)!r}) (caches too)")

    def select_profile(self, shapes: Mapping[str, Sequence[int]]) -> int:
        """The first optimisation profile whose [min, max] holds every input shape."""
        from .profiles import ProfileError, select_profile

        try:
            return select_profile(self.profile_ranges, shapes, self.profile_labels)
        except ProfileError as exc:
            raise RunnerInputError(str(exc)) from None

    def _thread_state(self):
        loc = self._local
        if not hasattr(loc, "contexts"):
            loc.contexts = {}   # profile index -> IExecutionContext
            # (profile, input shapes) -> (graph, static inputs, outputs), least recent first
            loc.graphs = OrderedDict()
            loc.stream = self.cuda.new_stream(self.device)
        return loc

    def _context(self, st, k: int):
        ctx = st.contexts.get(k)
        if ctx is None:
            ctx = self.engine.create_execution_context()
            if ctx is None:
                raise RunnerError("TensorRT could not create an execution context (out of device "
                                  "memory?)")
            if len(self.profile_ranges) > 1 or k != 0:
                if not ctx.set_optimization_profile_async(k, self.cuda.handle(st.stream)):
                    raise RunnerError(f"TensorRT could not select optimisation profile {k} on a "
                                      f"new execution context (see its log above)")
            st.contexts[k] = ctx
        return ctx

    def _bind(self, ctx, feeds, device, k: int):
        for name, t in feeds.items():
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise RunnerInputError(f"TensorRT rejected the shape {tuple(t.shape)} for {name} "
                                       f"(profile {k})")
            ctx.set_tensor_address(name, t.data_ptr())
        outs = []
        for spec in self.io.outputs:
            shape = tuple(int(d) for d in ctx.get_tensor_shape(spec.name))
            buf = self._output_buffer(spec.name, shape, dtypes.torch_dtype(spec.dtype), device)
            ctx.set_tensor_address(spec.name, buf.data_ptr())
            outs.append(buf)
        return outs

    def _enqueue(self, ctx, st) -> None:
        if not ctx.execute_async_v3(self.cuda.handle(st.stream)):
            raise RunnerError("TensorRT's execute_async_v3 failed (see its log above)")

    def _execute(self, feeds, axes, device):
        shapes = {n: tuple(int(d) for d in t.shape) for n, t in feeds.items()}
        k = self.select_profile(shapes)
        st = self._thread_state()
        ctx = self._context(st, k)
        caller = self.cuda.current_stream(device)
        self.cuda.wait(st.stream, caller)
        if not self.cuda_graph:
            outs = self._bind(ctx, feeds, device, k)
            self._enqueue(ctx, st)
        else:
            key = (k, tuple(sorted(shapes.items())))
            entry = st.graphs.get(key)
            if entry is None:
                with self.cuda.stream_scope(st.stream):
                    static = {n: torch.empty_like(t) for n, t in feeds.items()}
                    for n, t in feeds.items():
                        static[n].copy_(t)
                outs = self._bind(ctx, static, device, k)
                # one eager run first: TensorRT finishes deferred work (shape-dependent setup)
                # outside the capture, then the enqueue is captured
                self._enqueue(ctx, st)
                graph = self.cuda.new_graph()
                with self.cuda.capture(graph, st.stream):
                    self._enqueue(ctx, st)
                st.graphs[key] = (graph, static, outs)
                while len(st.graphs) > GRAPHS_PER_THREAD:
                    st.graphs.popitem(last=False)  # its buffers go with its last reference
            else:
                st.graphs.move_to_end(key)
                graph, static, outs = entry
                with self.cuda.stream_scope(st.stream):
                    for n, t in feeds.items():
                        static[n].copy_(t)
                self.cuda.replay(graph, st.stream)
        for t in feeds.values():
            self.cuda.record(t, st.stream)
        self.cuda.wait(caller, st.stream)
        return list(outs)


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------

def load(path: str | os.PathLike, *, plugin: str | os.PathLike | None = None,
         providers: Sequence | None = None, provider_options: Sequence[Mapping] | None = None,
         sess_options=None, copy_outputs: bool = False, cuda_graph: bool = False) -> Runner:
    """Open a model for inference, chosen by the file suffix.

    - ``.engine`` / ``.plan``: TensorRT (needs TensorRT, a CUDA GPU and the QKNormRoPE plugin
      library: ``plugin``, else the path recorded in ``<engine>.json``, else the library
      ``qkrope build-plugin`` built). ``cuda_graph=True`` (off by default) replays a CUDA graph
      captured once per input shapes (see :class:`TensorRTRunner`).
    - ``.onnx``: ONNX Runtime, passed through to ``onnxruntime.InferenceSession``:
      ``providers`` (default: CUDA if onnxruntime-gpu is installed, else CPU; names ONNX Runtime
      does not have here are refused instead of its silent fall-back to the CPU),
      ``provider_options`` (one dict per provider, e.g. ``[{"arena_extend_strategy":
      "kSameAsRequested"}]`` for the CUDA provider) and ``sess_options`` (an
      ``onnxruntime.SessionOptions``, used as given). Without ``sess_options`` the session gets
      ONNX Runtime's defaults with memory patterns off (:func:`default_session_options`:
      patterns are recorded per set of input shapes, so with a pipeline's changing shapes
      resident memory grew with every new shape; off, it stays at the largest call's).
      Runs the model's QKNormRoPE function body; ``plugin`` is ignored.

    The options of the other backend are refused, never ignored. Returns a :class:`Runner`;
    see the module docstring for the thread/stream/buffer model.
    """
    p = Path(path)
    if not p.exists():
        raise InputFileNotFoundError(f"{p} does not exist. Fix: pass the .onnx file `qkrope "
                                     f"export` wrote or the .engine `qkrope build` wrote")
    suffix = p.suffix.lower()
    if suffix in (".engine", ".plan", ".trt"):
        given = [n for n, v in (("providers", providers), ("provider_options", provider_options),
                                ("sess_options", sess_options)) if v is not None]
        if given:
            raise RunnerError(f"{', '.join(given)} are ONNX Runtime options; {p} is a TensorRT "
                              f"engine. Fix: drop them (or load the .onnx file)")
        try:
            tu.check_engine_file(p)  # an ONNX model or an empty file: said before TensorRT
        except tu.NotAnEngineError as exc:
            raise RunnerError(str(exc)) from None
        return TensorRTRunner(p, plugin=plugin, copy_outputs=copy_outputs, cuda_graph=cuda_graph)
    if suffix == ".onnx":
        if cuda_graph:
            raise RunnerError(
                f"cuda_graph=True replays CUDA graphs of a TensorRT engine; {p} is an ONNX model "
                f"(ONNX Runtime). Fix: build an engine with `qkrope build {p}` and load it, or "
                f"for ONNX Runtime's own CUDA graphs pass providers=['CUDAExecutionProvider'], "
                f"provider_options=[{{'enable_cuda_graph': '1'}}]")
        return OrtRunner(p, providers=providers, session_options=sess_options,
                         provider_options=provider_options, copy_outputs=copy_outputs)
    raise RunnerError(f"cannot tell the backend of {p} from its suffix {suffix!r}: use .engine or "
                      f".plan for TensorRT, .onnx for ONNX Runtime")


__all__ = ["load", "Runner", "OrtRunner", "TensorRTRunner", "RunnerError", "RunnerInputError",
           "ModelIO", "TensorSpec", "RopeCacheError", "default_session_options",
           "BUFFERS_PER_NAME", "GRAPHS_PER_THREAD"]
