"""Load a saved diffusers transformer for the export, whatever its family: the folder checks
(config.json's class, the weight files, quantizer state), the family's own config check (its
export hook, :mod:`qkrope.families`), then diffusers' class, whole (:func:`load_transformer`) or
as the streamed export's placeholder skeleton (:func:`skeleton_transformer`). What makes a model
exportable (attention processors, the cache-input wrapper) is the family's export hook module,
``qkrope/families/<family>/export.py``.

diffusers is imported lazily (it is optional).
"""

from __future__ import annotations

import torch
from torch import nn

from qkrope import families
from qkrope.diffusers_weights import folder_family, transformer_folder as model_folder  # noqa: F401
from qkrope.errors import InputError
from qkrope._deps import require


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of a torch dtype."""
    return torch.empty((), dtype=dtype).element_size()


def _physical_memory() -> int | None:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits_in_memory(what: str, nbytes: int, fix: str) -> None:
    """An InputError when ``what`` needs more bytes than this machine has (torch would fail
    with an overflow, a MemoryError or the OOM killer instead); ``fix``: what to give instead."""
    memory = _physical_memory()
    if memory is not None and nbytes > memory:
        raise InputError(f"{what} needs {nbytes / 2**30:.3g} GiB, more than this machine's "
                         f"{memory / 2**30:.3g} GiB of memory. Fix: {fix}")


def read_config(directory: str, model_class=None) -> tuple[str, dict]:
    """``(path, config)``: ``directory``'s config.json for a family's ``check_config`` hook,
    refused in one line where it is not readable JSON or not a JSON object; with
    ``model_class``, its ``__init__`` defaults fill in what the file omits (the config diffusers
    would build the model from)."""
    import inspect
    import json
    import os

    path = os.path.join(directory, "config.json")
    fix = f"Fix: save the model again with save_pretrained, or correct {path}"
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InputError(f"{path} is not readable JSON ({type(exc).__name__}). {fix}") from None
    if not isinstance(raw, dict):
        raise InputError(f"{path} holds a JSON {type(raw).__name__}, not the object of a "
                         f"model's config. {fix}")
    if model_class is None:
        return path, raw
    defaults = {name: p.default for name, p in
                inspect.signature(model_class.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    return path, {**defaults, **raw}


def _checked_folder(directory: str, quant: str | None, variant: str | None):
    """``(folder, family)``: the folder with config.json (``directory`` or its
    ``transformer/``), its family, its weight files (one file, or every shard its index names
    and no other) and quantizer state checked."""
    from qkrope.diffusers_weights import weight_files
    from qkrope.quantization import check_folder

    family = folder_family(directory)
    directory = model_folder(directory)
    weight_files(directory, variant=variant)  # a missing or extra shard: said before loading
    check_folder(directory, quant)  # before loading: diffusers would drop quantizer tensors
    return directory, family


def load_transformer(directory: str, *, dtype: torch.dtype = torch.float32,
                     quant: str | None = None, variant: str | None = None) -> nn.Module:
    """``<class>.from_pretrained(directory, variant=variant)`` for the diffusers class its
    config.json names (a family of :mod:`qkrope.families`), local files only; the weight files
    (one file, or every shard its index names and no other) are checked first (:func:`qkrope.diffusers_weights.weight_files`).

    A folder carrying ModelOpt quantizer state is refused unless ``quant`` says how to export it
    (:func:`qkrope.quantization.check_folder`); with ``quant="fp8"`` the quantizers are restored
    with ModelOpt (:func:`qkrope.export.quantize.restore_quantized`)."""
    diffusers = require("diffusers", "exporting a diffusers transformer (--model transformer)")
    directory, family = _checked_folder(directory, quant, variant)
    families.hooks(family, "export").check_config(directory, getattr(diffusers, family.class_name),
                                                  dtype)
    # diffusers advises installing `accelerate` on every load; that is not an error here.
    verbosity = diffusers.utils.logging.get_verbosity()
    diffusers.utils.logging.set_verbosity_error()
    from qkrope.diffusers_weights import ShardChangedError, unchanged_while_read, weight_files

    try:
        with unchanged_while_read(weight_files(directory, variant=variant)[0]):  # not re-saved
            model = getattr(diffusers, family.class_name).from_pretrained(
                directory, torch_dtype=dtype, local_files_only=True, variant=variant)
    except ShardChangedError:
        raise
    except (RuntimeError, ValueError, TypeError, AssertionError, OSError) as exc:
        # weights of other shapes than the config says (size mismatch), a config diffusers
        # refuses: the folder's own inconsistency, said in one line
        text = " ".join(str(exc).split())
        raise InputError(f"--diffusers {directory} cannot be loaded as its config.json "
                         f"describes it ({type(exc).__name__}: "
                         f"{text[:200] + '...' if len(text) > 200 else text}). Fix: save the "
                         f"model again with save_pretrained") from None
    finally:
        diffusers.utils.logging.set_verbosity(verbosity)
    if quant is not None:
        from .quantize import restore_quantized

        model = restore_quantized(model, directory)
    return model.eval()


def skeleton_transformer(directory: str, *, dtype: torch.dtype = torch.float32,
                         quant: str | None = None, variant: str | None = None):
    """What the streamed export traces and writes: ``(transformer, weights)``, the
    diffusers transformer of ``directory``'s config.json (its family's class) with placeholder
    parameters
    (:func:`qkrope.export.streaming.placeholder_module`; nothing of the weights in memory) and
    the :class:`~qkrope.export.streaming.DiskWeights` of its state dict, every key checked
    against the shards' headers. The folder checks are :func:`load_transformer`'s; with
    ``quant="fp8"`` the quantizers are restored (their calibrated amax read, nothing else)."""
    from qkrope.diffusers_weights import tensor_headers
    from qkrope.quantization import QUANTIZER_MARK

    from .streaming import DiskWeights, SizeError, check_config_sizes, placeholder_module

    diffusers = require("diffusers", "exporting a diffusers transformer (--model transformer)")
    directory, family = _checked_folder(directory, quant, variant)
    cls = getattr(diffusers, family.class_name)
    families.hooks(family, "export").check_config(directory, cls, dtype,
                                                  memory=False)  # the weights stay on disk
    headers = tensor_headers(directory, variant=variant)  # sizes from the files, first
    source = f"--diffusers {directory}"
    verbosity = diffusers.utils.logging.get_verbosity()
    diffusers.utils.logging.set_verbosity_error()
    try:
        config = cls.load_config(directory, local_files_only=True)
        check_config_sizes(config, headers, source=source)
        model = placeholder_module(lambda: cls.from_config(config), dtype=dtype,
                                   keep_in_fp32=cls._keep_in_fp32_modules or (),
                                   within=headers, source=source)
    except SizeError:
        raise
    except (RuntimeError, ValueError, TypeError, OverflowError, AssertionError) as exc:
        # sizes torch cannot allocate even as placeholders, a config diffusers refuses
        text = " ".join(str(exc).split()).split(" Exception raised from")[0]
        raise InputError(f"--diffusers {directory}: the model its config.json describes cannot "
                         f"be built ({type(exc).__name__}: "
                         f"{text[:160] + '...' if len(text) > 160 else text}). Fix: check its "
                         f"sizes (num_layers, num_attention_heads, attention_head_dim, the "
                         f"channels), or save the model again with save_pretrained") from None
    finally:
        diffusers.utils.logging.set_verbosity(verbosity)
    if quant is not None:
        from .quantize import restore_quantized

        model = restore_quantized(model, directory, headers=headers)
    weights = DiskWeights.for_module(model, headers, source=f"--diffusers {directory}",
                                     skip=lambda key: QUANTIZER_MARK in key)
    return model.eval(), weights
