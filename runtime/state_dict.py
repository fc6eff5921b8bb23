"""Reading one weights file keyed by diffusers parameter name (``qkrope refit --state-dict``,
``qkrope export --weights``): a safetensors file (by its content, whatever the suffix's case) or
a torch-saved state dict, loaded with ``weights_only=True`` (no pickled code runs). What is not a
state dict of tensors (a pickle of other objects, a single tensor, a training checkpoint, a text
file, a corrupt file) is one line saying what the file is and how to save a state dict; torch's
own advice to load with ``weights_only=False`` is never passed on."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, Callable, Mapping

from qkrope._fileio import file_kind
from qkrope.errors import InputError, InputFileNotFoundError

SAVE_HINT = ("Fix: save the weights as a state dict: safetensors.torch.save_file("
             "model.state_dict(), 'weights.safetensors') (or torch.save(model.state_dict(), "
             "'weights.pt'))")


def model_folder_files(folder: str | os.PathLike) -> list[Path]:
    """The files a diffusers model folder is read from (weights, index and config files, also in
    its ``transformer/`` subfolder, and every file a weight index names, whatever its name):
    what a writer must not write over."""
    from qkrope.diffusers_weights import listed_files

    d = Path(folder)
    return [p for pattern in ("*.safetensors", "*.json", "*.bin", "*.pt", "*.pth")
            for p in (*d.glob(pattern), *d.glob(f"transformer/{pattern}"))] + listed_files(d)


def looks_like_safetensors(path: str | os.PathLike) -> bool:
    """A safetensors file starts with its JSON header's length (little-endian u64), then '{'."""
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) < 9 or head[8:9] != b"{":
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 2 <= n <= os.path.getsize(path) - 8


def read_state_dict_file(path: str | os.PathLike, *, what: str = "--state-dict",
                         error: Callable[[str], Exception] = InputError) -> dict:
    """``{key: tensor}`` of one weights file, or ``error(one line)``: what the file is and
    :data:`SAVE_HINT`."""
    import torch

    p = Path(path)
    if not p.is_file():
        raise InputFileNotFoundError(f"{what} {p} does not exist")
    where = f"{what} {p}"
    if p.suffix.lower() == ".safetensors" or looks_like_safetensors(p):
        from qkrope._deps import require

        st = require("safetensors.torch", "reading *.safetensors weights")
        try:
            return dict(st.load_file(str(p)))
        except Exception as exc:  # noqa: BLE001 - SafetensorError and OSError: not readable
            first = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
            raise error(f"{where} is not a readable safetensors file (truncated or corrupt: "
                        f"{first}). {SAVE_HINT}") from None
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - every torch.load failure: not a state dict
        raise error(f"{where} is not a state dict: {_what_failed(p, exc)}. {SAVE_HINT}") from None
    if isinstance(state, torch.Tensor):
        raise error(f"{where} holds a single tensor {list(state.shape)}, not a state dict "
                    f"(a mapping of parameter names to tensors). {SAVE_HINT}")
    if not isinstance(state, dict):
        raise error(f"{where} holds a {type(state).__name__}, not a state dict (a mapping of "
                    f"parameter names to tensors). {SAVE_HINT}")
    bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad:
        nested = [k for k in bad if isinstance(state[k], dict)]
        hint = (f" (a checkpoint? its {nested[0]!r} entry is a dict: save that one)"
                if nested else "")
        raise error(f"{where} is a dict whose entries {bad[:4]} are not tensors "
                    f"({type(state[bad[0]]).__name__}){hint}. {SAVE_HINT}")
    return state


def unusable_tensor(key: str, value: Any) -> str | None:
    """Why the tensor ``value`` (state-dict entry ``key``) cannot be read as weights, with the
    fix, or None: a nested tensor, a tensor without values (the meta device), a layout other than
    a dense one (sparse), a quantised or complex tensor, or a float8 one (its scale is kept elsewhere).
    Not a tensor: None (the callers name that themselves)."""
    import torch

    if not isinstance(value, torch.Tensor):
        return None
    if getattr(value, "is_nested", False):  # before any read of its shape (it has none)
        return (f"{key} is a nested tensor (a list of tensors of differing shapes); weights "
                f"are dense tensors of one shape. Fix: pass the dense weight (e.g. "
                f"nested.unbind()[0])")
    if value.device.type == "meta":
        return (f"{key} is a meta tensor {list(value.shape)} (shape only, no values: a model "
                f"built with init_empty_weights or loaded with device_map='meta'). Fix: load "
                f"the weights themselves and pass those")
    if value.layout != torch.strided:
        return (f"{key} is a {str(value.layout).removeprefix('torch.')} tensor; weights are "
                f"dense. Fix: pass tensor.to_dense()")
    if value.is_quantized or value.is_complex():
        return (f"{key} is a {str(value.dtype).removeprefix('torch.')} tensor; weights are "
                f"real floats. Fix: pass the model's float weights (bf16, fp16 or fp32)")
    if value.is_floating_point() and value.element_size() == 1:
        return (f"{key} is {str(value.dtype).removeprefix('torch.')} (a quantised weight whose "
                f"scale is kept elsewhere). Fix: pass the model's bf16/fp16/fp32 weights (FP8: "
                f"`qkrope quantize`, then export and build again)")
    return None


def refuse_unusable_tensors(state: Mapping[str, Any], *, source: str,
                            error: Callable[[str], Exception] = InputError) -> None:
    """``error(one line)`` for the first entry of ``state`` :func:`unusable_tensor` refuses."""
    for key, value in state.items():
        why = unusable_tensor(str(key), value)
        if why is not None:
            raise error(f"{source}: {why}")


def _what_failed(p: Path, exc: Exception) -> str:
    """What a file torch.load refused is, without torch's advice."""
    import pickle

    kind = file_kind(p)
    if kind is not None:
        return f"it is {kind}"
    with open(p, "rb") as f:
        head = f.read(4)
    zipped = head == b"PK\x03\x04"  # torch.save's zip archive
    pickled = len(head) > 1 and head[0] == 0x80 and 2 <= head[1] <= 5  # a pickle's PROTO opcode
    if (zipped or pickled) and isinstance(exc, pickle.UnpicklingError) \
            and "Weights only load failed" in str(exc):
        return ("it is a pickle of Python objects other than tensors, which loading with "
                "weights_only=True refuses (their code would run)")
    if zipped:
        return "a torch zip archive that cannot be read (truncated or corrupt)"
    return f"neither a torch-saved file nor a safetensors file ({type(exc).__name__})"
