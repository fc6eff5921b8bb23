"""The weight files of a saved diffusers model folder, as diffusers itself finds them.

``save_pretrained`` writes one ``diffusion_pytorch_model.safetensors``, or, above its shard
size (the real 20B Qwen-Image transformer), shards ``diffusion_pytorch_model-0000N-of-0000M
.safetensors`` plus an index ``diffusion_pytorch_model.safetensors.index.json`` whose
``weight_map`` names the shard of every key; ``variant="fp16"`` puts the variant before the
last suffix (``diffusion_pytorch_model.fp16.safetensors``, ``...fp16-00001-of-00004.safetensors``,
``...safetensors.index.fp16.json``). The files are taken from the index, never by a glob: a shard
the index names that is missing, a shard on disk the index does not name (left from another
save), or a key in the wrong shard is an error naming it. Used by ``qkrope export`` (which
reads the shards' headers with :func:`tensor_headers`, then one tensor at a time with
:func:`read_tensor`) and ``qkrope refit`` (which reads the tensors itself).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Iterable

from qkrope.errors import InputFileNotFoundError, QkropeError

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
_SHARD = re.compile(r"-\d{5}-of-\d{5}\.safetensors$")


class DiffusersWeightsError(QkropeError, ValueError):
    """A diffusers folder's weight files are incomplete or do not match their index."""


def with_variant(name: str, variant: str | None) -> str:
    """diffusers' naming of a variant file: the variant before the last suffix."""
    if not variant:
        return name
    head, _, last = name.rpartition(".")
    return f"{head}.{variant}.{last}"


def model_folder(folder: str | os.PathLike) -> Path:
    """The folder of the model's weights: ``folder`` itself, or its ``transformer/`` subfolder
    for a pipeline folder (no config.json and no weights of its own)."""
    d = Path(folder)
    if not d.is_dir():
        raise InputFileNotFoundError(f"{d} is not a folder. Fix: pass the folder of a saved "
                                     f"diffusers transformer (or of its pipeline)")
    if (not (d / "config.json").is_file() and (d / "transformer").is_dir()
            and not any(d.glob("diffusion_pytorch_model*"))):
        return d / "transformer"
    return d


def _variants_present(d: Path) -> list[str]:
    found = set()
    for p in d.glob("diffusion_pytorch_model.*"):
        m = re.fullmatch(r"diffusion_pytorch_model\.safetensors\.index\.([^.]+)\.json", p.name) \
            or re.fullmatch(r"diffusion_pytorch_model\.([^.-]+)(?:-\d{5}-of-\d{5})?\.safetensors",
                            p.name)
        if m:
            found.add(m.group(1))
    return sorted(found)


def read_weight_map(index: Path, what: str = "weight index") -> dict[str, str]:
    """The key -> shard file map of a safetensors index file (``save_pretrained``'s
    ``*.safetensors.index.json``); one line where the file is not one."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        raise DiffusersWeightsError(
            f"{index} is not a {what} (a JSON object whose 'weight_map' maps every key to its "
            f"shard file). Fix: save the model again with save_pretrained") from None
    return weight_map


def weight_files(folder: str | os.PathLike, *, variant: str | None = None,
                 other_source: str | None = None) -> tuple[list[Path], dict[str, str] | None]:
    """``(the safetensors files, the index's key -> shard map or None)`` of a saved diffusers
    model (``folder`` or its ``transformer/``), for ``variant`` (None: the default weights).
    ``other_source``: the calling command's own way to give the weights otherwise (``qkrope
    refit``: "pass --state-dict FILE"), offered when the folder has none; each command's
    errors name only its own flags."""
    d = model_folder(folder)
    index = d / with_variant(INDEX_NAME, variant)
    single = d / with_variant(WEIGHTS_NAME, variant)
    what = f"variant {variant!r} " if variant else ""
    if index.is_file():
        weight_map = read_weight_map(index, "diffusers weight index")
        shards = sorted(set(weight_map.values()))
        bad = [s for s in shards if Path(s).name != s]
        if bad:
            raise DiffusersWeightsError(f"{index} names shard files outside its folder: "
                                        f"{bad[:4]}. Fix: save the model again with "
                                        f"save_pretrained")
        for s in shards:
            check_regular_file(d / s, what=f"the shard {s} its index {index.name} lists")
        missing = [s for s in shards if not (d / s).is_file()]
        if missing:
            raise DiffusersWeightsError(
                f"{d} lacks {len(missing)} of the {len(shards)} shard(s) its index "
                f"{index.name} lists: {', '.join(missing[:6])}. Fix: copy the whole model folder "
                f"(every shard) or download it again")
        prefix = with_variant("diffusion_pytorch_model.x", variant)[:-2]
        on_disk = {p.name for p in d.glob(f"{prefix}-*-of-*.safetensors") if _SHARD.search(p.name)}
        extra = sorted(on_disk - set(shards))
        if extra:
            raise DiffusersWeightsError(
                f"{d} holds shard(s) its index {index.name} does not list: "
                f"{', '.join(extra[:6])} (left from another save?). Fix: remove them, or save "
                f"the model again into an empty folder")
        for s in shards:
            check_complete(d / s)
        return [d / s for s in shards], dict(weight_map)
    check_regular_file(single, what="the weights file")
    if single.is_file():
        check_complete(single)
        return [single], None
    shards = sorted(p.name for p in d.glob(with_variant("diffusion_pytorch_model.x", variant)[:-2]
                                          + "-*-of-*.safetensors"))
    if shards:
        raise DiffusersWeightsError(
            f"{d} holds {what}shards ({', '.join(shards[:3])}...) but no index {index.name} "
            f"naming the shard of every key. Fix: copy the index file too, or save the model "
            f"again with save_pretrained")
    others = [v for v in _variants_present(d) if v != variant]
    if variant:
        has_default = (d / WEIGHTS_NAME).is_file() or (d / INDEX_NAME).is_file()
        held = (["the default weights"] if has_default else []) + [f"variant {v!r}" for v in others]
        hint = f" It holds {', '.join(held) or 'no weights'}."
    else:
        hint = (f" It holds the variant(s) {', '.join(others)}: pass --variant {others[0]}."
                if others else "")
    raise DiffusersWeightsError(
        f"{d} has no {what}weights ({single.name} or {index.name}).{hint} Fix: save the model "
        f"with save_pretrained(..., safe_serialization=True)"
        + (f", pass the --variant it was saved with, or {other_source}" if other_source
           else " or pass the --variant it was saved with"))


def listed_files(folder: str | os.PathLike) -> list[Path]:
    """Every file a weight index in ``folder`` (or its ``transformer/``) names, whatever its
    name (``m.onnx`` too): inputs of any command that reads the folder, which no output may
    replace. A malformed index names nothing here (its reader says what is wrong)."""
    out = []
    for d in (Path(folder), Path(folder) / "transformer"):
        for index in d.glob("diffusion_pytorch_model.safetensors.index*.json"):
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                names = {v for v in weight_map.values() if isinstance(v, str)}
            except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
                continue
            out += [d / n for n in sorted(names) if n and Path(n).name == n]
    return out


#: config.json fields that are sizes (diffusers' naming: num_layers, attention_head_dim,
#: in_channels, patch_size, axes_dims_rope, ...)
_SIZE_FIELD = re.compile(r"num_\w+|\w+_(dim|dims|channels|size)|\w+_dims_\w+")


def check_reference_config(folder: str | os.PathLike, recorded: dict | None, *,
                           source: str, flag: str = "--diffusers") -> dict:
    """A reference folder's ``config.json`` (``folder`` or its ``transformer/``) before anything
    is built from it: readable JSON, an object, and, where the export recorded the config it
    was made from (``recorded``, the sidecar's ``diffusers_config``), the same value for every
    field both have (another width, a field such as ``num_layers: "two"``): one line naming the
    field, both values and the fix. Returns the folder's config."""
    d = model_folder(folder)
    path = d / "config.json"
    fix = f"Fix: pass {flag} with the folder the model was exported from"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise DiffusersWeightsError(f"{flag} {folder}: {path} is not readable JSON "
                                    f"({type(exc).__name__}). {fix}") from None
    if not isinstance(config, dict):
        raise DiffusersWeightsError(f"{flag} {folder}: {path} holds a JSON "
                                    f"{type(config).__name__}, not a model's config. {fix}")
    for k, v in config.items():  # sizes are integers (or lists of them, or null)
        if not _SIZE_FIELD.fullmatch(k) or v is None:
            continue
        items = v if isinstance(v, list) else [v]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
            raise DiffusersWeightsError(f"{flag} {folder}: {path} has {k} = "
                                        f"{json.dumps(v)[:60]}, not a size (a non-negative "
                                        f"integer{' list' if isinstance(v, list) else ''}). "
                                        f"Fix: correct {path}, or pass {flag} with the folder "
                                        f"the model was exported from")
    if recorded:
        def norm(v):
            return json.loads(json.dumps(v))  # tuples as lists, as config.json holds them

        differ = [k for k in sorted(set(config) & set(recorded))
                  if not k.startswith("_") and norm(config[k]) != norm(recorded[k])]
        if differ:
            k = differ[0]
            more = f" (and {len(differ) - 1} more field(s))" if len(differ) > 1 else ""
            raise DiffusersWeightsError(
                f"{flag} {folder}: its config.json has {k} = {json.dumps(config[k])[:60]}, the "
                f"export ({source}) was made from {k} = {json.dumps(recorded[k])[:60]}{more}: "
                f"another model. {fix}")
    return config


def check_regular_file(path: Path, *, what: str) -> None:
    """A :class:`DiffusersWeightsError` (one line) when ``path`` exists as a name but is no
    readable regular file: a symbolic link loop, a link to nothing, a folder or a device. A
    missing name is left to the caller (its own message)."""
    if not os.path.lexists(path):
        return
    try:
        st = os.stat(path)
    except OSError as exc:
        import errno

        if exc.errno == errno.ELOOP:
            found = "a symbolic link loop"
        elif exc.errno == errno.ENOENT:
            found = f"a symbolic link to {os.readlink(path)!r}, which does not exist"
        else:
            found = f"unreadable ({exc.strerror})"
        raise DiffusersWeightsError(f"{path} ({what}) is {found}, not a file. Fix: replace it "
                                    f"with the real file (copy the model folder again)") from None
    import stat as stat_module

    if not stat_module.S_ISREG(st.st_mode):
        raise DiffusersWeightsError(f"{path} ({what}) is not a regular file (a folder, a device "
                                    f"or a pipe). Fix: replace it with the real file")


def _entry(key: str, entry, data_size: int) -> tuple[str, tuple[int, ...], int, int]:
    """One safetensors header entry checked: ``(dtype, shape, start, end)`` with the byte
    range inside the data (``data_size`` bytes) and, for a dtype of known size, exactly the
    bytes its shape and dtype need. ValueError (the reason, one line) otherwise."""
    import math

    if not isinstance(entry, dict):
        raise ValueError(f"{key}'s entry is not an object")
    offsets, shape, dtype = entry.get("data_offsets"), entry.get("shape"), entry.get("dtype")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in offsets)):
        raise ValueError(f"{key}'s data_offsets {offsets!r} are not two integers")
    if (not isinstance(shape, list)
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in shape)):
        raise ValueError(f"{key}'s shape {shape!r} is not a list of sizes")
    if not isinstance(dtype, str):
        raise ValueError(f"{key}'s dtype {dtype!r} is not a name")
    start, end = offsets
    if not 0 <= start <= end <= data_size:
        raise ValueError(f"{key}'s data [{start}, {end}) lies outside the file's "
                         f"{data_size} data bytes")
    itemsize = DTYPE_SIZES.get(dtype)
    if itemsize is not None and math.prod(shape) * itemsize != end - start:
        raise ValueError(f"{key}'s byte range [{start}, {end}) holds {end - start} bytes, its "
                         f"shape {shape} of {dtype} needs {math.prod(shape) * itemsize}")
    return dtype, tuple(shape), start, end


def check_complete(path: Path) -> None:
    """A :class:`DiffusersWeightsError` unless ``path`` is a whole safetensors file: its header
    (8-byte little-endian length, then JSON) readable and the file as long as the header's
    largest ``data_offsets`` end says (a truncated copy or download is named before anything
    loads it). Only the header is read."""
    fix = ("Fix: copy or download that file again, or save the model again with "
           "save_pretrained")
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 2 <= n <= size - 8:
                raise ValueError
            header = json.loads(f.read(n))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError,
            RecursionError):
        raise DiffusersWeightsError(f"{path} is not a safetensors file (no readable header: "
                                    f"truncated or corrupt). {fix}") from None
    need = 8 + n + max(ends, default=0)
    if size < need:
        raise DiffusersWeightsError(f"{path} is truncated: it holds {size} bytes, its header "
                                    f"describes {need}. {fix}")
    for key, entry in header.items():  # every reader refuses a range its shape disagrees with
        if key != "__metadata__":
            try:
                _entry(key, entry, size - 8 - n)
            except ValueError as exc:
                raise DiffusersWeightsError(f"{path} has a corrupt header: {exc}. "
                                            f"{fix}") from None


def load_state_dict(folder: str | os.PathLike, *, variant: str | None = None,
                    reader: Callable[[Path], dict] | None = None,
                    other_source: str | None = None) -> dict:
    """Every tensor of the folder's weights by key (torch tensors), each key from the shard the
    index names for it. ``reader`` reads one weights file (default: safetensors' ``load_file``;
    ``qkrope refit`` passes the reader that says in one line what a corrupt shard is;
    ``other_source``: as for :func:`weight_files`)."""
    if reader is None:
        from safetensors.torch import load_file

        def reader(f: Path) -> dict:
            return load_file(str(f))

    files, weight_map = weight_files(folder, variant=variant, other_source=other_source)
    out: dict = {}
    for f in files:
        with unchanged_while_read([f]):
            tensors = reader(f)
        if weight_map is not None:
            _check_listed(f, set(tensors), weight_map)
        out.update(tensors)
    return out


#: bytes per element of safetensors' dtypes
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8,
               "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8}
#: safetensors' dtype names -> torch's (the types a diffusers checkpoint holds)
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


@dataclass(frozen=True)
class TensorHeader:
    """Where one tensor of a folder's weights is and what its header says (nothing read)."""

    key: str
    file: Path
    dtype: str  # torch's name: "bfloat16", "float32", ...
    shape: tuple[int, ...]
    start: int  # the tensor's bytes in ``file``: [start, end)
    end: int
    #: ``file``'s (size, mtime_ns, inode) when the header was read (:func:`identity`)
    ident: tuple[int, int, int] | None = None

    @property
    def is_floating_point(self) -> bool:
        return self.dtype.startswith(("float", "bfloat"))


def identity(st: os.stat_result) -> tuple[int, int, int]:
    """What says a file is the one that was read: (size, mtime_ns, inode). A re-save (a rename
    over it: new inode; a rewrite in place: new mtime or size) changes it."""
    return int(st.st_size), int(st.st_mtime_ns), int(st.st_ino)


class ShardChangedError(DiffusersWeightsError):
    """A weights file changed between the reading of its header and of its data."""


def shard_changed(path: Path, when: str) -> ShardChangedError:
    return ShardChangedError(f"{path} changed {when} (its size, mtime or inode is not the one "
                             f"recorded when its header was read): it was re-saved or replaced "
                             f"meanwhile, and nothing was written. Fix: run the command again "
                             f"once nothing writes the model folder")


def confirm_identity(path: Path, ident: tuple[int, int, int] | None, when: str,
                     fd: int | None = None) -> None:
    """:class:`ShardChangedError` unless ``path`` (and the open ``fd`` of it) still has the
    identity ``ident`` (None: not recorded, nothing checked)."""
    if ident is None:
        return
    try:
        now = [identity(os.stat(path))] + ([identity(os.fstat(fd))] if fd is not None else [])
    except OSError:
        raise shard_changed(path, when) from None
    if any(i != ident for i in now):
        raise shard_changed(path, when)


@contextlib.contextmanager
def unchanged_while_read(files: Iterable[Path], *, what: str = "while it was read"):
    """Record the identity of ``files`` on entry and confirm it on exit: a file re-saved while
    the block read it is a :class:`ShardChangedError` naming it (for readers that load whole
    files through another library, e.g. ``from_pretrained``)."""
    before = {}
    for f in files:
        try:
            before[Path(f)] = identity(os.stat(f))
        except OSError:
            continue  # a missing file is its reader's error
    yield
    for f, ident in before.items():
        confirm_identity(f, ident, what)


def _read_header(f: Path) -> dict[str, TensorHeader]:
    """A safetensors file's header (a little-endian u64 length, then that many bytes of JSON:
    each key's dtype, shape and data offsets after the header), each entry checked
    (:func:`_entry`), with the file's identity at that moment."""
    import struct

    with open(f, "rb") as fh:
        st = os.fstat(fh.fileno())
        size = st.st_size
        head = fh.read(8)
        (n,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
        if n is None or not 2 <= n <= size - 8:
            raise ValueError(f"a header length of {n} in a file of {size} bytes")
        meta = json.loads(fh.read(n))
        if identity(os.fstat(fh.fileno())) != identity(st):
            raise ValueError("the file changed while its header was read")
    if not isinstance(meta, dict):
        raise ValueError("the header is not a JSON object")
    base = 8 + n
    out = {}
    for key, entry in meta.items():
        if key == "__metadata__":
            continue
        dtype, shape, start, end = _entry(key, entry, size - base)
        out[key] = TensorHeader(key, f, SAFETENSORS_DTYPES.get(dtype, dtype.lower()), shape,
                                base + start, base + end, identity(st))
    return out


def tensor_headers(folder: str | os.PathLike, *, variant: str | None = None
                   ) -> dict[str, TensorHeader]:
    """Every tensor of the folder's weights by key, from the safetensors headers alone (no tensor
    data is read): its shard, dtype, shape and place. The shards are those the index names
    (:func:`weight_files`) and each must hold exactly the keys the index lists for it."""
    files, weight_map = weight_files(folder, variant=variant)
    out: dict[str, TensorHeader] = {}
    for f in files:
        try:
            heads = _read_header(f)
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            first = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
            raise DiffusersWeightsError(f"{f} is not a readable safetensors file (truncated or "
                                        f"corrupt: {first}). Fix: copy or save the model "
                                        f"again") from None
        if weight_map is not None:
            _check_listed(f, set(heads), weight_map)
        out.update(heads)
    return out


def read_tensor(header: TensorHeader):
    """The one tensor ``header`` describes, read from its shard into a torch tensor of its own
    (plain reads, no mapping of the file). Its memory is an anonymous mapping of its own, given
    back to the system when the tensor is dropped (a heap block of that size could stay
    resident)."""
    import math
    import mmap

    import torch

    dtype = getattr(torch, header.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise DiffusersWeightsError(f"{header.key} in {header.file.name} has the dtype "
                                    f"{header.dtype!r}, which torch cannot read")
    count = math.prod(header.shape)
    want = header.end - header.start
    if count * dtype.itemsize != want:
        raise DiffusersWeightsError(f"{header.key} in {header.file.name}: {want} bytes for a "
                                    f"{header.dtype} tensor of shape {list(header.shape)} "
                                    f"(a corrupt header). Fix: save the model again")
    if not count:
        return torch.empty(header.shape, dtype=dtype)
    memory = mmap.mmap(-1, want)
    with open(header.file, "rb") as fh:
        # the shard is the one whose header was read, before and after its data are read
        confirm_identity(header.file, header.ident, f"before {header.key} was read",
                         fh.fileno())
        fh.seek(header.start)
        view = memoryview(memory)
        try:
            _read_into(fh, view, header)
        finally:
            view.release()
        confirm_identity(header.file, header.ident, f"while {header.key} was read",
                         fh.fileno())
    return torch.frombuffer(memory, dtype=dtype, count=count).reshape(header.shape)


def _read_into(fh, view: memoryview, header: TensorHeader) -> None:
    """Fill ``view`` from ``fh``'s position (plain reads)."""
    got, want = 0, len(view)
    while got < want:
        n = fh.readinto(view[got:])
        if not n:
            raise DiffusersWeightsError(f"{header.file} ends inside {header.key} "
                                        f"(truncated). Fix: copy the shard again")
        got += n


def _check_listed(f: Path, keys: set[str], weight_map: dict[str, str]) -> None:
    listed = {k for k, v in weight_map.items() if v == f.name}
    wrong = sorted(keys ^ listed)
    if wrong:
        raise DiffusersWeightsError(
            f"{f.name} does not hold the keys the index lists for it: "
            f"{', '.join(wrong[:6])}{' ...' if len(wrong) > 6 else ''}. Fix: save the "
            f"model again with save_pretrained (the shards and the index are from "
            f"different saves)")


__all__ = ["check_reference_config", "listed_files", "check_regular_file", "identity",
           "confirm_identity", "unchanged_while_read", "ShardChangedError", "DTYPE_SIZES",
           "DiffusersWeightsError", "WEIGHTS_NAME", "INDEX_NAME", "with_variant", "model_folder",
           "transformer_folder", "folder_family",
           "weight_files", "check_complete", "load_state_dict", "TensorHeader", "tensor_headers",
           "read_tensor"]


# --------------------------------------------------------------------------------------------
# The folder `--diffusers DIR` names, and the model family its config.json says
# --------------------------------------------------------------------------------------------

def transformer_folder(directory: str) -> str:
    """The folder of a saved diffusers transformer: ``directory``, or its ``transformer/``
    subfolder (a pipeline folder); an InputFileNotFoundError otherwise."""
    if not directory or not os.path.isdir(directory):
        raise InputFileNotFoundError(
            f"--diffusers {directory!r} is not a directory: give the local folder of a saved "
            f"diffusers transformer (the one with config.json and the weights; for a "
            f"pipeline folder, its transformer/ subfolder). Nothing is downloaded.")
    if not os.path.isfile(os.path.join(directory, "config.json")):
        sub = os.path.join(directory, "transformer")
        if os.path.isfile(os.path.join(sub, "config.json")):
            return sub
        raise InputFileNotFoundError(f"--diffusers {directory!r} has no config.json (nor a "
                                     f"transformer/config.json): not a saved diffusers model")
    return directory


def folder_family(directory: str):
    """The model family (:func:`qkrope.families.family_of`) of a saved diffusers transformer,
    from its config.json's ``_class_name``, read without torch; any other class is refused
    with the list."""
    from qkrope import families
    from qkrope.errors import InputError

    path = os.path.join(transformer_folder(directory), "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError) as exc:
        raise InputError(f"--diffusers {directory!r}: cannot read {path} ({exc}). Fix: give "
                         f"the folder of a saved diffusers transformer") from None
    if not isinstance(config, dict):
        raise InputError(f"--diffusers {directory!r}: {path} holds a JSON "
                         f"{type(config).__name__}, not the object of a model's config. Fix: "
                         f"save the model again with save_pretrained, or correct {path}")
    return families.family_of(config, source=f"--diffusers {path}")
