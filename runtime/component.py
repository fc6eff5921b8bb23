"""The drop-in transformer as a diffusers pipeline component (what every family's drop-in
inherits; issue 36).

diffusers treats a pipeline component by its base class, so :class:`DropinComponent` is a
``diffusers.ModelMixin`` (a ``torch.nn.Module`` without parameters: the weights live in the
exported ONNX model or TensorRT engine) that says, for each thing diffusers can do to a model,
whether a fixed exported graph can do it:

- **saved with the pipeline.** ``pipe.save_pretrained(DIR)`` calls :meth:`save_pretrained`,
  which writes ``DIR/transformer/`` through a staging folder renamed into place: the export's
  files (the ``.onnx`` with its external data and sidecar, or the ``.engine`` with its sidecar)
  copied (a copy-on-write clone where the file system has one, never a hard link: the saved
  folder does not change when the source is rewritten later), and ``qkrope_component.json``
  naming the model file. The folder is replaced whole, so it may hold only what a previous
  drop-in save wrote there (``qkrope_component.json`` and the files it lists) and the export's
  own files (a saved pipeline saved back into its own folder); any other file in it (the
  user's diffusers weights, notes) is refused in one line naming it, before the pipeline
  writes any component. What is saved is what the pipeline loaded: the export's identity is
  taken when the drop-in gets its runner (each file's stat and the sha256 its sidecar records,
  the sidecar's own bytes) and confirmed at save, before the pipeline writes any component and
  again around the copy (a file whose stat changed is hashed; ``QKROPE_VERIFY=full`` hashes the
  copies); a file rewritten or replaced since is refused in one line naming it and the fix,
  and so is an engine refitted in process since (``qkrope.apps.refit_live.refit_weights``: the
  file holds the build's weights, not the ones that ran; the line gives the ``qkrope refit``
  command that writes the refitted engine to a file to load and save).
  diffusers' save options are honoured or refused, never ignored: ``safe_serialization=True``
  (an export holds no pickle) is honoured, ``variant`` (an export has one variant, its own
  files and dtype), ``safe_serialization=False``, ``max_shard_size``, ``push_to_hub``,
  ``use_flashpack`` and any other option are refused in one line; loading, ``variant`` and
  the weight-file options are refused the same way. ``model_index.json`` records the
  component as ``["qkrope.runtime", <class>]`` (diffusers resolves it from the imported
  ``qkrope.runtime``, which offers the class and the ``ModelMixin`` its loader looks for
  there), so ``DiffusionPipeline.from_pretrained(DIR)`` (or
  the pipeline's own class) loads it back through :meth:`from_pretrained` with
  :func:`qkrope.runtime.load_transformer`. A drop-in whose files are gone is refused at save
  time, with how to pass ``transformer=`` instead.
- **``.to()``.** A device the runtime can feed (ONNX Runtime's CPU session: the CPU; its CUDA
  session or a TensorRT engine: their GPU) is honoured (the pipeline then makes its tensors
  there); the export's own dtype is a no-op; any other dtype, or a device the runtime cannot
  take, is refused at the call with the export's dtype and the re-export command (``half()``,
  ``float()``, ``bfloat16()``, ``cuda()``, ``cpu()`` and ``pipe.to(...)`` go through the
  same check). ``parameters()`` is empty: there are no torch parameters. ``pipe.to(...)``
  asks every drop-in of the pipeline first and moves nothing when one refuses.
- **the pipeline it is put in.** A drop-in assigned to a pipeline (its constructor,
  ``from_pretrained(..., transformer=...)``, ``pipe.transformer = ...``) whose signature names
  a transformer class of another family (the family registry) is refused in one line naming
  both families; its forward refuses another family's call arguments besides.
- **offloading.** ``enable_model_cpu_offload`` / ``enable_sequential_cpu_offload`` move
  PyTorch weights with accelerate's hooks, which need torch parameters: refused in one line
  before any component is touched, with what works (``pipe.enable_group_offload(...,
  exclude_modules=[name])``, which leaves the drop-in on its device).
- **LoRA and IP-Adapters.** ``load_lora_adapter``, ``fuse_lora``, ``add_adapter``,
  ``set_adapters``, ``unload_lora``, ... (diffusers' ``PeftAdapterMixin``, which the
  pipelines' ``load_lora_weights`` / ``fuse_lora`` / ``unload_lora_weights`` call) and
  ``_load_ip_adapter_weights`` (``load_ip_adapter``) are refused in one line with what
  works: fuse the LoRA into the PyTorch transformer, then ``qkrope.apps.refit_live.
  refit_weights`` (a ``--refit`` engine, in process) or re-export the fused model.
- **load_state_dict** is refused the same way (the drop-in has no torch parameters: torch's
  load would match nothing and report success); ``state_dict()`` is honestly empty.
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

import dataclasses
import functools
import inspect
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from qkrope._fileio import link_or_copy, sha256_file, staged_outputs, write_json_atomic
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
        if name == "_runner":  # the export as loaded: what save_pretrained confirms it saves
            self.__dict__["_identity"] = _take_identity(value)
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
        device = self._checked_to(device, dtype)
        if device is not None:
            self.device = device
        return self

    def _checked_to(self, device, dtype) -> torch.device | None:
        """The device ``.to(device, dtype)`` moves to (None: stays), or the one-line refusal;
        changes nothing (``pipe.to`` asks every drop-in before any component moves)."""
        if dtype is not None and dtype != self.dtype:
            raise ComponentError(
                f".to({dtype}): {self._what()} computes in {self.dtype}, fixed at export "
                f"(weights, inputs and outputs), so it cannot change dtype. Fix: "
                f"{_export_hint(dtype)}; or pass {self.dtype} for this component (pipelines: "
                f"from_pretrained(..., dtype={{'transformer': {self.dtype}, 'default': "
                f"{dtype}}}))")
        return self._checked_device(device) if device is not None else None

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

    # LoRA and IP-Adapters (diffusers' PeftAdapterMixin, which the pipelines' loaders call)
    def _refuse_adapters(self, call: str) -> None:
        raise ComponentError(
            f"{call}: LoRA and IP-Adapter weights patch the PyTorch transformer's layers; "
            f"{self._what()} has its weights fixed at export. Fix: load and fuse the LoRA on "
            f"the PyTorch transformer (pipe.load_lora_weights(...); pipe.fuse_lora()), then "
            f"refit a `qkrope build --refit` engine in process with qkrope.apps.refit_live."
            f"refit_weights(drop_in, fused_transformer), or save the fused transformer "
            f"(pipe.transformer.save_pretrained(DIR)) and re-export it (`qkrope export "
            f"--model transformer --diffusers DIR`)")

    def load_state_dict(self, state_dict: Any = None, *args, **kwargs):
        """Refused: the drop-in has no torch parameters to load into (its ``state_dict()`` is
        empty, honestly), so torch's load would match nothing and report success."""
        n = len(state_dict) if isinstance(state_dict, Mapping) else None
        raise ComponentError(
            f"load_state_dict({'a state dict of ' + str(n) + ' tensors' if n is not None else '...'}"
            f"): {self._what()} has its weights fixed at export and no torch parameters to "
            f"load into; nothing would be loaded. Fix: refit a `qkrope build --refit` engine in "
            f"process with qkrope.apps.refit_live.refit_weights(drop_in, state_dict), or load "
            f"the weights into the PyTorch transformer, save it (save_pretrained(DIR)) and "
            f"re-export it (`qkrope export --model transformer --diffusers DIR`)")

    def _load_from_state_dict(self, state_dict: Any, *args, **kwargs):
        # what torch.nn.Module.load_state_dict calls on each module (a parent module's load
        # included): the same refusal
        self.load_state_dict(state_dict)

    def load_lora_adapter(self, *args, **kwargs) -> None:
        self._refuse_adapters("load_lora_adapter (pipe.load_lora_weights)")

    def add_adapter(self, *args, **kwargs) -> None:
        self._refuse_adapters("add_adapter")

    def set_adapter(self, *args, **kwargs) -> None:
        self._refuse_adapters("set_adapter")

    def set_adapters(self, *args, **kwargs) -> None:
        self._refuse_adapters("set_adapters")

    def fuse_lora(self, *args, **kwargs) -> None:
        self._refuse_adapters("fuse_lora")

    def _fuse_lora_apply(self, *args, **kwargs) -> None:
        self._refuse_adapters("fuse_lora")

    def unfuse_lora(self, *args, **kwargs) -> None:
        self._refuse_adapters("unfuse_lora")

    def _unfuse_lora_apply(self, *args, **kwargs) -> None:
        self._refuse_adapters("unfuse_lora")

    def unload_lora(self, *args, **kwargs) -> None:
        self._refuse_adapters("unload_lora (pipe.unload_lora_weights)")

    def enable_lora(self, *args, **kwargs) -> None:
        self._refuse_adapters("enable_lora")

    def disable_lora(self, *args, **kwargs) -> None:
        self._refuse_adapters("disable_lora")

    def enable_adapters(self, *args, **kwargs) -> None:
        self._refuse_adapters("enable_adapters")

    def disable_adapters(self, *args, **kwargs) -> None:
        self._refuse_adapters("disable_adapters")

    def delete_adapters(self, *args, **kwargs) -> None:
        self._refuse_adapters("delete_adapters")

    def active_adapters(self, *args, **kwargs) -> None:
        self._refuse_adapters("active_adapters")

    def enable_lora_hotswap(self, *args, **kwargs) -> None:
        self._refuse_adapters("enable_lora_hotswap")

    def save_lora_adapter(self, *args, **kwargs) -> None:
        self._refuse_adapters("save_lora_adapter")

    def _load_ip_adapter_weights(self, *args, **kwargs) -> None:
        self._refuse_adapters("load_ip_adapter")

    @property
    def peft_config(self):
        """Refused: a drop-in holds no adapters (diffusers' get_list_adapters / set_adapters
        read it)."""
        self._refuse_adapters("peft_config (pipe.set_adapters, get_list_adapters)")

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
        runner = self.__dict__.get("_runner")
        path = Path(str(getattr(runner, "path", "") or ""))
        if runner is None or not path.name or not path.is_file():
            raise ComponentSaveError(
                f"cannot save {type(self).__name__}: its export {str(path) or '(unknown)'} is no "
                f"longer there to copy. Fix: save the pipeline without it and load with "
                f"from_pretrained(DIR, transformer=qkrope.runtime.load_transformer(PATH))")
        files = _files_of(path)
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise ComponentSaveError(
                f"cannot save {type(self).__name__}: {missing[0]} (beside its export) is "
                f"missing. Fix: save the pipeline without it and load with from_pretrained("
                f"DIR, transformer=qkrope.runtime.load_transformer(PATH))")
        return path, files

    def _confirmed_files(self) -> tuple[Path, list[Path], bytes, dict[Path, tuple]]:
        """The export's files, confirmed to be the ones the drop-in loaded (module docstring):
        (model, files, the sidecar's bytes now, {file: its stat now}); a ComponentSaveError
        naming the file that was rewritten or replaced since."""
        runner = self.__dict__.get("_runner")
        _refuse_refitted(type(self).__name__, runner)  # the file is not what ran
        model = Path(str(getattr(runner, "path", "") or ""))
        identity = self.__dict__.get("_identity")
        refuse = functools.partial(_rewritten, type(self).__name__, model)
        if identity is not None and model.is_file():  # the model first: it names the others
            if identity.model != model:
                refuse(model, f"the drop-in loaded {identity.model}")
            first = _confirm(model, *identity.files[model.name], refuse)
        try:
            model, files = self._export_files()  # gone or missing: its own message
        except ComponentSaveError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the ONNX reader says of the file
            refuse(model, f"it no longer reads as an ONNX model: {type(exc).__name__}")
        if identity is None:
            refuse(model, "it was not readable as an export when the drop-in was loaded")
        if [f.name for f in files] != list(identity.names):
            refuse(model, f"it now names the files {[f.name for f in files]}, at load "
                          f"{list(identity.names)}")
        sidecar = files[-1]
        try:
            now = sidecar.read_bytes()
        except OSError as exc:
            raise ComponentSaveError(f"cannot save {type(self).__name__}: cannot read {sidecar} "
                                     f"({exc.strerror or exc})") from None
        if now != identity.sidecar and _facts(now) != _facts(identity.sidecar):
            refuse(sidecar, "its facts differ from the ones the drop-in was loaded with")
        stats = {model: first}
        for f in files[1:-1]:
            stats[f] = _confirm(f, *identity.files[f.name], refuse)
        return model, files, now, stats

    def _check_target(self, target: Path) -> None:
        """The folder :meth:`save_pretrained` replaces whole holds nothing of the user's: only
        what a previous drop-in save wrote there (:data:`COMPONENT_FILE` and the files its
        record lists) and the files of the export being saved (its model, data and sidecar: a
        saved pipeline saved back into its own folder); else one ComponentSaveError naming the
        first files and the fix, before anything is written."""
        if not os.path.lexists(target):
            return
        what = f"cannot save {type(self).__name__} into {target}"
        if os.path.islink(target) or not os.path.isdir(target):
            from qkrope._fileio import file_kind

            kind = "a symbolic link" if os.path.islink(target) else file_kind(target) or "a file"
            raise ComponentSaveError(
                f"{what}: it is {kind}, not a folder, and the save would replace it. Fix: save "
                f"the pipeline into a new folder, or move {target} away")
        identity = self.__dict__.get("_identity")
        ours = {COMPONENT_FILE, *(identity.names if identity is not None else ())}
        ours.update(_recorded_files(target))
        try:
            others = sorted(n for n in os.listdir(target) if n not in ours)
        except OSError as exc:
            raise ComponentSaveError(f"{what}: it cannot be read ({exc.strerror or exc})") \
                from None
        if others:
            more = f" (+{len(others) - 4} more)" if len(others) > 4 else ""
            raise ComponentSaveError(
                f"{what}: it holds {', '.join(others[:4])}{more}, not written by a drop-in "
                f"save, and the save replaces that folder whole, which would delete them. Fix: "
                f"save the pipeline into a new folder, or move them away")

    def save_pretrained(self, save_directory: str | os.PathLike, *,
                        safe_serialization: bool = True, variant: str | None = None,
                        max_shard_size: int | str | None = None, push_to_hub: bool = False,
                        use_flashpack: bool = False, **kwargs) -> None:
        """``DIR/transformer/``: the export's files as loaded (copied: a copy-on-write clone
        where the file system has one) and :data:`COMPONENT_FILE`, written in a staging folder
        renamed into place; a folder there holding other files than a previous drop-in save's
        and the export's own is refused (:meth:`_check_target`). The files are confirmed to be the ones the drop-in loaded, before
        and after the copy; diffusers' save options are honoured or refused in one line
        (module docstring)."""
        self._check_save_options(safe_serialization=safe_serialization, variant=variant,
                                 max_shard_size=max_shard_size, push_to_hub=push_to_hub,
                                 use_flashpack=use_flashpack, **kwargs)
        target = Path(save_directory)
        model, files, sidecar_bytes, stats = self._confirmed_files()
        self._check_target(target)
        refuse = functools.partial(_rewritten, type(self).__name__, model)
        identity = self.__dict__["_identity"]
        runner = self._runner
        record = {
            "format": COMPONENT_FORMAT, "format_version": COMPONENT_FORMAT_VERSION,
            "class": type(self).__name__, "model": model.name,
            "files": [f.name for f in files], "backend": runner.backend,
            "dtype": str(self.dtype).removeprefix("torch."),
            "cuda_graph": bool(getattr(runner, "cuda_graph", False)),
        }
        full = _full_verify()
        try:
            with staged_outputs(target.parent, [target.name], flag="save_directory") as stage:
                out = stage.path(target.name)
                out.mkdir()
                for f in files[:-1]:
                    link_or_copy(f, out / f.name)  # a copy: never a link to the source
                    sha = identity.files[f.name][0]
                    try:
                        if _stat(f) != stats[f]:
                            refuse(f, "it changed while it was copied")
                        if full and sha is not None and sha256_file(out / f.name) != sha:
                            refuse(f, "its copy does not hash to the sha256 its sidecar "
                                      "records")
                    except ComponentSaveError as exc:  # not the staging's OS error
                        raise _Refused(exc) from None
                (out / files[-1].name).write_bytes(sidecar_bytes)  # the sidecar as confirmed
                write_json_atomic(out / COMPONENT_FILE, record)
                try:  # again right before the swap: a file put there meanwhile is kept
                    self._check_target(target)
                except ComponentSaveError as exc:
                    raise _Refused(exc) from None
                stage.commit([target.name])
        except _Refused as refused:
            raise refused.args[0] from None
        self.__dict__["_saved_to"] = target

    def _check_save_options(self, *, safe_serialization: Any = True, variant: Any = None,
                            max_shard_size: Any = None, push_to_hub: Any = False,
                            use_flashpack: Any = False, **kwargs) -> None:
        """diffusers' save options: honoured (``safe_serialization=True``: an export holds no
        pickle) or refused in one line, before anything is written."""
        what = f"save_pretrained: {self._what()}"
        if variant is not None:
            raise ComponentError(
                f"{what} has no variant {variant!r}: an export is one set of files in one dtype "
                f"({self.dtype}, fixed at export), which keep their names (its graph names its "
                f"data files). Fix: save without variant=, and save each exported dtype in its "
                f"own pipeline folder")
        if safe_serialization is not True:
            raise ComponentError(
                f"{what}: safe_serialization={safe_serialization!r} asks for pickled weights; an "
                f"export is saved as its own files and holds no pickle. Fix: drop "
                f"safe_serialization (or pass True)")
        for name, value, default in (("max_shard_size", max_shard_size, None),
                                     ("push_to_hub", push_to_hub, False),
                                     ("use_flashpack", use_flashpack, False)):
            if value is not default and value != default:
                raise ComponentError(
                    f"{what} cannot honour {name}={value!r}: an export is saved as the files it "
                    f"was exported to (no shards, no flashpack, no upload). Fix: drop {name}"
                    + ("; save to a folder and upload it with huggingface_hub's upload_folder"
                       if name == "push_to_hub" else ""))
        if kwargs:
            raise ComponentError(
                f"{what} takes no {', '.join(sorted(kwargs))}: its only options are "
                f"safe_serialization=True and variant=None (diffusers' other save options do not "
                f"apply to an export). Fix: drop {', '.join(sorted(kwargs))}")

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
        loading options are honoured where they mean nothing for an export
        (``low_cpu_mem_usage``, ``disable_mmap``, ``use_safetensors``: nothing is pickled) and
        refused in one line where they ask for what an export has not (``variant``,
        ``max_memory``, ``offload_folder``, ...; any option not at diffusers' default)."""
        from qkrope import runtime

        folder = Path(pretrained_model_name_or_path)
        record = _read_record(folder)
        _check_load_options(folder, _diffusers_options)
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


# --------------------------------------------------------------------------------------------
# the export's identity: taken when the drop-in gets its runner, confirmed at save
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Identity:
    """The export as the drop-in loaded it: the model file, the names of its files (sidecar
    last), per file the sha256 its sidecar records and its stat then, the sidecar's bytes."""

    model: Path
    names: tuple[str, ...]
    files: dict
    sidecar: bytes


#: set on a runner whose engine got weights in process (:func:`mark_refitted`)
_REFITTED = "_qkrope_refitted_in_process"


def mark_refitted(runner: Any) -> None:
    """Record that ``runner``'s engine now runs weights its file does not hold (an in-process
    refit, :func:`qkrope.apps.refit_live.refit_weights`, marks it before the engine changes):
    :meth:`DropinComponent.save_pretrained` then refuses to save the file as what ran."""
    setattr(runner, _REFITTED, True)


def _refuse_refitted(cls_name: str, runner: Any) -> None:
    """The one-line refusal to save a drop-in whose engine was refitted in process."""
    if not getattr(runner, _REFITTED, False):
        return
    path = str(getattr(runner, "path", "") or "M.engine")
    name = Path(path).name
    raise ComponentSaveError(
        f"cannot save {cls_name}: {path} was refitted in process (qkrope.apps.refit_live."
        f"refit_weights), so the pipeline ran weights the file does not hold (it has the "
        f"weights it was built with) and the saved folder would not hold the transformer that "
        f"ran. Fix: `qkrope refit {path} --diffusers FUSED_DIR -o REFITTED.engine` (FUSED_DIR: "
        f"the fused transformer saved with save_pretrained; or --state-dict FILE) writes the "
        f"refitted engine to a file; load that (pipe.transformer = qkrope.runtime."
        f"load_transformer('REFITTED.engine')) and save it ({name} itself is unchanged)")


class _Refused(Exception):
    """Carries a refusal out of the staging block (which reports OS errors as its own)."""


def _files_of(path: Path) -> list[Path]:
    """The model file, the files its graph reads beside it, its sidecar (last)."""
    from qkrope.sidecars import engine_sidecar_path, sidecar_path

    if path.suffix.lower() != ".onnx":  # an engine: its sidecar holds the drop-in's config
        return [path, engine_sidecar_path(path)]
    import onnx

    from .onnx_file import external_data_files

    model = onnx.load(str(path), load_external_data=False)
    return [path, *external_data_files(model, path), sidecar_path(path)]


def _stat(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


def _recorded_sha256(path: Path, sidecar: bytes) -> dict[str, str | None]:
    """{file name: the sha256 the sidecar records of it} (the sidecar's own reader)."""
    from qkrope.sidecars import EngineInfo, ModelInfo

    try:
        data = json.loads(sidecar)
    except ValueError:
        return {}
    if path.suffix.lower() == ".onnx":
        info = ModelInfo.from_dict(data, source=str(path))
        return {path.name: info.model_sha256,
                **{Path(k).name: r.sha256 for k, r in info.external_data.items()}}
    return {path.name: EngineInfo.from_dict(data, source=str(path)).engine_sha256}


def _take_identity(runner: Any) -> _Identity | None:
    """The identity of the export a runner ran, right after it was loaded (and checked against
    its sidecar); None for a runner without a local file (a server) or one not readable."""
    path = Path(str(getattr(runner, "path", "") or ""))
    if not path.name or not path.is_file():
        return None
    try:
        files = _files_of(path)
        sidecar = files[-1].read_bytes()
        try:
            recorded = _recorded_sha256(path, sidecar)
        except QkropeError:  # a sidecar its reader refuses: no sha256 to confirm with
            recorded = {}
        stats = {f.name: (recorded.get(f.name), _stat(f)) for f in files[:-1]}
    except Exception:  # noqa: BLE001 - not readable as an export now: save refuses it
        return None
    return _Identity(path, tuple(f.name for f in files), stats, sidecar)


def _facts(sidecar: bytes) -> Any:
    """A sidecar's JSON without the stat fields of its file records (size, mtime_ns, ino),
    which a reader refreshes when a copied file hashes right: what it states."""
    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            if {"sha256", "size", "mtime_ns", "ino"} == set(value):
                return value["sha256"]
            return {k: strip(v) for k, v in value.items()}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value
    try:
        return strip(json.loads(sidecar))
    except ValueError:
        return None


def _rewritten(cls_name: str, model: Path, path: Path, why: str):
    fix = (f"re-export it (`qkrope export --model transformer --diffusers DIR --out {model}`)"
           if model.suffix.lower() == ".onnx" else "rebuild it (`qkrope build`)")
    raise ComponentSaveError(
        f"cannot save {cls_name}: {path} was rewritten or replaced since the pipeline loaded "
        f"it ({why}), so the saved folder would not hold the transformer that ran. Fix: load "
        f"it again (pipe.transformer = qkrope.runtime.load_transformer('{model}')) and save "
        f"that, or {fix}")


def _confirm(path: Path, sha: str | None, at_load: tuple, refuse) -> tuple:
    """``path``'s stat now, when it is the file loaded: the same stat, else the sha256 its
    sidecar recorded; ``refuse(path, why)`` otherwise."""
    try:
        now = _stat(path)
    except OSError as exc:
        refuse(path, f"it cannot be read: {exc.strerror or exc}")
    if now == at_load:
        return now
    if sha is None:
        refuse(path, "its size, time or inode changed, and its sidecar records no sha256 to "
                     "confirm its content")
    digest = sha256_file(path)
    if _stat(path) != now:
        refuse(path, "it changed while it was hashed")
    if digest != sha:
        refuse(path, f"its sha256 is now {digest[:12]}…, the loaded file's {sha[:12]}…")
    return now


def _recorded_files(folder: Path) -> list[str]:
    """The file names a previous drop-in save's :data:`COMPONENT_FILE` in ``folder`` lists
    (plain names only; none when there is no readable record)."""
    try:
        record = json.loads((folder / COMPONENT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(record, Mapping) or record.get("format") != COMPONENT_FORMAT:
        return []
    names = record.get("files")
    if not isinstance(names, list):
        return []
    return [n for n in names if isinstance(n, str) and n and Path(n).name == n
            and n not in (".", "..")]


def _full_verify() -> bool:
    from qkrope.file_record import full_by_default

    return full_by_default()


def _call(args, kwargs) -> str:
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"({', '.join(parts)})"


def read_json_record(path: Path, *, missing: str, fix: str) -> Any:
    """The JSON value of a record file ``path``; :class:`ComponentLoadError` in one line where
    it is absent (``missing``, a clause, then ``fix``) or cannot be read or parsed."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ComponentLoadError(f"{missing}. {fix}") from None
    except (OSError, ValueError) as exc:
        raise ComponentLoadError(f"{path} cannot be read ({type(exc).__name__}). {fix}") from None


def _read_record(folder: Path) -> dict[str, Any]:
    path = folder / COMPONENT_FILE
    fix = ("Fix: save the pipeline again with pipe.save_pretrained, or pass "
           "transformer=qkrope.runtime.load_transformer(PATH) to from_pretrained")
    record = read_json_record(path, fix=fix, missing=f"{folder} has no {COMPONENT_FILE}, so it "
                                                     f"is not a saved qkrope drop-in")
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


#: diffusers' loading options that mean nothing for an export (any value is honoured)
_LOAD_HINTS = ("low_cpu_mem_usage", "disable_mmap", "use_safetensors")


def _check_load_options(folder: Path, options: Mapping[str, Any]) -> None:
    """diffusers' other loading options: a hint from :data:`_LOAD_HINTS`, or an option at
    diffusers' default (None / False); anything else is refused in one line."""
    asked = {k: v for k, v in options.items()
             if k not in _LOAD_HINTS and v is not None and v is not False}
    if not asked:
        return
    key, value = sorted(asked.items())[0]
    why = ("an export is one set of files in one dtype; a saved drop-in has no variants"
           if key == "variant" else
           "an exported transformer is one fixed graph the runtime loads whole")
    raise ComponentLoadError(
        f"{folder}: {key}={value!r} cannot apply to an exported transformer ({why}). Fix: drop "
        f"{key} for this component (or load the pipeline with transformer=qkrope.runtime."
        f"load_transformer(PATH))")


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


# --------------------------------------------------------------------------------------------
# the pipeline's side: what diffusers' DiffusionPipeline does to its components, asked of every
# drop-in first
# --------------------------------------------------------------------------------------------
def _dropins(pipe: Any) -> list[tuple[str, DropinComponent]]:
    """The pipeline's drop-in components, by attribute name."""
    return [(k, v) for k, v in vars(pipe).items() if isinstance(v, DropinComponent)]


def check_pipeline_family(dropin: DropinComponent, pipeline: type, name: str) -> None:
    """A drop-in put into ``pipeline`` as its component ``name``: refused in one line when the
    pipeline's signature names a transformer class of another family (the registry) than the
    export's. A pipeline whose signature names no family's class is not judged."""
    from qkrope import families

    record = dropin.__dict__.get("record")
    if record is None:
        return
    try:
        types = pipeline._get_signature_types().get(name, ())
    except Exception:  # noqa: BLE001 - a pipeline class diffusers cannot read: not judged
        return
    wanted = [r for r in (families.by_class(getattr(t, "__name__", None)) for t in types)
              if r is not None]
    if not wanted or record in wanted:
        return
    want = wanted[0]
    runner = dropin.__dict__.get("_runner")
    where = Path(str(getattr(runner, "path", "") or "")).name or "the export"
    raise ComponentError(
        f"{pipeline.__name__}.{name} takes a {want.short} transformer ({want.class_name}); "
        f"{where} is a {record.short} export ({record.class_name}), whose call the "
        f"{want.short} pipeline cannot make. Fix: load a {want.short} export (`qkrope export "
        f"--model transformer --diffusers` of a {want.class_name} folder) for {pipeline.__name__}"
        f", or run this export with a {record.short} pipeline"
        + (f" ({dropin.PIPELINES})" if getattr(dropin, "PIPELINES", "") else ""))


def _pipeline_to_args(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """(device, dtype) of ``DiffusionPipeline.to(*args, **kwargs)``, read as diffusers reads
    them (one positional: a dtype or a device; two: device, dtype)."""
    dtype, device = kwargs.get("dtype"), kwargs.get("device")
    if len(args) == 1:
        if isinstance(args[0], torch.dtype):
            dtype = dtype or args[0]
        else:
            device = device or args[0]
    elif len(args) == 2:
        device, dtype = device or args[0], dtype or args[1]
    return device, dtype


def _guard(name: str):
    """The wrapper of ``DiffusionPipeline.<name>`` that asks the pipeline's drop-ins first."""
    def check(pipe, args, kwargs):
        found = _dropins(pipe)
        if not found:
            return
        if name == "to":
            device, dtype = _pipeline_to_args(args, kwargs)
            for _, dropin in found:
                dropin._checked_to(device, dtype)
        elif name in ("enable_model_cpu_offload", "enable_sequential_cpu_offload"):
            key, dropin = found[0]
            raise ComponentError(
                f"{name}: accelerate's offload hooks move a component's torch parameters "
                f"between devices, and {dropin._what()} (pipe.{key}) has none: its weights "
                f"stay in the runtime's memory on {dropin.device}. Fix: offload the other "
                f"components with pipe.enable_group_offload(onload_device=..., "
                f"offload_type='leaf_level', exclude_modules={[k for k, _ in found]!r}), "
                f"which leaves the drop-in where it runs")
        elif name == "save_pretrained":
            try:
                bound = inspect.signature(_ORIGINAL[name]).bind(pipe, *args, **kwargs)
            except TypeError:  # diffusers' own error for a wrong call
                return
            options = {k: v for k, v in bound.arguments.items()
                       if k not in ("self", "save_directory", "kwargs")}
            folder = bound.arguments.get("save_directory")
            for key, dropin in found:
                dropin._check_save_options(**options)
                dropin._confirmed_files()  # before the pipeline writes any component
                if isinstance(folder, (str, os.PathLike)):  # where diffusers saves it
                    dropin._check_target(Path(folder) / key)

    original = _ORIGINAL[name]

    @functools.wraps(original)
    def guarded(self, *args, **kwargs):
        check(self, args, kwargs)
        return original(self, *args, **kwargs)
    return guarded


def _guarded_setattr(self, name: str, value: Any) -> None:
    if isinstance(value, DropinComponent):
        check_pipeline_family(value, type(self), name)
    _ORIGINAL["__setattr__"](self, name, value)


def _pipeline_class_of(folder: Any, base: type) -> type | None:
    """The pipeline class that ``folder``'s model_index.json names (``_class_name``), looked up
    by name on the diffusers module only (never imported from a path or a module the folder
    names); None where the folder is not a local pipeline folder or names no diffusers
    pipeline class (diffusers' own loader then decides, and the load is confirmed after)."""
    import diffusers

    try:
        index = Path(os.fspath(folder)) / "model_index.json"
        name = json.loads(index.read_text(encoding="utf-8")).get("_class_name")
    except (TypeError, OSError, ValueError, AttributeError):
        return None
    found = getattr(diffusers, name, None) if isinstance(name, str) and name.isidentifier() \
        else None
    if isinstance(found, type) and issubclass(found, base) and found is not base:
        return found
    return None


def _guarded_from_pretrained(cls, pretrained_model_name_or_path: Any = None, **kwargs):
    """``DiffusionPipeline.from_pretrained`` that keeps every drop-in it is given: called on
    the base class (whose optional components diffusers reads instead of the folder's
    pipeline's, so an optional transformer passed in is dropped and the PyTorch one loaded), it
    delegates to the folder's pipeline class; after loading, each passed drop-in must be the
    pipeline's component, else one line."""
    from diffusers import DiffusionPipeline

    passed = {k: v for k, v in kwargs.items() if isinstance(v, DropinComponent)}
    if passed and cls is DiffusionPipeline and kwargs.get("custom_pipeline") is None:
        target = _pipeline_class_of(pretrained_model_name_or_path, DiffusionPipeline)
        if target is not None:
            return target.from_pretrained(pretrained_model_name_or_path, **kwargs)
    pipe = _ORIGINAL["from_pretrained"].__func__(cls, pretrained_model_name_or_path, **kwargs)
    for key, dropin in passed.items():
        if getattr(pipe, key, None) is not dropin:
            raise ComponentLoadError(
                f"{type(pipe).__name__}.from_pretrained({str(pretrained_model_name_or_path)!r}"
                f", {key}=...): the pipeline did not take the {dropin._what()} passed as "
                f"{key!r} (its {key} is {type(getattr(pipe, key, None)).__name__}). Fix: "
                f"load with the folder's pipeline class (diffusers.<model_index.json "
                f"_class_name>.from_pretrained), or set it after loading: pipe.{key} = drop_in")
    return pipe


_ORIGINAL: dict[str, Any] = {}
_GUARDED = ("to", "enable_model_cpu_offload", "enable_sequential_cpu_offload",
            "save_pretrained")


def _install_pipeline_guards() -> None:
    """Once per process (the drop-in classes import this module): diffusers'
    ``DiffusionPipeline.to``, ``enable_model_cpu_offload``, ``enable_sequential_cpu_offload``
    and ``save_pretrained`` ask the pipeline's drop-ins before doing anything (a refusal
    leaves every component as it was, and writes nothing), and a drop-in put into a pipeline
    is checked against the pipeline's family. ``DiffusionPipeline.from_pretrained`` given a
    drop-in loads with the folder's pipeline class and confirms each drop-in was taken. A
    pipeline without a drop-in runs diffusers' code unchanged."""
    try:
        from diffusers import DiffusionPipeline
    except ImportError:  # pragma: no cover - no diffusers: no pipelines
        return
    if _ORIGINAL:
        return
    _ORIGINAL["__setattr__"] = DiffusionPipeline.__setattr__
    _ORIGINAL["from_pretrained"] = DiffusionPipeline.__dict__["from_pretrained"]
    for name in _GUARDED:
        _ORIGINAL[name] = getattr(DiffusionPipeline, name)
    DiffusionPipeline.__setattr__ = _guarded_setattr
    for name in _GUARDED:
        setattr(DiffusionPipeline, name, _guard(name))
    DiffusionPipeline.from_pretrained = classmethod(functools.wraps(
        _ORIGINAL["from_pretrained"].__func__)(_guarded_from_pretrained))


_install_pipeline_guards()


__all__ = ["COMPONENT_FILE", "ComponentError", "ComponentLoadError", "ComponentSaveError",
           "DropinComponent", "ModelMixin", "mark_refitted"]
