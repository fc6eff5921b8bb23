"""``qkrope check MODEL.onnx``: parity of the exported model (and a TensorRT engine) with PyTorch.
``qkrope check OUT_DIR --diffusers SRC``: every stage of a pipeline export (qkrope.apps.check_stages).

Steps:

1. Read the model and check its QKNormRoPE nodes against the node contract
   (:func:`qkrope.runtime.onnx_file.checked_onnx_model`), then read the sidecar
   (:class:`qkrope.sidecars.ModelInfo`) and generate deterministic inputs for the requested
   sizes (default: sizes *other* than the export sample, with edit images, batch 2 and a text
   mask), including the correct caches from ``build_qwen_rope_caches``.
2. Reference outputs from PyTorch: the attention block is rebuilt from the sidecar (the same
   seeded weights or the ``--weights`` file it names; the reference is the source model, so an
   ONNX file whose weights were changed fails); a transformer is diffusers' own
   ``QwenImageTransformer2DModel.forward`` (complex RoPE from ``img_shapes``) from
   ``--diffusers DIR`` (default: the folder recorded at export), truncated to the exported
   blocks, with one block's weights resident at a time (read from the shards before the block
   runs, freed after: :mod:`qkrope.apps.check_blocks`), so the check holds the model once.
   ``--blocks`` compares each block's outputs too (marked as graph outputs of the ONNX Runtime
   session) and names the first block that differs; ``--layers K`` the first K blocks only
   (the graph cut after block K-1).
   The inputs and the reference are the sidecar's family's: ``make_inputs`` builds its caches
   (a FLUX export's from the position ids its pipelines pass for the same image shapes, with
   pooled projections and guidance where the graph has them, no mask), and the family's
   reference hook (``qkrope/families/<family>/reference.py``, ``forward_kwargs``) gives the
   keyword arguments of diffusers' own forward (FLUX: those ids in place of the caches). The
   streamed, one-block-resident reference is for families whose record lists its blocks
   (``block_lists``), ``--blocks`` / ``--layers`` for those whose record has ``blocks``; the
   others' model is loaded whole.
3. polygraphy's ``Comparator.run`` over qkrope's own runners, the ones
   :func:`qkrope.runtime.load` returns (ONNX Runtime and, with ``--engine``, TensorRT with the
   plugin library), each behind a small polygraphy ``BaseRunner`` (:func:`runtime_runner`), so
   the check exercises the runner users call, its input checks included.
   ``compare_accuracy`` checks every runner against the reference (and TensorRT against ONNX
   Runtime) with the per-dtype tolerances below; a table prints max abs / max rel error per
   output, and the exit status is 1 on any mismatch.
4. Inputs and outputs are written in polygraphy's JSON formats (``inputs.json`` for
   ``--load-inputs``, ``reference_outputs.json`` for ``--load-outputs``, ``run_results.json``),
   with ``polygraphy_cmd.sh``: the ``polygraphy run`` line to redo the comparison by hand.

Tolerances (elementwise, polygraphy's rule: an element fails when its absolute error exceeds
``atol`` *and* its relative error exceeds ``rtol``). ``atol`` scales with the output: ``scale`` is
max |reference| of that output, ``ulp(scale)`` the spacing of the activation dtype there.

- fp32: atol = 1e-5 x scale, rtol = 1e-4. Both sides compute in fp32; differences come only
  from summation order in matmuls/attention (observed <= 5e-7 x scale for one block, ~1.5e-5 x
  scale through a 2-block transformer with large random weights, hence the transformer gets 1e-4).
- fp16: atol = 2 ulp(scale), rtol = 2^-9 (two fp16 ulps relative). The outputs are rounded to
  fp16 once by each side after differently ordered fp32/fp16 accumulations: one rounding step
  either way is expected (observed: 1 ulp), two is the bound; transformers get 8 ulp (errors from
  several rounded layers accumulate).
- bf16: atol = 2 ulp(scale) (1.6% of scale), rtol = 2^-6 — the same "one bf16 step from the
  split path" as sglang's fused-kernel test (atol 8e-2 at scale ~4, rtol 1e-2); transformers 8 ulp.
- A family whose model rounds its rotated q/k to a coarser dtype than the export's in every
  dtype (its record's ``qk_round_dtype``: bf16 q/k in an fp32 export) gets the tolerance of that
  dtype: the two sides' last-bit differences before that rounding flip some of its ulps, and
  the flips propagate, so the errors are of that dtype's size, not the export's.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from qkrope import families
from qkrope._deps import require
from qkrope._lazy import lazy_names
from qkrope.errors import InputError, InputFileNotFoundError, QkropeError

# qkrope.runtime and qkrope.sidecars import torch: the functions below import what they use, so
# `qkrope check --help` stays light. The names stay reachable as attributes of this module.
_LAZY = {"from_ort_value": "qkrope.runtime.inputs", "make_inputs": "qkrope.runtime.inputs",
         "to_ort_value": "qkrope.runtime.inputs", "to_torch": "qkrope.runtime.inputs",
         "check_engine_file": "qkrope.runtime.trt_utils",
         "checked_onnx_model": "qkrope.runtime.onnx_file", "ModelInfo": "qkrope.sidecars"}


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())

from . import _args
from .measure import CheckRow, format_check_table

# dtype -> (atol in ulps of the output scale or a fraction of the scale for fp32, rtol)
TOLERANCES = {
    "fp32": {"atol_scale": 1e-5, "rtol": 1e-4},
    "fp16": {"atol_ulps": 2, "rtol": 2.0 ** -9},
    "bf16": {"atol_ulps": 2, "rtol": 2.0 ** -6},
}
TRANSFORMER_FACTOR = {"fp32": 10.0, "fp16": 4.0, "bf16": 4.0}
#: The dtypes from the finest to the coarsest (mantissa bits 23, 10, 7): the order TOLERANCES
#: lists them in.
PRECISION_ORDER = tuple(TOLERANCES)
# Check sizes that differ from the export sample (edit image, odd sizes, masked text).
DEFAULT_CHECK_SAMPLE = dict(img_shapes=[(1, 6, 5), (1, 4, 4)], txt_len=11, batch=2)

TRT_MISSING = ("the TensorRT side of `qkrope check` needs TensorRT's Python bindings and a CUDA "
               "GPU")


class ParityError(QkropeError, RuntimeError):
    pass


def _spacing(v: float, dtype: str) -> float:
    """The spacing (one ulp) of ``dtype`` numbers at magnitude ``v``."""
    mant = {"fp16": 10, "bf16": 7}[dtype]
    if v <= 0:
        return 0.0
    exp = int(np.floor(np.log2(v)))
    return 2.0 ** (exp - mant)


def tolerance_dtype(dtype: str, qk_round_dtype: str | None = None) -> str:
    """The dtype whose tolerance an export of ``dtype`` is held to: the coarser of ``dtype`` and
    the dtype the model rounds its rotated q/k to in every dtype (its record's
    ``qk_round_dtype``; None: ``dtype``)."""
    if qk_round_dtype is None:
        return dtype
    return max(dtype, qk_round_dtype, key=PRECISION_ORDER.index)


def tolerances(dtype: str, reference: Mapping[str, np.ndarray], *,
               model: str = "attention",
               qk_round_dtype: str | None = None) -> dict[str, tuple[float, float]]:
    """{output: (atol, rtol)} for this dtype and these reference outputs (``qk_round_dtype``:
    see :func:`tolerance_dtype`)."""
    dtype = tolerance_dtype(dtype, qk_round_dtype)
    rule = TOLERANCES[dtype]
    factor = TRANSFORMER_FACTOR[dtype] if model == "transformer" else 1.0
    out = {}
    for name, ref in reference.items():
        scale = float(np.max(np.abs(ref.astype(np.float32)))) if ref.size else 0.0
        if "atol_scale" in rule:
            atol = rule["atol_scale"] * factor * max(scale, 1e-6)
        else:
            atol = rule["atol_ulps"] * factor * _spacing(max(scale, 1e-6), dtype)
        out[name] = (atol, rule["rtol"] * factor)
    return out


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def _named_outputs(info, sample, result) -> list:
    """The graph's outputs by name from diffusers' ``return_dict=False`` tuple: ``sample`` (its
    first, in the graph's layout) and the ones after it (a video model's audio prediction)."""
    return list(zip(info.output_names, [sample, *list(result)[1:len(info.output_names)]]))

def reference_outputs(info: ModelInfo, feeds: Mapping[str, np.ndarray],
                      img_shapes: Sequence[Sequence[int]], *,
                      diffusers_dir: str | None = None, block_names: Sequence[str] = (),
                      layers: int | None = None,
                      stats: dict | None = None) -> dict[str, np.ndarray]:
    """PyTorch outputs (float32 numpy) for the model a sidecar describes. A transformer's is
    diffusers' forward with one block's weights resident at a time
    (:class:`qkrope.apps.check_blocks.StreamedTransformer`), truncated to the exported blocks
    (``layers``: to the first ``layers``, whose outputs alone are returned); ``block_names``
    (``block<i>.img``/``.txt``) adds those block outputs; ``stats`` receives what was
    resident (``peak_block_elements``, ``block_elements``, ``blocks``, ``folder``)."""
    import torch

    from qkrope.runtime.inputs import to_torch

    t = {k: to_torch(v) for k, v in feeds.items()}
    r = {role: t[name] for role, name in info.roles().items() if name in t}
    with torch.no_grad():
        if info.model == "attention":
            from qkrope.export.onnx_export import build_attention

            module = build_attention(info)
            img, txt = module(r["hidden_states"], r["encoder_hidden_states"],
                              (r["img_cache"], r["txt_cache"]), r["encoder_hidden_states_mask"])
            return {k: v.float().numpy()
                    for k, v in zip(info.output_names, (img, txt))}
        record = _family(info)
        reference = families.hooks(record, "reference")
        kwargs = reference.forward_kwargs(info, r, img_shapes)
        if not record.block_lists:  # loaded whole: diffusers' own class for the folder
            result = _reference_transformer(info, diffusers_dir)(**kwargs)
            sample = result[0]
            if hasattr(reference, "graph_output"):  # diffusers' output in the graph's layout
                sample = reference.graph_output(info, sample, img_shapes)
            if stats is not None:
                stats.update(class_name=record.class_name,
                             folder=str(_reference_folder(info, diffusers_dir)))
            return {k: v.float().numpy() for k, v in _named_outputs(info, sample, result)}
        from qkrope.apps.check_blocks import StreamedTransformer, reference_block_outputs
        from qkrope.dtypes import TORCH_BY_SHORT

        directory = _reference_folder(info, diffusers_dir)
        n = layers or (int(info.config.num_layers_exported)
                       if info.config.num_layers_exported else None)
        model = StreamedTransformer(directory, dtype=TORCH_BY_SHORT[info.dtype], num_layers=n,
                                    class_name=record.class_name)
        result = model(**kwargs)
        sample = result[0]
        if not layers and hasattr(reference, "graph_output"):  # as above
            sample = reference.graph_output(info, sample, img_shapes)
        outs = {} if layers else dict(_named_outputs(info, sample, result))
        blocks = reference_block_outputs(model, block_names)
        if stats is not None:
            stats.update(peak_block_elements=model.peak_block_elements,
                         block_elements=max(model.block_elements), blocks=model.num_layers,
                         folder=str(directory), class_name=record.class_name)
        return {**{k: v.float().numpy() for k, v in outs.items()}, **blocks}


def _default_shapes(info: ModelInfo) -> list:
    """The default images of a check: :data:`DEFAULT_CHECK_SAMPLE`'s, as many as the model's
    family takes (``IMAGES`` of its reference hook, else of its position scheme: a model or a
    scheme of one latent grid takes one)."""
    shapes = list(DEFAULT_CHECK_SAMPLE["img_shapes"])
    if info.model != "transformer":
        return shapes
    from qkrope.runtime import schemes

    record = _family(info)
    most = getattr(families.hooks(record, "reference"), "IMAGES", None) or getattr(
        schemes.scheme(record.scheme), "IMAGES", None)
    return shapes[:most] if most else shapes


def _default_sample(info: ModelInfo) -> dict:
    """The default sizes of a check: :data:`DEFAULT_CHECK_SAMPLE`'s with
    :func:`_default_shapes`'s images, updated by the family's reference hook's ``CHECK_SAMPLE``
    and ``check_sample(info)`` (the model's own) where it has them (sizes at which diffusers'
    forward computes what one graph call does)."""
    sample = dict(DEFAULT_CHECK_SAMPLE, img_shapes=_default_shapes(info))
    if info.model == "transformer":
        hooks = families.hooks(_family(info), "reference")
        sample.update(getattr(hooks, "CHECK_SAMPLE", {}))
        if hasattr(hooks, "check_sample"):
            sample.update(hooks.check_sample(info))
    return sample


def _family(info: ModelInfo):
    """The family record of a transformer export's sidecar (an old sidecar without one: the
    registry's first family, the only one qkrope exported then)."""
    return families.by_name(info.config.family, source=f"the sidecar {info.source}")


def _reference_folder(info: ModelInfo, diffusers_dir: str | None) -> str:
    """The folder of a transformer export's source model (the one given, else the one recorded
    at export); a folder of another family than the sidecar's is refused in one line, from its
    config.json before any weight is read."""
    from qkrope.diffusers_weights import folder_family

    directory = diffusers_dir or info.config.diffusers_dir
    if not directory:
        raise ParityError("the transformer's reference needs --diffusers DIR")
    family = _family(info)
    found = folder_family(str(directory))
    if found is not family:
        raise ParityError(f"the reference folder {directory} holds a {found.label} model, but "
                          f"the model checked is a {family.label} export (sidecar "
                          f"{info.source}). Fix: pass --diffusers with the folder it was "
                          f"exported from")
    from qkrope.diffusers_weights import check_reference_config

    check_reference_config(directory, info.config.diffusers_config, source=str(info.source))
    return str(directory)


def _reference_transformer(info: ModelInfo, diffusers_dir: str | None):
    """The source model of a transformer export (:func:`_reference_folder`): diffusers' own
    class for the folder, in the export's dtype."""
    from qkrope.dtypes import TORCH_BY_SHORT
    from qkrope.export.patch_diffusers import load_transformer

    return load_transformer(_reference_folder(info, diffusers_dir),
                            dtype=TORCH_BY_SHORT[info.dtype])


# --------------------------------------------------------------------------------------------
# Runners
# --------------------------------------------------------------------------------------------

def make_ort_runner(onnx_path: str, providers: Sequence[str] = ("cpu",)):
    """The ONNX Runtime side: qkrope's own runner (:func:`qkrope.runtime.load` of the .onnx file,
    bfloat16 bound zero-copy) behind polygraphy's runner interface (:func:`runtime_runner`)."""
    from qkrope import runtime

    return runtime_runner(runtime.load(onnx_path, providers=[_ort_provider(p) for p in providers]),
                          name="onnxrt-runner")


def runtime_runner(runner, *, name: str):
    """A polygraphy ``BaseRunner`` over a qkrope runner (what :func:`qkrope.runtime.load`
    returns), so that ``Comparator.run`` checks the runner users call, its input checks
    included. Feeds arrive by model input name (numpy; bfloat16 as ml_dtypes) and are passed as
    the runner's arguments by role (the caches as ``image_rotary_emb``) on the runner's device;
    outputs come back as float32 numpy by output name."""
    from ._polygraphy import comparator_runner

    def infer(feed_dict):
        import torch

        from qkrope.runtime.inputs import from_torch, to_torch
        from qkrope.runtime.runner import CONDITIONING_ROLES

        device = runner.device
        feeds = {k: to_torch(np.asarray(v)).to(device) for k, v in feed_dict.items()}
        roles = runner.io.roles
        hs, ehs, img, txt, mask, timestep = (
            feeds.pop(roles[r]) if r in roles else None
            for r in ("hidden_states", "encoder_hidden_states", "img_cache", "txt_cache",
                      "encoder_hidden_states_mask", "timestep"))
        conditioning = {r: feeds.pop(roles[r]) for r in CONDITIONING_ROLES if r in roles}
        if txt is None and img is not None:  # a model that rotates no text: identity rows
            from qkrope.runtime.schemes import identity_rows

            txt = torch.from_numpy(identity_rows(ehs.shape[1], img.shape[1])).to(device)
        outs = runner(hs, ehs, (img, txt), mask, timestep, extra_inputs=feeds or None,
                      conditioning=conditioning or None)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return {out: from_torch(t).astype(np.float32)
                for out, t in zip(runner.output_names, outs)}

    inputs = [(spec.name, spec.dtype, [lo if lo == hi else -1 for lo, hi in spec.dims])
              for spec in runner.io.inputs]
    adapter = comparator_runner(name, "qkrope-runtime-runner", inputs, infer)
    adapter.runner = runner  # the runner it calls, for whoever holds the adapter
    return adapter


def _ort_provider(name: str) -> str:
    return {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
            "trt": "TensorrtExecutionProvider"}.get(name.lower(), name)


def validate_arguments(onnx_path: str, *, engine: str | None, plugin: str | None,
                       onnxrt: bool) -> None:
    """Every check on the arguments that needs no computation, before anything runs."""
    if not os.path.isfile(onnx_path):
        raise InputFileNotFoundError(f"{onnx_path!r} does not exist: export it with `qkrope export`")
    if not onnxrt and not engine:
        raise InputError("--no-onnxrt leaves nothing to check: give --engine/--plugin as well")
    if engine and not os.path.isfile(engine):
        raise InputFileNotFoundError(f"--engine {engine!r} does not exist: build it with "
                                f"`qkrope build`")
    if engine:
        from qkrope.runtime.trt_utils import check_engine_file

        check_engine_file(engine)  # an ONNX model or an empty file is not an engine
    if plugin and not os.path.isfile(plugin):
        raise InputFileNotFoundError(f"--plugin {plugin!r} does not exist: build it with `qkrope "
                                f"build-plugin`")


def make_trt_runner(engine_path: str, plugin: str | None, *, allow_host_code: bool = False):
    """The TensorRT side: qkrope's own runner (:func:`qkrope.runtime.load` of the engine, which
    loads the plugin library with :func:`qkrope.runtime.loader_tensorrt.load_plugin_library`:
    dlopen, then the QKNormRoPE creator must be in TensorRT's registry) behind polygraphy's
    runner interface (:func:`runtime_runner`)."""
    if not os.path.isfile(engine_path):
        raise InputFileNotFoundError(f"--engine {engine_path!r} does not exist: build it with "
                                f"`qkrope build`")
    require("tensorrt", TRT_MISSING)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        has_cuda = False
    if not has_cuda:
        raise ParityError(f"{TRT_MISSING}, and no CUDA GPU is visible. Run it on a machine with "
                          f"a GPU and TensorRT (for example an NGC TensorRT container, "
                          f"nvcr.io/nvidia/tensorrt), or drop --engine for the ONNX Runtime check")
    from qkrope import runtime

    return runtime_runner(runtime.load(engine_path, plugin=plugin,
                                       allow_host_code=allow_host_code), name="trt-runner")


# --------------------------------------------------------------------------------------------
# The check
# --------------------------------------------------------------------------------------------


def compare_arrays(name: str, got: np.ndarray, ref: np.ndarray, atol: float, rtol: float,
                   runner: str = "onnxrt", against: str = "pytorch") -> CheckRow:
    got = np.asarray(got, dtype=np.float32)
    ref = np.asarray(ref, dtype=np.float32)
    if got.shape != ref.shape:
        return CheckRow(runner, against, name, float("inf"), float("inf"), atol, rtol, False)
    absdiff = np.abs(got - ref)
    with np.errstate(divide="ignore", invalid="ignore"):
        reldiff = absdiff / np.abs(ref)
    bad = ((absdiff > atol) | np.isnan(absdiff)) & ((reldiff > rtol) | np.isnan(reldiff))
    finite_rel = reldiff[np.isfinite(reldiff)]
    return CheckRow(runner, against, name, float(absdiff.max()) if absdiff.size else 0.0,
               float(finite_rel.max()) if finite_rel.size else 0.0, atol, rtol,
               not bool(bad.any()))


def _f32(outputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    out = {}
    for k, v in outputs.items():
        if hasattr(v, "detach"):  # a torch tensor (an output of some other runner)
            v = v.detach().float().cpu().numpy()
        out[k] = np.asarray(v).astype(np.float32)
    return out


def _json_feed(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Inputs for polygraphy's JSON (bfloat16 widened to float32: lossless; polygraphy has no
    bfloat16 numpy type)."""
    return {k: (v.astype(np.float32) if v.dtype.name == "bfloat16" else v)
            for k, v in feeds.items()}


#: what qkrope check writes into --workdir
WORKDIR_FILES = ("inputs.json", "reference_outputs.json", "run_results.json",
                 "polygraphy_cmd.sh")


def _check_workdir(workdir, onnx_path: str, engine, plugin, reference) -> None:
    """--workdir's files are none of what check reads (the model, its sidecar and data, the
    engine, the plugin, every file of the reference folder, whatever its name)."""
    from qkrope._fileio import check_not_inputs
    from qkrope.runtime.state_dict import model_folder_files

    inputs = [onnx_path, onnx_path + ".json", onnx_path + ".data", engine,
              engine and engine + ".json", plugin,
              *(model_folder_files(reference) if reference else [])]
    check_not_inputs([Path(workdir) / n for n in WORKDIR_FILES], inputs, flag="--workdir")


def polygraphy_command(onnx_path: str, workdir: Path, tol: Mapping[str, tuple[float, float]], *,
                       engine: str | None = None, plugin: str | None = None) -> str:
    atol = " ".join(f"{k}:{v[0]:.6g}" for k, v in tol.items())
    rtol = " ".join(f"{k}:{v[1]:.6g}" for k, v in tol.items())
    model = [engine, "--model-type", "engine", "--trt"] if engine else [onnx_path, "--onnxrt"]
    parts = ["polygraphy", "run", *model]
    if engine and plugin:
        parts += ["--plugins", plugin]
    parts += ["--load-inputs", str(workdir / "inputs.json"),
              "--load-outputs", str(workdir / "reference_outputs.json")]
    return shlex.join(parts) + f" --atol {atol} --rtol {rtol} --check-error-stat elemwise"


def check_model(onnx_path: str | os.PathLike, *, img_shapes=None, txt_len=None, batch=None,
                seed: int = 0, diffusers_dir: str | None = None, engine: str | None = None,
                plugin: str | None = None, providers: Sequence[str] = ("cpu",),
                workdir: str | os.PathLike | None = None, out=None,
                verbose: bool = False, onnxrt: bool = True, blocks: bool = False,
                layers: int | None = None,
                allow_host_code: bool = False) -> tuple[bool, list[CheckRow]]:
    """Run the parity check; returns (passed, rows). See the module docstring. ``blocks``:
    compare every block's outputs too; ``layers``: the first ``layers`` blocks only;
    ``allow_host_code``: run the host code a version-compatible ``engine`` carries (refused
    otherwise, as :func:`qkrope.runtime.load` does)."""
    from polygraphy.logger import G_LOGGER

    out = out if out is not None else sys.stdout
    with G_LOGGER.verbosity(G_LOGGER.INFO if verbose else G_LOGGER.ERROR):
        return _check_model(onnx_path, img_shapes=img_shapes, txt_len=txt_len, batch=batch,
                            seed=seed, diffusers_dir=diffusers_dir, engine=engine, plugin=plugin,
                            providers=providers, workdir=workdir, out=out, onnxrt=onnxrt,
                            blocks=blocks, layers=layers, allow_host_code=allow_host_code)


def _check_block_arguments(onnx_path: str, info, *, blocks: bool, layers: int | None,
                           engine: str | None, onnxrt: bool) -> None:
    """``--blocks`` / ``--layers`` against the model, before any work: a transformer of a
    family whose record has ``blocks``, a float export, ONNX Runtime, 1 <= K <= its blocks."""
    if not blocks and layers is None:
        return
    flag = "--layers" if layers is not None else "--blocks"
    if info.model != "transformer":
        raise InputError(f"{flag} compares the blocks of a whole transformer; {onnx_path} is "
                         f"an {info.model} model. Fix: drop {flag}")
    families.check_blocks_option(_family(info), flag,
                                 why=f"export ({onnx_path}) is checked as a whole")
    if info.config.quantization:
        raise InputError(f"{flag} compares a float export's blocks; {onnx_path} is an FP8 "
                         f"export, checked as a whole against ModelOpt's model. Fix: drop "
                         f"{flag}")
    if not onnxrt:
        raise InputError(f"{flag} compares ONNX Runtime's block outputs: drop --no-onnxrt")
    if layers is not None:
        exported = int(info.config.num_layers_exported or 0)
        if layers < 1 or (exported and layers > exported):
            raise InputError(f"--layers {layers}: {onnx_path} has {exported} blocks; pass 1 to "
                             f"{exported}")
        if engine:
            raise InputError("--layers compares a prefix of the blocks on ONNX Runtime; the "
                             "engine runs the whole model. Fix: drop --engine (or use --blocks)")


def _refuse_bf16_on_cpu(onnx_path: str, providers: Sequence[str], onnxrt: bool) -> None:
    """A bf16 export compared on ONNX Runtime's CPU provider alone is refused from its sidecar
    (a stat check, no hashing, no session), before any work: the CPU provider has no bfloat16
    MatMul kernel (onnxruntime 1.2x/1.3x), so the session would fail only after the model was
    hashed and loaded (at the real width: a minute and gigabytes)."""
    from qkrope.sidecars import ModelInfo

    if not onnxrt or [str(p).lower() for p in providers] != ["cpu"]:
        return
    info = ModelInfo.load(onnx_path, full=False)
    if info.dtype == "bf16" and not info.config.quantization:
        raise InputError(
            f"{onnx_path} is a bf16 export, and ONNX Runtime's CPU provider (the only one "
            f"asked for) has no bfloat16 MatMul kernel, so nothing was run. Fix: --providers "
            f"cuda (onnxruntime-gpu), or --engine E.engine --plugin LIB --no-onnxrt (TensorRT "
            f"against PyTorch), or check an fp32 export of the same folder (--dtype fp32)")


def _check_model(onnx_path, *, img_shapes, txt_len, batch, seed, diffusers_dir, engine, plugin,
                 providers, workdir, out, onnxrt, blocks=False, layers=None,
                 allow_host_code=False):
    from polygraphy.comparator import Comparator

    try:  # present in polygraphy 0.53; CompareFunc.simple is deprecated (removed in 0.60)
        from polygraphy.comparator.compare import SimpleCompareFunc
    except ImportError:  # pragma: no cover - older polygraphy
        from polygraphy.comparator import CompareFunc

        SimpleCompareFunc = CompareFunc.simple
    from polygraphy.comparator.struct import IterationResult, RunResults
    from polygraphy.json import save_json

    from qkrope.runtime.inputs import make_inputs
    from qkrope.runtime.onnx_file import checked_onnx_model
    from qkrope.sidecars import ModelInfo

    onnx_path = str(onnx_path)
    engine = str(engine) if engine else None
    plugin = str(plugin) if plugin else None
    validate_arguments(onnx_path, engine=engine, plugin=plugin, onnxrt=onnxrt)
    # First: a readable ONNX file whose QKNormRoPE nodes keep the node contract (the TensorRT
    # plugin would refuse what ONNX Runtime's function body would run), then its sidecar.
    checked_onnx_model(onnx_path)
    _refuse_bf16_on_cpu(onnx_path, providers, onnxrt)
    # the full hash of every file (a load checks their stat records only: qkrope.file_record)
    info = ModelInfo.load(onnx_path, full=True)
    _check_workdir(workdir or onnx_path + ".check", onnx_path, engine, plugin,
                   diffusers_dir or info.config.diffusers_dir)  # before the work
    engine_hashed = False
    if engine:
        from qkrope.sidecars import EngineInfo, engine_sidecar_path

        if engine_sidecar_path(engine).is_file():
            from qkrope.runtime.loader_tensorrt import check_host_code

            engine_info = EngineInfo.load(engine, full=True)
            engine_hashed = engine_info.verified == "sha256"
            check_host_code(engine_info, engine, allow_host_code)  # before any work
    # every option against the model before any work (an FP8 export too: issue 34)
    _check_block_arguments(onnx_path, info, blocks=blocks, layers=layers, engine=engine,
                           onnxrt=onnxrt)
    if info.config.quantization:  # FP8 Q/DQ: checked against ModelOpt's model
        return _check_quantized(onnx_path, info, img_shapes=img_shapes, txt_len=txt_len,
                                batch=batch, seed=seed, diffusers_dir=diffusers_dir,
                                engine=engine, providers=providers, out=out)
    # Runners first: a missing TensorRT/GPU or a wrong plugin fails before the reference runs.
    block_names: list[str] = []
    offsets = None
    if blocks or layers is not None:
        # ONNX Runtime over the graph with each block's outputs marked (cut after --layers K):
        # one session, the model's weights once (qkrope.apps.check_blocks)
        from qkrope.apps import check_blocks as cb

        record, config = _family(info), info.config.diffusers_config
        offsets = (cb.block_offsets(record.block_lists, config)
                   if record.block_lists and isinstance(config, dict) else None)
        marked, block_names = cb.marked_model(
            onnx_path, num_blocks=int(info.config.num_layers_exported or 0), layers=layers,
            offsets=offsets, unread=(cb.unread_blocks(record.block_lists, config)
                                     if offsets is not None else frozenset()))
        session = cb.ort_block_session(onnx_path, marked,
                                       [_ort_provider(p) for p in providers])
        del marked
        runners = [cb.ort_block_runner(session, info, name="onnxrt-runner")]
    else:
        runners = [make_ort_runner(onnx_path, providers)] if onnxrt else []
    if engine:
        runners.append(make_trt_runner(engine, plugin, allow_host_code=allow_host_code))
    defaults = _default_sample(info)
    img_shapes = img_shapes or defaults["img_shapes"]
    txt_len = txt_len or defaults["txt_len"]
    batch = batch or defaults["batch"]
    feeds = make_inputs(info, img_shapes, txt_len, batch, seed=seed)
    stats: dict = {}
    reference = reference_outputs(info, feeds, img_shapes, diffusers_dir=diffusers_dir,
                                  block_names=block_names, layers=layers, stats=stats)
    qk_round = _family(info).qk_round_dtype if info.model == "transformer" else None
    tol_dtype = tolerance_dtype(info.dtype, qk_round)
    tol = tolerances(info.dtype, reference, model=info.model, qk_round_dtype=qk_round)
    compared = ([] if layers else list(info.output_names)) + block_names
    results = Comparator.run(runners, data_loader=[feeds])
    converted = RunResults()
    for name, iterations in results:
        converted.append((name, [IterationResult(_f32(it), runner_name=name)
                                 for it in iterations]))
    converted.append(("pytorch", [IterationResult(reference, runner_name="pytorch")]))

    workdir = Path(workdir) if workdir else Path(onnx_path + ".check")
    workdir.mkdir(parents=True, exist_ok=True)
    save_json([_json_feed(feeds)], str(workdir / "inputs.json"))
    ref_results = RunResults()
    ref_results.append(("pytorch", [IterationResult(reference, runner_name="pytorch")]))
    ref_results.save(str(workdir / "reference_outputs.json"))
    converted.save(str(workdir / "run_results.json"))
    finals = {k: v for k, v in tol.items() if k in info.output_names}
    cmd = polygraphy_command(onnx_path, workdir, finals, engine=engine, plugin=plugin)
    if finals:  # (the block outputs are not outputs of the model polygraphy run loads)
        (workdir / "polygraphy_cmd.sh").write_text("#!/bin/sh\n" + cmd + "\n")
    else:  # --layers: nothing polygraphy run could redo; no stale script of an earlier check
        (workdir / "polygraphy_cmd.sh").unlink(missing_ok=True)

    compare = SimpleCompareFunc(atol={k: v[0] for k, v in tol.items()},
                                 rtol={k: v[1] for k, v in tol.items()},
                                 check_error_stat="elemwise")
    pairs = [(i, len(converted) - 1) for i in range(len(converted) - 1)]
    if engine and onnxrt:
        pairs.append((1, 0))  # TensorRT vs ONNX Runtime
    accuracy = Comparator.compare_accuracy(converted, compare_func=compare,
                                           comparisons=pairs)
    rows = []
    short = {"onnxrt-runner": "onnxrt", "trt-runner": "tensorrt", "pytorch": "pytorch"}
    for a, b in pairs:
        name_a, name_b = converted[a][0], converted[b][0]
        ref_out, got_out = converted[b][1][0], converted[a][1][0]
        for output in compared:
            if output not in ref_out or output not in got_out:
                continue  # a block output: ONNX Runtime's and the reference's only
            atol, rtol = tol[output]
            rows.append(compare_arrays(output, got_out[output], ref_out[output], atol,
                                       rtol, short.get(name_a, name_a), short.get(name_b, name_b)))
    passed = bool(accuracy) and all(r.passed for r in rows)
    print(f"qkrope check: {onnx_path} ({info.model}, {info.dtype}); inputs: img_shapes "
          f"{[list(s) for s in img_shapes]}, {txt_len} text tokens, batch {batch}, seed {seed}",
          file=out)
    if info.verified == "sha256":
        data = len(info.external_data)
        print(f"files: {Path(onnx_path).name}"
              f"{f' and its {data} external data file(s)' if data else ''} hashed in full: "
              f"they are what its sidecar records (sha256)"
              + (", and so is the engine" if engine_hashed else ""),
              file=out)
    print(f"compared: {_what_compared(info, block_names, layers, stats)}", file=out)
    print(format_check_table(rows), file=out)
    if block_names:
        from qkrope.apps.check_blocks import block_module as cb_module
        from qkrope.apps.check_blocks import first_failing_block

        bad = first_failing_block(rows)
        if bad is not None:
            print(f"first block that differs: block {bad} ({cb_module(bad, offsets)}; "
                  f"{'blocks 0-' + str(bad - 1) + ' agree' if bad else 'the first block'})",
                  file=out)
    rerun = (f"rerun the model outputs by hand: sh {workdir / 'polygraphy_cmd.sh'}" if finals
             else "(--layers: no model output to rerun with polygraphy run)")
    print(f"polygraphy inputs/outputs: {workdir}/; {rerun}", file=out)
    print(f"qkrope check: {'PASSED' if passed else 'FAILED: outputs differ from the PyTorch reference beyond the ' + tol_dtype + ' tolerance'}",
          file=out)
    return passed, rows


def _what_compared(info, block_names: Sequence[str], layers: int | None,
                   stats: Mapping[str, Any]) -> str:
    """One line for the output: which tensors, and how the reference held its weights."""
    n_blocks = len({name.split(".")[0] for name in block_names})
    parts = []
    if not layers:
        parts.append(f"the model output{'s' if len(info.output_names) > 1 else ''} "
                     f"{', '.join(info.output_names)}")
    if block_names:
        parts.append(f"the image/text outputs of "
                     f"{'block 0' if n_blocks == 1 else f'blocks 0-{n_blocks - 1}'}"
                     + (f" (--layers {layers}: the graph cut after block {layers - 1})"
                        if layers else ""))
    what = " and ".join(parts)
    if info.model != "transformer" or not stats:
        return what + " against the PyTorch attention block rebuilt from the sidecar"
    if "blocks" not in stats:
        return (f"{what} against diffusers' {stats['class_name']}.forward, the model of "
                f"{stats['folder']} loaded whole")
    return (f"{what} against diffusers' {stats['class_name']}.forward over "
            f"{stats['blocks']} block(s), each block's weights read from {stats['folder']} "
            f"just before it ran and freed after (at most "
            f"{stats['peak_block_elements'] / 1e6:.2f} M block parameters resident, one block "
            f"of {stats['block_elements'] / 1e6:.2f} M)")


def _check_quantized(onnx_path, info, *, img_shapes, txt_len, batch, seed, diffusers_dir,
                     engine, providers, out):
    from qkrope.apps.check_fp8 import check_fp8

    if engine or list(providers) != ["cpu"]:
        raise InputError(f"{onnx_path} is an FP8 export: qkrope check compares it on ONNX "
                         f"Runtime's CPU provider with ModelOpt's fake-quant model only (no "
                         f"--engine/--providers yet); check the engine with polygraphy run "
                         f"--trt against this model")
    defaults = _default_sample(info)
    report = check_fp8(onnx_path, img_shapes=img_shapes or defaults["img_shapes"],
                       txt_len=txt_len or defaults["txt_len"],
                       batch=batch or defaults["batch"], seed=seed,
                       diffusers_dir=diffusers_dir, out=out)
    return report.passed, []


def _blocks_families() -> str:
    """The families whose record has ``blocks`` (for the help of --blocks / --layers)."""
    return _args.or_list(r.short for r in families.records() if r.blocks)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "check",
        description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("onnx", metavar="MODEL.onnx|OUT_DIR",
                   help="an exported model, or a pipeline export folder (qkrope export --model "
                        "pipeline -o OUT_DIR): then every stage is checked against the PyTorch "
                        "components of --diffusers SRC (the transformer as a model is; each text "
                        "encoder at two token lengths, an image encoder at two batches and the "
                        "VAE at two latent sizes, on their drop-ins; engines that qkrope build OUT_DIR wrote beside the graphs "
                        "too, where TensorRT and a CUDA GPU are present)")
    p.add_argument("--stage", metavar="NAME", default=None,
                   help="OUT_DIR: check this stage only (a component name: transformer, "
                        "text_encoder, vae, ...)")
    _args.add_engine(p, "also run it and compare it with PyTorch (needs --plugin)")
    _args.add_plugin(p, "needed with --engine")
    _args.add_allow_host_code(p, "with --engine: ")
    p.add_argument("--img-shape", nargs=3, type=int, action="append", metavar=("F", "H", "W"),
                   help="an image of F x H x W latent patches (repeat it: the first is the "
                        "output image, the others the edit, condition or reference images of "
                        "the model's family, laid out as its pipelines do). Default: 1 6 5 and "
                        "1 4 4 (as many as the family takes, or its own)")
    p.add_argument("--txt-len", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--diffusers", default=None, help="transformer reference folder (default: "
                                                      "the one recorded at export); with OUT_DIR "
                                                      "(required): the saved diffusers pipeline "
                                                      "folder it was exported from")
    p.add_argument("--providers", nargs="+", default=["cpu"],
                   help="ONNX Runtime execution providers (cpu, cuda)")
    p.add_argument("--no-onnxrt", dest="onnxrt", action="store_false",
                   help="with --engine: compare TensorRT with PyTorch only (e.g. a bf16 model "
                        "where ONNX Runtime has only its CPU provider, which lacks bf16 MatMul)")
    p.add_argument("--blocks", action="store_true",
                   help=f"transformer ({_blocks_families()} float exports): compare every "
                        "block's image and text outputs too (ONNX "
                        "Runtime's, with those tensors marked as graph outputs, against the "
                        "reference's), and name the first block that differs")
    p.add_argument("--layers", type=int, default=None, metavar="K",
                   help=f"transformer ({_blocks_families()} float exports): compare the "
                        "outputs of the first K blocks only: ONNX "
                        "Runtime runs the graph cut after block K-1 (only those blocks' weights "
                        "read) and the reference K blocks; the way to check a big export on a "
                        "small machine. Either way the reference holds one block's weights at "
                        "a time")
    p.add_argument("--workdir", default=None, help="where the polygraphy JSON files go "
                                                   "(default: MODEL.onnx.check/, or "
                                                   "OUT_DIR.check/ with one folder per stage)")
    p.add_argument("--verbose", "-v", action="store_true", help="polygraphy's own log too")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from qkrope import _preflight as pre

    if os.path.isdir(args.onnx):  # a pipeline export folder: every stage
        import importlib

        # by name, as qkrope.cli finds the commands: check_stages builds on this module
        return importlib.import_module("qkrope.apps.check_stages").run(args)
    if getattr(args, "stage", None):
        raise InputError(f"--stage {args.stage} picks a stage of a pipeline export folder; "
                         f"{args.onnx} is one model. Fix: drop --stage, or pass OUT_DIR")
    if args.engine and not args.plugin:
        raise InputError("--engine needs --plugin LIB (the QKNormRoPE plugin library)")
    pre.onnx_model(args.onnx, command="check")
    _args.check_engine(args, "check")
    _args.check_plugin(args)
    pre.input_dir(args.diffusers, flag="--diffusers",
                  fix="pass the folder of the saved diffusers transformer the model came from")
    try:
        passed, _ = check_model(args.onnx, img_shapes=args.img_shape, txt_len=args.txt_len,
                                batch=args.batch, seed=args.seed, diffusers_dir=args.diffusers,
                                engine=args.engine, plugin=args.plugin, providers=args.providers,
                                workdir=args.workdir, verbose=args.verbose, onnxrt=args.onnxrt,
                                blocks=args.blocks, layers=args.layers,
                                allow_host_code=args.allow_host_code)
    except Exception as exc:  # ORT without bf16 kernels and the like: say what to do
        if "NOT_IMPLEMENTED" in str(exc):
            raise ParityError(
                f"ONNX Runtime's {'/'.join(args.providers)} provider cannot run this model "
                f"({str(exc).splitlines()[0][:200]}). bfloat16 MatMul has no CPU kernel in ONNX "
                f"Runtime: check bf16 models with --providers cuda (onnxruntime-gpu), or with "
                f"--engine/--plugin --no-onnxrt (TensorRT vs PyTorch)") from None
        if type(exc).__module__.startswith("onnxruntime"):  # its Fail, InvalidGraph, ...
            from qkrope.runtime.loader_onnxrt import ort_load_error

            raise ParityError(str(ort_load_error(args.onnx, args.providers, exc,
                                                 action="failed on"))) from None
        raise
    return 0 if passed else 1
