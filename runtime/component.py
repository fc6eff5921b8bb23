"""The drop-in transformer as a diffusers pipeline component (what every family's drop-in
inherits; issue 36).

diffusers treats a pipeline component by its base class, so :class:`DropinComponent` is a
``diffusers.ModelMixin`` (a ``torch.nn.Module`` without parameters: the weights live in the
exported ONNX model or TensorRT engine) that says, for each thing diffusers can do to a model,
whether a fixed exported graph can do it:

- **saved with the pipeline.** ``pipe.save_pretrained(DIR)`` calls :meth:`save_pretrained`,
  which writes ``DIR/transformer/`` through a staging folder renamed into place: the export's
  files (the ``.onnx`` with its external data and sidecar, or the ``.engine`` with its sidecar)
  hard-linked where the file system allows, else copied, and ``qkrope_component.json`` naming
  the model file. ``model_index.json`` records the component as ``["qkrope.runtime", <class>]``
  (diffusers resolves it from the imported ``qkrope.runtime``, which offers the class and the
  ``ModelMixin`` its loader looks for there), so ``DiffusionPipeline.from_pretrained(DIR)`` (or
  the pipeline's own class) loads it back through :meth:`from_pretrained` with
  :func:`qkrope.runtime.load_transformer`. A drop-in whose files are gone is refused at save
  time, with how to pass ``transformer=`` instead.
- **``.to()``.** A device the runtime can feed (ONNX Runtime's CPU session: the CPU; its CUDA
  session or a TensorRT engine: their GPU) is honoured (the pipeline then makes its tensors
  there); the export's own dtype is a no-op; any other dtype, or a device the runtime cannot
  take, is refused at the call with the export's dtype and the re-export command (``half()``,
  ``float()``, ``bfloat16()``, ``cuda()``, ``cpu()`` and ``pipe.to(...)`` go through the
  same check). ``parameters()`` is empty: there are no torch parameters.
- **diffusers' model hooks.** ``fuse_qkv_projections``/``unfuse_qkv_projections``,
  ``set_default_attn_processor``, ``reset_attention_backend`` and ``disable_cache`` are
  no-ops (the graph already is what they ask for; the numbers do not change);
  ``attn_processors`` is empty (no processor can be swapped). The cache hooks
  (``enable_cache`` with PyramidAttentionBroadcast, FasterCache, FirstBlockCache, TaylorSeer,
  MagCache), ``enable_layerwise_casting``, ``enable_group_offload``, ``set_attn_processor``,
  ``set_attention_backend`` and the xformers/NPU/XLA attention switches are refused in one line
  that says why and what to use instead, and so is any diffusers hook registry attached to
  the drop-in itself by the ``apply_*`` functions (``apply_faster_cache``,
  ``apply_mag_cache``). The ``apply_*`` functions that only search a model's submodules find
  none in the drop-in and attach nothing, as diffusers does for any model without such layers
  (``apply_pyramid_attention_broadcast``, ``apply_taylorseer_cache``,
  ``apply_layerwise_casting``, ``apply_group_offloading``: the drop-in runs unchanged;
  ``apply_first_block_cache`` stops with diffusers' own IndexError): use the model methods
  above, which answer for the drop-in.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from qkrope._fileio import link_or_copy, staged_outputs, write_json_atomic
from qkrope.errors import InputError, QkropeError

try:  # diffusers is what saves, loads and hooks a component; without it a plain Module will do
    from diffusers import ModelMixin
except ImportError:  # pragma: no cover - the [diffusers] extra is not installed
    ModelMixin = torch.nn.Module

logger = logging.getLogger(__name__)

#: the component folder's record (in DIR/transformer/ of a saved pipeline)
COMPONENT_FILE = "qkrope_component.json"
COMPONENT_FORMAT = "qkrope-dropin-component"
COMPONENT_FORMAT_VERSION = 1
#: the module model_index.json names; diffusers finds the class and ModelMixin there
LIBRARY = "qkrope.runtime"
#: torch dtype -> ``qkrope export --dtype`` value
_EXPORT_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class ComponentError(InputError):
    """Something diffusers asked of the drop-in that an exported graph cannot do (the message
    says why and what to use instead)."""


class ComponentSaveError(QkropeError, OSError):
    """The drop-in cannot be saved with the pipeline (its export's files are gone)."""


class ComponentLoadError(InputError):
    """A saved component folder that cannot be loaded back."""


def _export_hint(dtype: torch.dtype | None = None) -> str:
    target = _EXPORT_DTYPES.get(dtype)
    return (f"re-export with `qkrope export --model transformer --diffusers DIR --dtype "
            f"{target}` and load that" if target else
            "qkrope exports fp32, fp16 and bf16 (`qkrope export --dtype`; FP8 weights: `qkrope "
            "quantize`)")


class DropinComponent(ModelMixin):
    """Base of the drop-ins: a diffusers model component backed by a qkrope runner (module
    docstring). A subclass sets ``_runner``, ``config``, ``dtype`` and ``device`` in its
    ``__init__`` and defines ``forward``; it needs not call this ``__init__``."""

    # plain attributes of each drop-in (ModelMixin's read-only properties of these names read
    # torch parameters, which a drop-in has none of)
    dtype: torch.dtype = None
    device: torch.device = None
    config = None
    _supports_group_offloading = False
    _supports_gradient_checkpointing = False

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        ModelMixin.__init__(self)  # the Module's state before the subclass's __init__ sets fields
        # diffusers records a component as (its object's __module__, class name) and, on load,
        # imports nothing it is not given: the public package that offers every drop-in class
        self.__dict__["__module__"] = LIBRARY
        return self

    def __getattr__(self, name: str) -> Any:
        # a property that refuses (an AttributeError subclass with the fix) keeps its message
        # instead of torch's generic "has no attribute"
        for klass in type(self).__mro__:
            if name in klass.__dict__:
                attr = klass.__dict__[name]
                if isinstance(attr, property) and attr.fget is not None:
                    return attr.fget(self)
                break
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_diffusers_hook":  # the HookRegistry an apply_* function puts on a module
            raise ComponentError(
                f"diffusers' model hooks (caches, layerwise casting, group offloading, layer "
                f"skipping) wrap the PyTorch model's blocks and layers; {self._what()} runs "
                f"the whole transformer as one fixed call with none of them. Fix: apply the "
                f"hook to the PyTorch transformer, or run without it")
        super().__setattr__(name, value)

    def _what(self) -> str:
        runner = self.__dict__.get("_runner")
        return (f"the exported transformer ({Path(str(runner.path)).name}, {runner.backend})"
                if runner is not None and getattr(runner, "path", None) else
                "the exported transformer")

    # ----------------------------------------------------------------------------------------
    # .to(), dtype, device
    # ----------------------------------------------------------------------------------------
    def to(self, *args, **kwargs) -> "DropinComponent":
        """Honour the export's dtype and a device its runtime takes inputs on; refuse the rest
        (module docstring). ``pipe.to(...)`` calls this for the transformer."""
        try:
            device, dtype, _non_blocking, _memory_format = torch._C._nn._parse_to(*args, **kwargs)
        except (TypeError, RuntimeError) as exc:
            raise ComponentError(f".to{_call(args, kwargs)}: {str(exc).splitlines()[0]}. "
                                 f"Fix: pass a device and/or a dtype") from None
        if dtype is not None and dtype != self.dtype:
            raise ComponentError(
                f".to({dtype}): {self._what()} computes in {self.dtype}, fixed at export "
                f"(weights, inputs and outputs), so it cannot change dtype. Fix: "
                f"{_export_hint(dtype)}; or pass {self.dtype} for this component (pipelines: "
                f"from_pretrained(..., dtype={{'transformer': {self.dtype}, 'default': "
                f"{dtype}}}))")
        if device is not None:
            self.device = self._checked_device(device)
        return self

    def _checked_device(self, device: torch.device | str) -> torch.device:
        from .caches import checked_device
        from .runner import RunnerInputError

        dev = checked_device(device)
        runner = self._runner
        try:
            runner._check_device(dev)
        except RunnerInputError:
            raise ComponentError(
                f".to({str(dev)!r}): {self._what()} runs on {runner.device} and takes its "
                f"inputs there, so it cannot move to {dev}. Fix: load the export for that "
                f"device (load_transformer(path.onnx) for the CPU, with providers="
                f"['CUDAExecutionProvider'] or a .engine for a GPU), or keep it on "
                f"{runner.device}") from None
        current = runner.device
        if dev.type == "cuda" and dev.index is None and current is not None \
                and current.type == "cuda":
            return current  # "cuda": the GPU the runtime runs on
        return dev

    def half(self) -> "DropinComponent":
        return self.to(torch.float16)

    def float(self) -> "DropinComponent":
        return self.to(torch.float32)

    def bfloat16(self) -> "DropinComponent":
        return self.to(torch.bfloat16)

    def double(self) -> "DropinComponent":
        return self.to(torch.float64)

    def type(self, dst_type) -> "DropinComponent":
        return self.to(dst_type)

    def cuda(self, device: int | torch.device | None = None) -> "DropinComponent":
        return self.to(torch.device("cuda", device) if isinstance(device, int)
                       else device or "cuda")

    def cpu(self) -> "DropinComponent":
        return self.to("cpu")

    def _apply(self, fn, recurse: bool = True):
        raise ComponentError(
            f"{self._what()} has no torch tensors to move or convert (xpu(), ipu(), "
            f"share_memory(), ... act on parameters). Fix: use .to(device) for a device its "
            f"runtime takes; the dtype is fixed at export")

    # ----------------------------------------------------------------------------------------
    # diffusers' model hooks
    # ----------------------------------------------------------------------------------------
    @property
    def attn_processors(self) -> dict:
        """Empty: the attention is compiled into the graph; there is no processor to swap."""
        return {}

    def set_attn_processor(self, processor) -> None:
        raise ComponentError(
            f"set_attn_processor: attention processors are PyTorch code, and {self._what()} "
            f"has its attention (QKNormRoPE, then scaled dot-product attention) fixed in the "
            f"graph. Fix: run custom processors on the PyTorch transformer")

    def set_default_attn_processor(self) -> None:
        """A no-op: the exported graph computes diffusers' default attention."""

    def fuse_qkv_projections(self) -> None:
        """A no-op: the runtime (ONNX Runtime, TensorRT) fuses the graph's projections as it
        can; the numbers do not change."""
        logger.info("fuse_qkv_projections: the exported graph is fixed; nothing to fuse")

    def unfuse_qkv_projections(self) -> None:
        """A no-op (see :meth:`fuse_qkv_projections`)."""

    def set_attention_backend(self, backend: str) -> None:
        raise ComponentError(
            f"set_attention_backend({backend!r}): {self._what()} runs the attention kernels "
            f"of its runtime, chosen at export and engine build. Fix: pick the runtime when "
            f"loading (ONNX Runtime providers, or a TensorRT engine)")

    def reset_attention_backend(self) -> None:
        """A no-op: the runtime's attention is the only one."""

    def set_use_memory_efficient_attention_xformers(self, valid: bool, attention_op=None):
        if valid:
            self.set_attention_backend("xformers")

    def set_use_npu_flash_attention(self, valid: bool) -> None:
        if valid:
            self.set_attention_backend("npu flash attention")

    def set_use_xla_flash_attention(self, use_xla_flash_attention: bool,
                                    partition_spec=None, **kwargs) -> None:
        if use_xla_flash_attention:
            self.set_attention_backend("xla flash attention")

    def enable_layerwise_casting(self, storage_dtype: torch.dtype = torch.float8_e4m3fn,
                                 compute_dtype: torch.dtype | None = None, *args,
                                 **kwargs) -> None:
        raise ComponentError(
            f"enable_layerwise_casting(storage_dtype={storage_dtype}): layerwise casting "
            f"stores PyTorch weights in a smaller dtype and casts each layer for its call; "
            f"{self._what()} has its weights fixed at export in {self.dtype}. Fix: for smaller "
            f"weights export bf16/fp16 (`qkrope export --dtype bf16`) or FP8 (`qkrope "
            f"quantize`)")

    def enable_group_offload(self, *args, **kwargs) -> None:
        raise ComponentError(
            f"enable_group_offload: group offloading moves PyTorch weights between devices "
            f"block by block; {self._what()} keeps its weights in the runtime's own memory. "
            f"Fix: offload the other components, e.g. pipe.enable_group_offload(..., "
            f"exclude_modules=['transformer'])")

    # the cache hooks (diffusers' CacheMixin)
    @property
    def is_cache_enabled(self) -> bool:
        return False

    def enable_cache(self, config) -> None:
        name = type(config).__name__.removesuffix("Config")
        raise ComponentError(
            f"enable_cache({name}): diffusers' caches skip or reuse the outputs of the "
            f"PyTorch model's blocks and attention layers between steps; {self._what()} runs "
            f"every block in one fixed call and exposes none of them. Fix: cache on the "
            f"PyTorch transformer, or use fewer num_inference_steps")

    def disable_cache(self) -> None:
        """A no-op: no cache can be enabled."""

    def _reset_stateful_cache(self, recurse: bool = True) -> None:
        """A no-op: nothing is cached between calls."""

    # ----------------------------------------------------------------------------------------
    # save and load with the pipeline
    # ----------------------------------------------------------------------------------------
    def _export_files(self) -> tuple[Path, list[Path]]:
        """The model file and every file it needs beside it (sidecar, external data)."""
        from qkrope.sidecars import engine_sidecar_path, sidecar_path

        runner = self.__dict__.get("_runner")
        path = Path(str(getattr(runner, "path", "") or ""))
        if runner is None or not path.name or not path.is_file():
            raise ComponentSaveError(
                f"cannot save {type(self).__name__}: its export {str(path) or '(unknown)'} is no "
                f"longer there to copy. Fix: save the pipeline without it and load with "
                f"from_pretrained(DIR, transformer=qkrope.runtime.load_transformer(PATH))")
        files = [path]
        if path.suffix.lower() == ".onnx":
            import onnx

            from .onnx_file import external_data_files

            model = onnx.load(str(path), load_external_data=False)
            files += list(external_data_files(model, path))
            files.append(sidecar_path(path))
        else:  # the engine's sidecar holds the config a drop-in is built from
            files.append(engine_sidecar_path(path))
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise ComponentSaveError(
                f"cannot save {type(self).__name__}: {missing[0]} (beside its export) is "
                f"missing. Fix: save the pipeline without it and load with from_pretrained("
                f"DIR, transformer=qkrope.runtime.load_transformer(PATH))")
        return path, files

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs) -> None:
        """``DIR/transformer/``: the export's files (hard-linked, else copied) and
        :data:`COMPONENT_FILE`, written in a staging folder renamed into place. diffusers'
        save options (``safe_serialization``, ``variant``, ...) do not apply to an export."""
        target = Path(save_directory)
        model, files = self._export_files()
        runner = self._runner
        record = {
            "format": COMPONENT_FORMAT, "format_version": COMPONENT_FORMAT_VERSION,
            "class": type(self).__name__, "model": model.name,
            "files": [f.name for f in files], "backend": runner.backend,
            "dtype": str(self.dtype).removeprefix("torch."),
            "cuda_graph": bool(getattr(runner, "cuda_graph", False)),
        }
        with staged_outputs(target.parent, [target.name], flag="save_directory") as stage:
            out = stage.path(target.name)
            out.mkdir()
            for f in files:
                link_or_copy(f, out / f.name)
            write_json_atomic(out / COMPONENT_FILE, record)
            stage.commit([target.name])
        self.__dict__["_saved_to"] = target

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *,
                        torch_dtype: torch.dtype | None = None, dtype: torch.dtype | None = None,
                        device_map=None, quantization_config=None,
                        device: torch.device | str | None = None,
                        providers=None, provider_options=None, sess_options=None, plugin=None,
                        cuda_graph: bool | None = None, allow_host_code: bool = False,
                        **_diffusers_options):
        """The drop-in saved in a component folder by :meth:`save_pretrained` (called by
        ``DiffusionPipeline.from_pretrained``). ``torch_dtype`` (or ``dtype``) must be the
        export's or None, ``device_map`` one device (checked as :meth:`to` checks it); the
        runtime options are :func:`qkrope.runtime.load_transformer`'s; diffusers' other
        loading options (``variant``, ``low_cpu_mem_usage``, ...) do not apply to an export."""
        from qkrope import runtime

        folder = Path(pretrained_model_name_or_path)
        record = _read_record(folder)
        if quantization_config is not None:
            raise ComponentLoadError(
                f"{folder}: quantization_config cannot apply to an exported transformer (its "
                f"weights are fixed at export). Fix: drop it for this component, or export FP8 "
                f"with `qkrope quantize`")
        if device is None and device_map is not None:
            device = _single_device(device_map, folder)
        options = {"cuda_graph": bool(record.get("cuda_graph")) if cuda_graph is None
                   else cuda_graph}
        if Path(record["model"]).suffix.lower() == ".onnx":
            options = {"providers": providers, "provider_options": provider_options,
                       "sess_options": sess_options}
        else:
            options["plugin"] = plugin
            if allow_host_code:  # the caller's opt-in only (a version-compatible engine)
                options["allow_host_code"] = True
        dropin = runtime.load_transformer(folder / record["model"], **options)
        torch_dtype = torch_dtype if torch_dtype is not None else dtype
        if torch_dtype is not None and torch_dtype != dropin.dtype:
            raise ComponentLoadError(
                f"{folder} holds a transformer exported in {dropin.dtype}, which cannot load "
                f"as {torch_dtype}. Fix: from_pretrained(..., dtype={{'transformer': "
                f"{dropin.dtype}, 'default': {torch_dtype}}}), or {_export_hint(torch_dtype)}")
        return dropin.to(device) if device is not None else dropin


def _call(args, kwargs) -> str:
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"({', '.join(parts)})"


def _read_record(folder: Path) -> dict[str, Any]:
    path = folder / COMPONENT_FILE
    fix = ("Fix: save the pipeline again with pipe.save_pretrained, or pass "
           "transformer=qkrope.runtime.load_transformer(PATH) to from_pretrained")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ComponentLoadError(f"{folder} has no {COMPONENT_FILE}, so it is not a saved qkrope "
                                 f"drop-in. {fix}") from None
    except (OSError, ValueError) as exc:
        raise ComponentLoadError(f"{path} cannot be read ({type(exc).__name__}). {fix}") from None
    if not isinstance(record, Mapping) or record.get("format") != COMPONENT_FORMAT:
        raise ComponentLoadError(f"{path} is not a qkrope component record (format "
                                 f"{COMPONENT_FORMAT!r}). {fix}")
    if record.get("format_version") != COMPONENT_FORMAT_VERSION:
        raise ComponentLoadError(
            f"{path} has format_version {record.get('format_version')!r}; this qkrope reads "
            f"{COMPONENT_FORMAT_VERSION}. {fix}")
    model = record.get("model")
    if not isinstance(model, str) or Path(model).name != model or not (folder / model).is_file():
        raise ComponentLoadError(f"{path} names the model {model!r}, which is not a file in "
                                 f"{folder}. {fix}")
    return dict(record)


def _single_device(device_map: Any, folder: Path) -> torch.device | str:
    """diffusers' per-component ``device_map``: ``{"": device}`` or a device name."""
    if isinstance(device_map, Mapping) and set(device_map) == {""}:
        device_map = device_map[""]
    if isinstance(device_map, int) and not isinstance(device_map, bool):
        return torch.device("cuda", device_map)
    if isinstance(device_map, (str, torch.device)):
        try:
            return torch.device(device_map)
        except (RuntimeError, TypeError):
            pass
    raise ComponentLoadError(
        f"{folder}: device_map {device_map!r} splits a model's layers across devices; the "
        f"exported transformer is one fixed graph on one device. Fix: pass device_map=None "
        f"(or one device) for it")


__all__ = ["COMPONENT_FILE", "ComponentError", "ComponentLoadError", "ComponentSaveError",
           "DropinComponent", "ModelMixin"]
