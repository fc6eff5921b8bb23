"""FP8 quantisation of a diffusers transformer with NVIDIA ModelOpt, and its ONNX form.

Workflow (README, section FP8):

1. **Record calibration inputs where the real model runs**: wrap the pipeline's transformer in
   :class:`CalibrationRecorder` and generate a few images with your own prompts; every call of the
   transformer's ``forward`` is recorded (tensors copied to the CPU) and
   :meth:`CalibrationRecorder.save` writes them to one file (``torch.save``; loaded back with
   ``weights_only=True``)::

       with CalibrationRecorder(pipe.transformer, max_calls=64) as rec:
           for prompt in prompts:
               pipe(prompt, num_inference_steps=30)
       rec.save("calib.pt")

2. **Calibrate**: ``qkrope quantize --diffusers DIR --calibration calib.pt --out QDIR`` (or
   :func:`calibrate` + :func:`save_quantized`) runs ``mtq.quantize`` with per-tensor FP8 (e4m3)
   weights and inputs, max calibration, on the layers :func:`fp8_config` selects (TensorRT's
   diffusion demo selection: every ``nn.Linear`` except the embedders ``img_in``/``txt_in``/
   ``time_text_embed`` (the demo's ``x_embedder``/``context_embedder``/``time_text_embed``),
   ``norm_out`` and ``proj_out``; each family's equivalents by their names, its record's
   ``fp8_excluded``: :func:`qkrope.quantization.default_excluded`). QDIR is a diffusers folder: ``save_pretrained`` (weights plus
   the quantizers' ``_amax`` buffers) and ModelOpt's ``modelopt_state.pth``
   (``mto.modelopt_state``), the layout ModelOpt's own Hugging Face checkpointing writes.

3. **Export**: ``qkrope export --model transformer --diffusers QDIR --quant fp8`` traces the float
   graph as usual (QKNormRoPE nodes intact), then :func:`apply_fp8` puts ONNX Q/DQ where ModelOpt
   fake-quantises: each quantised Linear's input goes through ``QuantizeLinear`` ->
   ``DequantizeLinear`` (float8e4m3fn, its calibrated scale as a constant) and its weight is stored
   as float8e4m3fn values behind a ``DequantizeLinear``. This is the explicit-quantisation form
   TensorRT builds FP8 GEMMs from (strongly typed network, no precision flags).

ModelOpt (``nvidia-modelopt``, the ``qkrope[fp8]`` extra) is imported only here and only when
used. Its FP8 fake quantisation of a tensor ``x`` with calibrated ``amax`` is
``fp8(clamp(x * (448 / amax))) * (1 / (448 / amax))`` in float32; the export stores exactly those
FP8 weight values and that dequantisation scale (:func:`fp8_scale`), so each weight's
``DequantizeLinear`` output equals ModelOpt's fake-quantised weight bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from qkrope import families, quantization
from qkrope._deps import require
from qkrope.errors import InputError, InputFileNotFoundError, QkropeError
from qkrope.weight_values import WeightValueError, amax_problem, nonfinite

DEFAULT_EXCLUDED = families.default().fp8_excluded  # the default of --exclude (this API)
CALIBRATION_FORMAT = "qkrope-calibration"


class QuantizeError(QkropeError, RuntimeError):
    """Calibration, restore or the FP8 graph rewrite failed."""


def _modelopt():
    """(mtq, mto): ModelOpt's quantisation and opt packages, imported lazily."""
    with warnings.catch_warnings():  # its import warns about untested transformers versions
        warnings.simplefilter("ignore")
        mtq = require("modelopt.torch.quantization", "FP8 quantisation (ModelOpt)")
        mto = require("modelopt.torch.opt", "FP8 quantisation (ModelOpt)")
    return mtq, mto


@contextlib.contextmanager
def _quiet():
    """ModelOpt prints a line per conversion ("Inserted 130 quantizers") on stdout, which is the
    CLI's output (written paths); it is sent to stderr instead."""
    import sys

    with contextlib.redirect_stdout(sys.stderr):
        yield


# --------------------------------------------------------------------------------------------
# Calibration inputs
# --------------------------------------------------------------------------------------------

def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _to_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


class CalibrationRecorder:
    """Records the inputs of every ``forward`` call of ``module`` (a pipeline's transformer)
    while the context is open: positional and keyword arguments, tensors copied to the CPU.
    At most ``max_calls`` calls are kept (the first ones). Nothing about the calls changes."""

    def __init__(self, module: nn.Module, *, max_calls: int | None = None):
        if max_calls is not None and max_calls < 1:
            raise InputError(f"max_calls must be >= 1 or None; got {max_calls}")
        self.module = module
        self.max_calls = max_calls
        self.batches: list[dict[str, Any]] = []
        self._handle = None

    def _hook(self, _module, args, kwargs):
        if self.max_calls is None or len(self.batches) < self.max_calls:
            self.batches.append({"args": _to_cpu(tuple(args)), "kwargs": _to_cpu(dict(kwargs))})

    def __enter__(self) -> "CalibrationRecorder":
        self._handle = self.module.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def save(self, path: str | os.PathLike) -> Path:
        return save_calibration(self.batches, path)


def save_calibration(batches: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Write recorded calls (``{"args": tuple, "kwargs": dict}`` each) to ``path`` atomically;
    an existing file of another kind (a text or JSON file, a model) is not replaced
    (:func:`qkrope._fileio.check_outputs`)."""
    import io

    from qkrope._fileio import CALIBRATION, check_outputs, write_atomic

    if not batches:
        raise InputError("no calibration batches were recorded: run the pipeline inside the "
                         "CalibrationRecorder context before saving")
    buf = io.BytesIO()
    torch.save({"format": CALIBRATION_FORMAT, "format_version": 1,
                "batches": [{"args": list(b["args"]), "kwargs": dict(b["kwargs"])}
                            for b in batches]}, buf)
    path = Path(path)
    check_outputs([(path, CALIBRATION)], flag="path")
    write_atomic(path, buf.getvalue())
    return path


def _unreadable(path: Path, exc: Exception) -> str:
    """What a file torch.load (weights_only=True) refused is, in one clause and without
    torch's advice (the state-dict reader's words)."""
    from qkrope.runtime.state_dict import _what_failed

    return _what_failed(path, exc)


def _check_values(value, where: str) -> None:
    """Every floating tensor in a recorded call is finite (max calibration takes the largest
    magnitude: one NaN or inf makes every scale downstream of it NaN)."""
    if isinstance(value, torch.Tensor):
        if (value.is_floating_point() or value.is_complex()) and value.numel() and \
                not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).sum())
            raise InputError(f"{where} has {bad} NaN or infinite value(s) of {value.numel()}; "
                             f"record the calibration from runs that produce finite inputs")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_values(v, f"{where}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_values(v, f"{where}[{k!r}]")


def load_calibration(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The batches of a file written by :func:`save_calibration`, loaded with
    ``weights_only=True`` (no code in the file runs) and checked: each a recorded call
    (``args`` a list, ``kwargs`` a dict of names), every floating tensor finite."""
    path = Path(path)
    if not path.is_file():
        raise InputFileNotFoundError(f"--calibration {str(path)!r} does not exist: record one "
                                     f"with qkrope.export.quantize.CalibrationRecorder")
    expected = "expected a file written by CalibrationRecorder.save"
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any reader failure means "not a calibration file"
        raise InputError(f"--calibration {str(path)!r} could not be read: "
                         f"{_unreadable(path, exc)}; {expected}") from None
    batches = data.get("batches") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT \
            or not isinstance(batches, (list, tuple)) or not batches:
        raise InputError(f"--calibration {str(path)!r} is not a qkrope calibration file (no "
                         f"{CALIBRATION_FORMAT!r} batches); record one with CalibrationRecorder")
    out = []
    for i, b in enumerate(batches):
        where = f"--calibration {str(path)!r} batch {i}"
        if not isinstance(b, dict) or not isinstance(b.get("args", ()), (list, tuple)) \
                or not isinstance(b.get("kwargs", {}), dict) \
                or not all(isinstance(k, str) for k in b.get("kwargs", {})) \
                or not ({"args", "kwargs"} & set(b)):
            got = type(b).__name__ if not isinstance(b, dict) else \
                f"a dict with {sorted(map(str, b))[:6]}"
            raise InputError(f"{where} is not a recorded call ({{'args': list, 'kwargs': dict "
                             f"of names}}); got {got}; {expected}")
        call = {"args": tuple(b.get("args", ())), "kwargs": dict(b.get("kwargs", {}))}
        _check_values(call["args"], f"{where} args")
        _check_values(call["kwargs"], f"{where} kwargs")
        out.append(call)
    return out


def resolve_device(device: str | None) -> "torch.device":
    """``--device``: a torch device that exists here (default: cuda when available, else
    cpu); anything else is an :class:`InputError` naming what is available."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fix = "use --device cpu, cuda or cuda:N"
    try:
        d = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"--device {device!r} is not a torch device ({reason}); {fix}") \
            from None
    if d.type == "cpu":
        return d
    if d.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else "no GPU visible"
            raise InputError(f"--device {device!r}: CUDA is not available here (torch "
                             f"{torch.__version__}, {build}); use --device cpu")
        n = torch.cuda.device_count()
        if d.index is not None and d.index >= n:
            raise InputError(f"--device {device!r}: this machine has {n} CUDA device(s), "
                             f"cuda:0 to cuda:{n - 1}; {fix}")
        return d
    backend = getattr(torch, d.type, None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        raise InputError(f"--device {device!r}: no {d.type} device is available here; {fix}")
    return d


# --------------------------------------------------------------------------------------------
# Calibration with ModelOpt, save and restore
# --------------------------------------------------------------------------------------------

def check_exclude(model: nn.Module, exclude: Iterable[str]) -> None:
    """Every name in ``exclude`` names a module of ``model`` (its dotted name, or an fnmatch
    pattern matching at least one): a misspelt name would leave the layer meant to stay in
    high precision quantised. Raises :class:`InputError` naming them and the top-level
    modules."""
    import fnmatch

    names = [n for n, _ in model.named_modules() if n]
    missing = [e for e in exclude
               if not any(n == e or fnmatch.fnmatchcase(n, e) for n in names)]
    if missing:
        top = [n for n, _ in model.named_children()]
        dotted = next((n for n in names if n.count(".") == 2), "MODULE.CHILD")
        raise InputError(f"--exclude {' '.join(missing)}: no module of the "
                         f"{type(model).__name__} has that name; its top-level modules are "
                         f"{', '.join(top)} (a submodule by its dotted name, e.g. {dotted})")


def folder_class_name(directory: str | os.PathLike) -> str | None:
    """The diffusers class a model folder's ``config.json`` names (``_class_name``), or None
    where it names none or cannot be read (the load that follows reports what is wrong)."""
    try:
        with open(Path(directory) / "config.json", encoding="utf-8") as f:
            name = json.load(f).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def check_exclude_in_folder(directory: str | os.PathLike, exclude: Iterable[str]) -> None:
    """:func:`check_exclude` before the weights are loaded (a real transformer takes minutes):
    against the module tree of the folder's ``config.json`` built on the meta device (no
    memory, no weights), for the classes qkrope quantises
    (:data:`qkrope.quantization.DEFAULT_EXCLUDED_BY_CLASS`). A config diffusers cannot build is
    left to the load that follows, whose model :func:`fp8_config` checks again."""
    diffusers = require("diffusers", "FP8 quantisation of a diffusers transformer")
    name = folder_class_name(directory)
    cls = getattr(diffusers, name, None) if families.by_class(name) is not None else None
    if cls is None:
        return
    try:
        config = cls.load_config(str(directory))
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            skeleton = cls.from_config(config)
    except Exception:  # noqa: BLE001 - the real load reports what is wrong with the folder
        return
    check_exclude(skeleton, exclude)


def fp8_config(exclude: Iterable[str] = DEFAULT_EXCLUDED, *,
               model: nn.Module | None = None) -> dict[str, Any]:
    """ModelOpt quantisation config: per-tensor FP8 e4m3 weights and inputs of every
    ``nn.Linear``, max calibration, the modules named in ``exclude`` (and their children) off.
    With ``model``, every excluded name must name one of its modules (:func:`check_exclude`)."""
    exclude = tuple(exclude)
    if model is not None:
        check_exclude(model, exclude)
    fp8 = {"num_bits": (4, 3), "axis": None}
    rules: list[dict[str, Any]] = [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*weight_quantizer", "parent_class": "nn.Linear", "cfg": dict(fp8)},
        {"quantizer_name": "*input_quantizer", "parent_class": "nn.Linear", "cfg": dict(fp8)},
    ]
    for name in exclude:
        rules.append({"quantizer_name": f"{name}.*", "enable": False})
    return {"quant_cfg": rules, "algorithm": "max"}


_NON_FINITE = re.compile(r"\b(nan|inf)\b", re.IGNORECASE)  # ModelOpt's amax assertions


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def calibrate(transformer: nn.Module, batches: Sequence[dict[str, Any]], *,
              config: dict[str, Any] | None = None, progress: bool = False) -> nn.Module:
    """``mtq.quantize(transformer, config, forward_loop)`` over the recorded ``batches`` (each
    call replayed on the transformer's device); quantises in place and returns it."""
    mtq, _ = _modelopt()
    if not batches:
        raise InputError("calibration needs at least one recorded batch")
    for i, batch in enumerate(batches):  # a NaN input would end as ModelOpt's AssertionError
        _check_values(batch.get("args", ()), f"calibration batch {i} args")
        _check_values(batch.get("kwargs", {}), f"calibration batch {i} kwargs")
    device = next(transformer.parameters()).device

    def forward_loop(model):
        from tqdm import tqdm

        with torch.no_grad():
            for i, batch in enumerate(tqdm(batches, desc="calibrating", unit="batch",
                                           disable=not progress)):
                try:
                    model(*_to_device(batch["args"], device),
                          **_to_device(batch["kwargs"], device))
                except (TypeError, ValueError, RuntimeError, IndexError, KeyError,
                        AttributeError, AssertionError) as exc:
                    if isinstance(exc, torch.OutOfMemoryError):
                        raise
                    if _NON_FINITE.search(str(exc)):  # ModelOpt's amax check in the model
                        raise QuantizeError(f"calibration batch {i} gave non-finite activations "
                                            f"inside the model ({_one_line(exc)}): its weights "
                                            f"carry NaN/inf or overflow in this dtype") from None
                    raise InputError(f"calibration batch {i} does not fit the "
                                     f"{type(model).__name__}: {_one_line(exc)}; record the "
                                     f"calibration from this model's own pipeline "
                                     f"(CalibrationRecorder)") from None

    with warnings.catch_warnings(), _quiet():
        warnings.simplefilter("ignore")
        try:
            mtq.quantize(transformer, config or fp8_config(), forward_loop)
        except AssertionError as exc:
            hint = ("; the model's weights carry NaN/inf or overflow in this dtype"
                    if _NON_FINITE.search(str(exc)) else "")
            raise QuantizeError(f"ModelOpt's calibration failed: {_one_line(exc)}{hint}") \
                from None
    bad = [(n, amax_problem(q.amax)) for n, q in fp8_quantizers(transformer)
           if amax_problem(q.amax) is not None]
    if bad:
        raise QuantizeError(f"the calibration gave {len(bad)} quantizer(s) an amax FP8 cannot "
                            f"scale by (first {bad[0][0]}: {bad[0][1]}): the model's weights "
                            f"or the calibration inputs carry non-finite values")
    if not fp8_quantizers(transformer):
        raise QuantizeError("the configuration enabled no FP8 quantizer with a calibrated amax "
                            "(did the calibration batches reach the transformer?)")
    return transformer


def _safetensors_os_error(exc: Exception) -> OSError | None:
    """The OS error inside a safetensors write failure ("... (os error 28)"), if any."""
    import errno

    m = re.search(r"os error (\d+)", str(exc))
    if m is None:
        return None
    code = int(m.group(1))
    return OSError(code, os.strerror(code) if code in errno.errorcode else str(exc))


def save_quantized(transformer: nn.Module, out: str | os.PathLike, *,
                   inputs: Sequence[str | os.PathLike | None] = ()) -> Path:
    """``save_pretrained`` + ``modelopt_state.pth`` into the folder ``out``, replaced as a whole
    by :func:`qkrope._fileio.staged_outputs` (written in a staging folder beside it, then swapped
    in under the folder lock; the old folder survives any failure, a SIGTERM or a kill). ``out``
    may replace only a previous quantised model or an empty folder, and may be or contain none
    of ``inputs`` (the float model's folder, the calibration file)."""
    import io

    from qkrope._fileio import QUANTIZED_MODEL, check_outputs, output_error, staged_outputs

    _, mto = _modelopt()
    out = Path(os.path.abspath(out))
    if not out.name:
        raise InputError(f"--out {str(out)!r} names no folder; pass a new folder such as QDIR")
    check_outputs([(out, QUANTIZED_MODEL)], inputs)
    with staged_outputs(out.parent, [out.name], kinds={out.name: QUANTIZED_MODEL},
                        inputs=inputs) as st:
        staged = st.path(out.name)
        staged.mkdir()  # mode as a plain mkdir gives (the umask's)
        try:
            transformer.save_pretrained(str(staged))
        except Exception as exc:  # noqa: BLE001 - safetensors' SafetensorError is no OSError
            os_error = exc if isinstance(exc, OSError) else _safetensors_os_error(exc)
            if os_error is None:
                raise
            raise output_error(os_error, out) from None
        buf = io.BytesIO()  # torch.save to a full disk fails with a RuntimeError, not OSError
        torch.save(mto.modelopt_state(transformer), buf)
        (staged / quantization.MODELOPT_STATE_FILE).write_bytes(buf.getbuffer())
        st.commit([out.name])
    return out


def _load_weights(directory: Path) -> dict[str, torch.Tensor]:
    from qkrope.diffusers_weights import unchanged_while_read

    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        from safetensors.torch import load_file

        with unchanged_while_read([f]):  # a shard re-saved while it is read: refused
            out.update(load_file(str(f)))
    for f in sorted(directory.glob("*.bin")):
        out.update(torch.load(f, map_location="cpu", weights_only=True))
    return out


def check_loaded_weights(model: nn.Module, *, source: str, dtype: str) -> None:
    """Before the calibration (``qkrope quantize``): every floating parameter of the model as
    loaded in ``dtype`` is finite; one that is not (NaN/inf in the weights, or values beyond
    ``dtype``'s range that the load made infinite) is a WeightValueError naming it. The
    calibration's max would otherwise carry it into every amax downstream."""
    for name, p in model.named_parameters():
        bad = nonfinite(p.detach())
        if bad:
            wider = " (or --dtype bf16: float32's range)" if dtype == "fp16" else ""
            raise WeightValueError(
                f"{source}: {name}: {bad} of {p.numel()} values are NaN or infinite as loaded "
                f"in {dtype} (NaN/inf in the weights, or values beyond {dtype}'s range). Fix: "
                f"pass finite weights{wider}")


def check_calibrated(tensors: Mapping[str, torch.Tensor], *, source: str) -> None:
    """Every calibrated amax among ``tensors`` (quantizer tensors by key) is finite and > 0
    (:func:`qkrope.weight_values.amax_problem`); else one QuantizeError naming the first and
    the fix. A NaN amax would export "done" and make every output after that layer NaN."""
    bad = [(k, amax_problem(v)) for k, v in tensors.items()
           if k.endswith("_amax") and isinstance(v, torch.Tensor) and amax_problem(v)]
    if bad:
        raise QuantizeError(f"{source}: {len(bad)} calibrated amax value(s) FP8 cannot scale by "
                            f"(first {bad[0][0]}: {bad[0][1]}). Fix: calibrate again with "
                            f"`{quantization.QUANTIZE_COMMAND}` from finite weights and inputs")


def restore_quantized(transformer: nn.Module, directory: str | os.PathLike, *,
                      headers=None) -> nn.Module:
    """ModelOpt's restore on a transformer loaded from ``directory``: the quantizers from its
    ``modelopt_state.pth`` (``mto.restore_from_modelopt_state``), then their calibrated buffers
    from the folder's weight files (every quantizer tensor must be taken). Loading a folder:
    ``qkrope.export.patch_diffusers.load_transformer(directory, quant="fp8")``. ``headers``
    (:func:`qkrope.diffusers_weights.tensor_headers` of the folder): only the quantizer tensors
    are read, one by one (the streamed export's placeholder skeleton)."""
    _, mto = _modelopt()
    directory = Path(directory)
    state_file = directory / quantization.MODELOPT_STATE_FILE
    redo = f"re-run `{quantization.QUANTIZE_COMMAND}`"
    try:  # loaded here with weights_only=True whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says
        state = torch.load(state_file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any reader failure: not ModelOpt's state
        raise QuantizeError(f"{state_file} cannot be read: {_unreadable(state_file, exc)}; "
                            f"{redo}") from None
    if not isinstance(state, dict) or "modelopt_state_dict" not in state:
        raise QuantizeError(f"{state_file} is not ModelOpt's state (no modelopt_state_dict); "
                            f"{redo}")
    with warnings.catch_warnings(), _quiet():
        warnings.simplefilter("ignore")
        try:
            mto.restore_from_modelopt_state(transformer, modelopt_state=state)
        except (AssertionError, KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise QuantizeError(f"{state_file}: ModelOpt cannot restore it on this model "
                                f"({_one_line(exc)}); {redo}") from None
    if headers is None:
        weights = _load_weights(directory)
        quant = {k: v for k, v in weights.items() if quantization.QUANTIZER_MARK in k}
    else:
        from qkrope.diffusers_weights import read_tensor

        quant = {k: read_tensor(h) for k, h in headers.items()
                 if quantization.QUANTIZER_MARK in k}
    check_calibrated(quant, source=str(directory))  # before anything is built on them
    missing, unexpected = transformer.load_state_dict(quant, strict=False)
    if unexpected:
        raise QuantizeError(f"{directory}: ModelOpt's state does not have the quantizer tensors "
                            f"{unexpected[:4]} of the weights (a folder mixed from two models?)")
    absent = [k for k in missing if quantization.QUANTIZER_MARK in k and k.endswith("_amax")]
    enabled = {name for name, _ in fp8_quantizers(transformer, calibrated=False)}
    absent = [k for k in absent if k.rsplit(".", 1)[0] in enabled]
    if absent:
        raise QuantizeError(f"{directory}: enabled quantizers have no calibrated amax in the "
                            f"weights ({absent[:4]}); re-run the calibration")
    return transformer.eval()


# --------------------------------------------------------------------------------------------
# Reading the quantizers
# --------------------------------------------------------------------------------------------

def _is_tensor_quantizer(module: nn.Module) -> bool:
    return type(module).__name__ == "TensorQuantizer" and hasattr(module, "is_enabled")


def fp8_quantizers(model: nn.Module, *, calibrated: bool = True) -> list[tuple[str, nn.Module]]:
    """(name, TensorQuantizer) of every enabled quantizer (with an amax when ``calibrated``)."""
    out = []
    for name, module in model.named_modules():
        if _is_tensor_quantizer(module) and module.is_enabled:
            if calibrated and getattr(module, "amax", None) is None:
                continue
            out.append((name, module))
    return out


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's dequantisation scale for ``amax`` (float32 scalar): ``1 / (448 / amax)``, an
    amax at or below 2**-24 taken as 1, exactly as its FP8 fake quantisation computes it."""
    amax = amax.detach().to("cpu", torch.float32).reshape(())
    safe = torch.where(amax <= 1.0 / (1 << 24), torch.ones_like(amax), amax)
    return 1 / (quantization.FP8_E4M3_MAX / safe)


def fp8_values(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The float8_e4m3fn tensor ModelOpt's fake quantisation rounds ``x`` to (before the
    dequantisation by :func:`fp8_scale`)."""
    amax = amax.detach().to("cpu", torch.float32).reshape(())
    safe = torch.where(amax <= 1.0 / (1 << 24), torch.ones_like(amax), amax)
    scale = quantization.FP8_E4M3_MAX / safe
    lim = quantization.FP8_E4M3_MAX
    return (x.detach().to("cpu", torch.float32) * scale).clamp(-lim, lim).to(torch.float8_e4m3fn)


def linear_fp8_table(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Per quantised Linear (module name): its input and weight quantizers' amax (float32
    scalars; None for a quantizer the calibration never reached, which :func:`apply_fp8`
    accepts only for a Linear the graph does not use). Refuses what the ONNX rewrite does not
    express: per-channel/block amax, anything but e4m3, pre-quant scales, an output quantizer,
    a quantised non-Linear module."""
    table: dict[str, dict[str, Any]] = {}
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    for name, q in fp8_quantizers(model, calibrated=False):
        owner, role = name.rsplit(".", 1)
        where = f"quantizer {name}"
        if owner not in linears or role not in ("input_quantizer", "weight_quantizer"):
            raise QuantizeError(f"{where} is enabled; the FP8 export writes Q/DQ for the inputs "
                                f"and weights of nn.Linear layers only. Fix: calibrate the float "
                                f"model with `{quantization.QUANTIZE_COMMAND}` (TensorRT's "
                                f"demo selection, qkrope.export.quantize.fp8_config)")
        if tuple(getattr(q, "num_bits", ())) != (4, 3):
            raise QuantizeError(f"{where} has num_bits {getattr(q, 'num_bits', None)}; the "
                                f"export writes float8 e4m3 only")
        if getattr(q, "block_sizes", None) or getattr(q, "pre_quant_scale", None) is not None:
            raise QuantizeError(f"{where} uses block sizes or a pre-quant scale; the export "
                                f"writes per-tensor FP8 only")
        amax = getattr(q, "amax", None)
        if amax is None:
            # no amax: the calibration never ran this layer. Fine where the exported graph does
            # not use it either (a stream the export does not serve); apply_fp8 decides, from
            # the graph, and refuses a used one
            table.setdefault(owner, {})[role.split("_")[0]] = None
            continue
        if amax.numel() != 1:
            raise QuantizeError(f"{where} has a per-channel amax of shape {list(amax.shape)}; "
                                f"the export writes per-tensor FP8 only")
        check_calibrated({f"{name}._amax": amax}, source="the quantised model")
        table.setdefault(owner, {})[role.split("_")[0]] = amax.detach().to("cpu",
                                                                            torch.float32)
    return table


@contextlib.contextmanager
def quantizers_disabled(model: nn.Module):
    """Every TensorQuantizer of ``model`` off (the float model) inside the context."""
    on = [m for _, m in model.named_modules() if _is_tensor_quantizer(m) and m.is_enabled]
    for m in on:
        m.disable()
    try:
        yield model
    finally:
        for m in on:
            m.enable()


# --------------------------------------------------------------------------------------------
# The ONNX rewrite
# --------------------------------------------------------------------------------------------

def _np_fp8(t: torch.Tensor):
    import ml_dtypes

    return t.contiguous().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)


def apply_fp8(model, transformer: nn.Module, table: dict[str, dict[str, Any]], *,
              weights: Callable[[str], torch.Tensor] | None = None) -> dict[str, Any]:
    """Insert FP8 Q/DQ into an exported float graph (onnx_ir, in place) per ``table``
    (:func:`linear_fp8_table`) and return the sidecar's ``quantization`` record.

    A Linear appears in the graph as ``MatMul(x, Transpose(W))`` (+ bias ``Add``) or
    ``Gemm(x, W, b, transB=1)``, ``W`` being the initializer named by its state-dict key. Its
    input becomes ``DequantizeLinear(QuantizeLinear(x, s_x, 0 as float8e4m3fn), s_x)``; ``W``
    becomes ``DequantizeLinear(W8, s_w)`` with ``W8`` float8e4m3fn constants (stored transposed,
    ``[in, out]``, for a MatMul so no Transpose is left on the weight path), named
    ``<key>_fp8``; every scale is a scalar constant in the model's float type. A Linear whose
    weight the graph does not use (past ``--layers``) is skipped and listed.

    ``weights(key)``: a weight in the export dtype (default: ``transformer``'s parameter); each
    FP8 weight is quantised when it is written (an ``onnx_ir.LazyTensor``), so the streamed
    export holds one weight at a time."""
    import numpy as np
    import onnx_ir as ir

    from .streaming import lazy_tensor

    graph = model.graph
    if weights is None:
        params = dict(transformer.named_parameters())

        def weights(key: str) -> torch.Tensor:
            return params[key].detach()

    zero = None
    done, skipped = [], []

    def const(name: str, array) -> ir.Value:
        value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
        value.shape = ir.Shape(list(array.shape))
        value.type = ir.TensorType(value.const_value.dtype)
        graph.register_initializer(value)
        return value

    def fp8_const(name: str, key: str, amax: torch.Tensor, *, transposed: bool) -> ir.Value:
        """The FP8 values of weight ``key`` (``[in, out]`` when ``transposed``), computed from
        ``weights(key)`` each time the initializer is written."""
        shape = list(graph.initializers[key].const_value.shape)

        def read() -> torch.Tensor:
            w = weights(key).to("cpu", torch.float32)
            return fp8_values(w.t() if transposed else w, amax)

        value = ir.Value(name=name, const_value=lazy_tensor(
            read, dtype=ir.DataType.FLOAT8E4M3FN, shape=shape[::-1] if transposed else shape,
            name=name))
        value.shape = ir.Shape(list(value.const_value.shape))
        value.type = ir.TensorType(ir.DataType.FLOAT8E4M3FN)
        graph.register_initializer(value)
        return value

    for owner in sorted(table):
        roles = table[owner]
        key = f"{owner}.weight"
        w_value = graph.initializers.get(key)
        uses = list(w_value.uses()) if w_value is not None else []
        if not uses:  # past --layers, or a stream the export does not serve
            skipped.append(owner)
            continue
        uncalibrated = sorted(role for role, amax in roles.items() if amax is None)
        if uncalibrated:
            raise QuantizeError(f"quantizer {owner}.{uncalibrated[0]}_quantizer is enabled but "
                                f"has no calibrated amax, and the exported graph uses {key}: "
                                f"the calibration never ran this layer. Fix: calibrate "
                                f"(`{quantization.QUANTIZE_COMMAND}`) with inputs that reach it")
        if set(roles) != {"input", "weight"}:
            raise QuantizeError(f"{owner} quantises only its {sorted(roles)}; the FP8 export "
                                f"needs both the input and the weight quantised (FP8 GEMM)")
        float_type = w_value.const_value.dtype
        np_float = float_type.numpy()
        if zero is None:
            zero = const("qkrope_fp8_zero_point", _np_fp8(torch.zeros((), dtype=torch.float8_e4m3fn)))
        s_x = const(f"{owner}.input_quantizer.scale",
                    np.asarray(fp8_scale(roles["input"]).numpy(), dtype=np_float))
        s_w = const(f"{owner}.weight_quantizer.scale",
                    np.asarray(fp8_scale(roles["weight"]).numpy(), dtype=np_float))
        for use in uses:
            node, index = use.node, use.idx
            if node.op_type == "Transpose" and index == 0:
                perm = list(node.attributes["perm"].value) if "perm" in node.attributes else [1, 0]
                consumers = list(node.outputs[0].uses())
                if perm != [1, 0] or not consumers or any(
                        c.node.op_type != "MatMul" or c.idx != 1 for c in consumers):
                    raise QuantizeError(f"{key} reaches {[c.node.op_type for c in consumers]} "
                                        f"through a Transpose {perm}; the FP8 export expects "
                                        f"MatMul(x, Transpose(W)) for a Linear")
                w8 = fp8_const(f"{key}_fp8", key, roles["weight"], transposed=True)
                for c in consumers:
                    _fp8_weight_input(graph, c.node, w8, s_w, s_x, zero, owner, key)
                    done.append(owner)
            elif node.op_type == "Gemm" and index == 1:
                attrs = {k: v.value for k, v in node.attributes.items()}
                if attrs.get("transA", 0) or not attrs.get("transB", 0):
                    raise QuantizeError(f"{key} feeds a Gemm with {attrs}; expected transB=1")
                w8 = fp8_const(f"{key}_fp8", key, roles["weight"], transposed=False)
                _fp8_weight_input(graph, node, w8, s_w, s_x, zero, owner, key)
                done.append(owner)
            else:
                raise QuantizeError(f"{key} is used by {node.op_type} (input {index}); the FP8 "
                                    f"export expects a Linear's MatMul/Transpose or Gemm")
        graph.initializers.pop(key)
    ir.passes.common.RemoveUnusedNodesPass()(model)  # the weights' Transposes
    return {"mode": "fp8", "format": "float8e4m3fn", "granularity": "per-tensor",
            "tool": "nvidia-modelopt", "scale": "1 / (448 / amax)",
            "quantized_linears": sorted(set(done)), "not_in_graph": sorted(skipped),
            "qdq_pairs": len(done),
            "weights": sorted({f"{o}.weight_fp8" for o in done})}


def _fp8_weight_input(graph, node, w8, s_w, s_x, zero, owner: str, key: str) -> None:
    """``node``'s activation input through Q/DQ, its weight input (input 1) the FP8 constant
    ``w8`` behind a DequantizeLinear (one per consumer)."""
    import onnx_ir as ir

    dq_w = ir.node("DequantizeLinear", [w8, s_w], name=f"{key}_dequantize")
    _quantize_input(graph, node, s_x, zero, owner)
    graph.insert_before(node, [dq_w])
    node.replace_input_with(1, dq_w.outputs[0])
    dq_w.outputs[0].name = f"{key}_dequantized"


def _quantize_input(graph, node, scale, zero, owner: str) -> None:
    import onnx_ir as ir

    x = node.inputs[0]
    q = ir.node("QuantizeLinear", [x, scale, zero], name=f"{owner}.input_quantize")
    dq = ir.node("DequantizeLinear", [q.outputs[0], scale], name=f"{owner}.input_dequantize")
    q.outputs[0].name = f"{owner}.input_fp8"
    dq.outputs[0].name = f"{owner}.input_dequantized"
    graph.insert_before(node, [q, dq])
    node.replace_input_with(0, dq.outputs[0])


__all__ = ["DEFAULT_EXCLUDED", "CalibrationRecorder", "save_calibration", "load_calibration",
           "resolve_device", "check_exclude", "check_exclude_in_folder", "fp8_config", "calibrate", "save_quantized", "restore_quantized",
           "fp8_quantizers", "fp8_scale", "fp8_values", "linear_fp8_table",
           "quantizers_disabled", "apply_fp8", "QuantizeError"]
