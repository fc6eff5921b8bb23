"""The export without the model's weights in memory: a placeholder skeleton to trace, the
initializers read from the safetensors shards one tensor at a time as they are written.

Any diffusers model class (any ``nn.Module`` whose state-dict keys are the checkpoint's keys):

1. :func:`placeholder_module` builds the module from its config with every parameter an
   *uninitialised* CPU tensor of its export dtype (created on the meta device, then
   ``torch.empty``; nothing ever writes it, so its pages are never resident). Tracing
   (``torch.onnx.export(dynamo=True)``) reads shapes, dtypes and devices only, so the graph is the
   one a loaded model gives; buffers are built as usual (they are small and may be constants of
   the graph). The placeholders take address space, not memory (38 GiB of it for the real
   model in bf16): Linux's default overcommit allows it; ``vm.overcommit_memory=2`` may not.
2. :class:`DiskWeights` checks every key the module has against the shards' headers first (a key
   missing from the shards, another shape, or a floating-point tensor where the module has an
   integer one, or the reverse, is one :class:`WeightsMismatchError` naming it), then reads one
   tensor by its key and converts it to the module's dtype for it (``Tensor.to``, the cast
   diffusers' ``from_pretrained`` makes).
3. :func:`stream_initializers` makes each initializer named by a key an ``onnx_ir.LazyTensor``
   over :meth:`DiskWeights.tensor`: ``onnx_ir.save(..., external_data=...)`` evaluates one at a
   time while it writes the external data and drops it after. :func:`check_no_placeholders`
   refuses a graph that would write a placeholder's bytes.
4. :func:`inline_external_data` turns that external-data form into the single-file form (models
   under 1.5 GiB of weights) by streaming: the protobuf is written field by field in field-number
   order with each initializer's ``raw_data`` copied from the data file in chunks, which is the
   encoding ``SerializeToString`` of the whole model gives, without the model in memory.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import os
import re
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import onnx_ir as ir
import torch
from onnx_ir.tensor_adapters import TorchTensor
from torch import nn

from qkrope.diffusers_weights import DiffusersWeightsError, TensorHeader, read_tensor
from qkrope.errors import InputError
from qkrope.weight_values import checked_cast

COPY_CHUNK = 16 << 20  # bytes per read/write while inlining external data
#: Initializers up to this size are read once and kept: the graph optimiser's rewrite rules
#: read the values of biases and norm weights (a zero bias is dropped, as from a loaded model);
#: at Qwen-Image's width they are about 0.2 MiB a block.
KEEP_BYTES = 1 << 20


class WeightsMismatchError(InputError):
    """The weight files do not hold a tensor the model needs, or hold it with another shape or
    kind of dtype."""


# --------------------------------------------------------------------------------------------
# The skeleton
# --------------------------------------------------------------------------------------------

class SizeError(InputError):
    """A config describes more than its weight files hold (checked before anything is built)."""


_LAYER_FIELD = re.compile(r"num_(\w+_)?(layers|blocks)")


def numbered_lists(keys: Iterable[str]) -> dict[str, int]:
    """The module lists of a state dict's keys and how many entries each has: ``{"blocks": 2}``
    for ``blocks.0.w``, ``blocks.1.w`` (the path before the first numeric component)."""
    found: dict[str, set[str]] = {}
    for key in keys:
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            if part.isdigit():
                found.setdefault(".".join(parts[:i]), set()).add(part)
                break
    return {prefix: len(indices) for prefix, indices in found.items()}


def check_config_sizes(config: Mapping, headers: Mapping[str, TensorHeader], *,
                       source: str) -> None:
    """Before a model is built from ``config``: its layer counts (``num_layers``,
    ``num_single_layers``, any ``num_*_layers`` / ``num_*_blocks``) fit in what the weight files
    hold (the longest numbered module list of their headers). A config that claims a million
    blocks over two blocks' shards is refused here, from the headers alone, in one line."""
    lists = numbered_lists(headers)
    most = max(lists.values(), default=0)
    where = max(lists, key=lists.get) if lists else None
    for field, value in config.items():
        if not isinstance(field, str) or not _LAYER_FIELD.fullmatch(field):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value > most:
            held = (f"at most {most} numbered blocks ({where}.0-{most - 1})" if lists
                    else "no numbered blocks")
            raise SizeError(f"{source}: config.json's {field} is {value}, but the weight files "
                            f"hold {held}. Fix: pass the config.json saved with these weights "
                            f"(or every shard of the model)")


class _Budget:
    """While a skeleton is built: the parameters registered so far against what the weight
    files hold (every parameter must have a tensor there, so a build that passes twice their
    count or elements is refused at once, its time and memory bounded by the files')."""

    def __init__(self, headers: Mapping[str, TensorHeader], source: str):
        import math

        self.source = source
        self.max_count = 2 * len(headers) + 64
        self.max_elements = 2 * sum(math.prod(h.shape) for h in headers.values()) + (1 << 20)
        self.count = self.elements = 0

    def add(self, param) -> None:
        self.count += 1
        self.elements += param.numel()
        if self.count > self.max_count or self.elements > self.max_elements:
            raise SizeError(f"{self.source}: the model config.json describes has more "
                            f"parameters than the weight files hold (over {self.count} tensors "
                            f"/ {self.elements} values built, the files hold "
                            f"{(self.max_count - 64) // 2} / "
                            f"{(self.max_elements - (1 << 20)) // 2}). Fix: pass the "
                            f"config.json saved with these weights")


@contextlib.contextmanager
def _parameters_on_meta(budget: _Budget | None = None) -> Iterator[None]:
    """Every parameter registered inside the context is moved to the meta device (no storage,
    no initialisation cost); buffers are left as they are. ``budget``: counted against it."""
    register = nn.Module.register_parameter

    def on_meta(self, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        if param is not None and budget is not None:
            budget.add(param)
        register(self, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def kept_in_fp32(key: str, modules: Iterable[str]) -> bool:
    """Whether parameter ``key`` belongs to one of ``modules`` (a model class's
    ``_keep_in_fp32_modules``: names matched against the key's components, diffusers' rule), so
    it stays float32 whatever dtype the model is loaded in."""
    parts = key.split(".")
    return any(m in parts for m in modules)


def placeholder_module(build: Callable[[], nn.Module], *, dtype: torch.dtype,
                       keep_in_fp32: Iterable[str] = (),
                       within: Mapping[str, TensorHeader] | None = None,
                       source: str = "the weights") -> nn.Module:
    """``build()`` (e.g. ``cls.from_config(config)``) under the default dtype ``dtype``, as
    diffusers builds a model it loads with ``torch_dtype``, each parameter then an uninitialised
    CPU tensor of that dtype (float32 for the parameters of the ``keep_in_fp32`` modules, the
    model class's ``_keep_in_fp32_modules``, as diffusers keeps them). ``within``: the weight
    files' headers; a build that registers far more parameters than they hold stops at once
    (:class:`SizeError`, ``source`` naming the files)."""
    keep = tuple(keep_in_fp32 or ())
    budget = _Budget(within, source) if within is not None else None
    with _default_dtype(dtype), _parameters_on_meta(budget), torch.no_grad():
        module = build()
    for name, owner in module.named_modules():
        for pname, param in list(owner._parameters.items()):
            if param is None:
                continue
            key = f"{name}.{pname}" if name else pname
            target = param.dtype
            if target.is_floating_point and kept_in_fp32(key, keep):
                target = torch.float32
            owner._parameters[pname] = nn.Parameter(torch.empty(param.shape, dtype=target),
                                                    requires_grad=False)
    return module.eval()


# --------------------------------------------------------------------------------------------
# The weights on disk
# --------------------------------------------------------------------------------------------

class TensorSource:
    """Tensors by state-dict key, each made when it is asked for: ``value(key)`` (already in
    its export dtype) for the keys of ``shapes`` (key -> shape)."""

    def __init__(self, value: Callable[[str], torch.Tensor], shapes: Mapping[str, tuple]):
        self._value, self._shapes = value, dict(shapes)
        self.reads = 0  # tensors made so far (tests: each written tensor is made once)

    def __contains__(self, key: str) -> bool:
        return key in self._shapes

    def keys(self) -> list[str]:
        return list(self._shapes)

    def shape(self, key: str) -> list[int]:
        return [int(d) for d in self._shapes[key]]

    def tensor(self, key: str) -> torch.Tensor:
        self.reads += 1
        return self._value(key)


class DiskWeights(TensorSource):
    """The tensors of a module's state dict as the shards hold them, read one at a time.

    ``headers``: key -> :class:`qkrope.diffusers_weights.TensorHeader` (the shards' headers);
    ``targets``: key -> the torch dtype the export writes it in; ``source``: what the shards are
    (for errors)."""

    def __init__(self, headers: Mapping[str, TensorHeader], targets: Mapping[str, torch.dtype],
                 *, source: str):
        super().__init__(self._read, {k: h.shape for k, h in headers.items()})
        self.headers, self.targets, self.source = dict(headers), dict(targets), source

    @classmethod
    def for_module(cls, module: nn.Module, headers: Mapping[str, TensorHeader], *, source: str,
                   skip: Callable[[str], bool] = lambda key: False) -> "DiskWeights":
        """The weights of ``module``'s state dict (keys ``skip`` says yes to left out), every
        key checked against ``headers`` before anything is read."""
        targets = {}
        for key, value in module.state_dict(keep_vars=True).items():
            if skip(key):
                continue
            header = headers.get(key)
            if header is None:
                raise WeightsMismatchError(
                    f"{source} has no tensor {key} ({list(value.shape)} {_dtype_name(value)}), "
                    f"which {type(module).__name__} with this config.json has. Fix: pass the "
                    f"folder the config belongs to (every shard), or a config that matches "
                    f"the weights")
            if tuple(header.shape) != tuple(value.shape):
                raise WeightsMismatchError(
                    f"{source}: {key} is {list(header.shape)} in {header.file.name}, the model "
                    f"built from config.json has {list(value.shape)}. Fix: pass the config.json "
                    f"saved with these weights")
            if header.is_floating_point != value.dtype.is_floating_point:
                raise WeightsMismatchError(
                    f"{source}: {key} is {header.dtype} in {header.file.name}, the model has a "
                    f"{_dtype_name(value)} tensor there. Fix: pass the config.json saved with "
                    f"these weights")
            targets[key] = value.dtype
        return cls({k: headers[k] for k in targets}, targets, source=source)

    def _read(self, key: str) -> torch.Tensor:
        """The tensor ``key`` read from its shard and converted to its export dtype."""
        try:
            value = read_tensor(self.headers[key])
        except DiffusersWeightsError as exc:
            raise WeightsMismatchError(f"{self.source}: {exc}") from None
        # values the export dtype cannot hold (NaN/inf, fp32 beyond fp16): refused here; an
        # overflow lists every tensor that overflows (the rest are read for it, on failure only)
        return checked_cast(value, self.targets[key], name=key, source=self.source,
                            others=lambda: self._overflowing(skip=key))

    def _overflowing(self, *, skip: str) -> list[str]:
        """The keys other than ``skip`` whose values overflow their export dtype (each read
        once, one at a time; unreadable ones are left to the export's own error)."""
        from qkrope.weight_values import overflows

        out = []
        for key, header in self.headers.items():
            if key == skip or not self.targets[key].is_floating_point:
                continue
            try:
                if overflows(read_tensor(header), self.targets[key]):
                    out.append(key)
            except DiffusersWeightsError:
                continue
        return out


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def lazy_tensor(read: Callable[[], torch.Tensor], *, dtype, shape, name: str,
                keep: bool = False):
    """An ``onnx_ir.LazyTensor`` of ``read()`` (a torch tensor of ``dtype``/``shape``): read
    each time its value is asked for and dropped after, or read once and kept (``keep``)."""
    def make():
        value = TorchTensor(read().contiguous(), name=name)
        if (value.dtype, list(value.shape)) != (ir.DataType(dtype), list(shape)):
            raise WeightsMismatchError(f"{name} was read as {list(value.shape)} "
                                       f"{value.dtype.name}, the graph has {list(shape)} "
                                       f"{ir.DataType(dtype).name}")
        return value

    return _WrittenFromItself(make, dtype=dtype, shape=ir.Shape(list(shape)), name=name,
                              cache=keep)


class _WrittenFromItself(ir.LazyTensor):
    """A LazyTensor whose ``tofile`` writes the evaluated tensor's own memory (onnx_ir's
    TorchTensor.tofile), not a ``tobytes()`` copy of it: one copy of a tensor in flight. The
    bytes written are hashed by the :class:`WrittenDigest` in effect, if any."""

    def tofile(self, file) -> None:
        value = self._evaluate()
        value.tofile(file)
        digest = _DIGEST.get()
        if digest is not None:
            digest.wrote(self, value)


#: the digest the lazy tensors' tofile reports to (per thread of control: another export in
#: another thread has its own; a tensor written from a worker thread reports to none, and the
#: digest then says it cannot vouch for the file)
_DIGEST: contextvars.ContextVar = contextvars.ContextVar("qkrope_written_digest", default=None)


def _memory(value) -> memoryview | bytes:
    """The bytes ``tofile`` wrote for ``value``: a torch tensor's own memory (no copy), else
    ``tobytes()``."""
    raw = getattr(value, "raw", None)
    if isinstance(raw, torch.Tensor) and raw.is_contiguous() and raw.device.type == "cpu":
        return memoryview(raw.reshape(-1).view(torch.uint8).numpy())
    return value.tobytes()


class WrittenDigest:
    """The sha256 of the external-data file ``onnx_ir.save`` writes, from the bytes as they are
    written, not read back: ``ir.save(..., callback=digest.before)`` inside ``with digest:``.

    onnx_ir writes the tensors in order (serially), each at its offset after a hole of zeros (the
    alignment): ``before`` (its callback, called before each tensor is written) hashes the hole,
    then the tensor's bytes when it is in memory; a lazy tensor of this module hashes its own
    bytes as it writes them (``_WrittenFromItself.tofile``), so it is read from the shards once.
    :meth:`hexdigest` is None when the bytes hashed cannot be the file's (a write out of order,
    another length): the caller then hashes the file."""

    def __init__(self):
        self._h = hashlib.sha256()
        self.pos = 0
        self.ok = True
        self._pending = None

    def __enter__(self) -> "WrittenDigest":
        self._token = _DIGEST.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _DIGEST.reset(self._token)

    def before(self, tensor, info) -> None:
        if self._pending is not None:  # announced but not written through tofile
            self.ok = False
        offset = int(info.offset)
        if offset < self.pos:
            self.ok = False
            return
        zeros = offset - self.pos
        while zeros > 0:
            n = min(zeros, COPY_CHUNK)
            self._h.update(bytes(n))
            zeros -= n
        self.pos = offset
        if isinstance(tensor, _WrittenFromItself):
            self._pending = tensor
        else:
            data = tensor.tobytes()
            self._h.update(data)
            self.pos += len(data)

    def wrote(self, tensor, value) -> None:
        if tensor is not self._pending:
            self.ok = False
            return
        self._pending = None
        data = _memory(value)
        self._h.update(data)
        self.pos += data.nbytes if isinstance(data, memoryview) else len(data)

    def hexdigest(self, path: str | os.PathLike) -> str | None:
        """The digest of ``path`` as written, or None when it cannot be known so."""
        try:
            size = os.path.getsize(path)
        except OSError:
            return None
        if not self.ok or self._pending is not None or size != self.pos:
            return None
        return self._h.hexdigest()


def stream_initializers(model, weights: TensorSource, keys: Iterable[str]) -> None:
    """Each initializer of ``model`` (onnx_ir) named by one of ``keys`` reads its value from
    ``weights`` when it is written, those up to :data:`KEEP_BYTES` once (in place)."""
    for key in keys:
        value = model.graph.initializers.get(key)
        if value is None or key not in weights:
            continue
        old = value.const_value
        value.const_value = lazy_tensor(lambda key=key: weights.tensor(key), dtype=old.dtype,
                                        shape=list(old.shape), name=key,
                                        keep=old.nbytes <= KEEP_BYTES)


@contextlib.contextmanager
def user_errors_unwrapped() -> Iterator[None]:
    """A pass manager (onnx_ir's PassError) wraps what a weight's read raised: a QkropeError
    (a shard changed, a value the dtype cannot hold) anywhere in the chain of causes is raised
    as itself, one line, not as the pass's traceback."""
    from qkrope.errors import QkropeError

    try:
        yield
    except QkropeError:
        raise
    except Exception as exc:
        seen, cause = set(), exc
        while cause is not None and id(cause) not in seen:
            if isinstance(cause, QkropeError):
                raise cause from None
            seen.add(id(cause))
            cause = cause.__cause__ or cause.__context__
        raise


def check_no_placeholders(model, module: nn.Module) -> None:
    """Refuse a graph with an initializer that still holds one of ``module``'s placeholder
    parameters (its bytes would be whatever memory the placeholder got)."""
    placeholders = {p.data_ptr() for p in module.parameters() if p.numel()}
    for graph in model.graphs():
        for name, value in graph.initializers.items():
            tensor = value.const_value
            raw = getattr(tensor, "raw", None)
            if isinstance(tensor, ir.LazyTensor) or not isinstance(raw, torch.Tensor):
                continue
            if raw.numel() and raw.data_ptr() in placeholders:
                raise InputError(f"the graph's initializer {name} is a placeholder parameter "
                                 f"that has no key in the weights (an export bug: it would "
                                 f"write uninitialised memory)")


# --------------------------------------------------------------------------------------------
# The single-file form, streamed
# --------------------------------------------------------------------------------------------

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _len_field(number: int, length: int) -> bytes:
    """The key and length of a length-delimited protobuf field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(length)


def _split(message, number: int) -> tuple[bytes, bytes]:
    """``message``'s encoding in two parts: its fields numbered below ``number`` and above it
    (the field ``number`` itself in neither), each in field-number order as protobuf writes."""
    low, high = type(message)(), type(message)()
    low.CopyFrom(message)
    high.CopyFrom(message)
    for field in message.DESCRIPTOR.fields:
        if field.number >= number:
            low.ClearField(field.name)
        if field.number <= number:
            high.ClearField(field.name)
    return low.SerializeToString(), high.SerializeToString()


class _Hashed:
    """A binary file whose bytes are hashed (sha256) as they are written."""

    def __init__(self, file):
        self.file, self.digest = file, hashlib.sha256()

    def write(self, data) -> None:
        self.file.write(data)
        self.digest.update(data)


def inline_external_data(model_path: str | os.PathLike, out: str | os.PathLike) -> str:
    """Write ``out``: the model ``model_path`` with every initializer's external data (files
    beside it) as ``raw_data`` in the file, without holding the data in memory (chunks of
    :data:`COPY_CHUNK`). Only the main graph's initializers may be external. Returns the
    sha256 of ``out``, taken as it is written."""
    import onnx
    from onnx import TensorProto

    model_path = Path(model_path)
    proto = onnx.load(str(model_path), load_external_data=False)
    graph = proto.graph
    inits = list(graph.initializer)
    pieces = []  # per initializer: (head bytes, (file, offset, length) or None, tail bytes)
    for tensor in inits:
        source = None
        if tensor.data_location == TensorProto.EXTERNAL:
            info = {e.key: e.value for e in tensor.external_data}
            path = model_path.parent / info["location"]
            offset = int(info.get("offset", 0))
            length = int(info["length"]) if "length" in info else path.stat().st_size - offset
            source = (path, offset, length)
            tensor.ClearField("external_data")
            tensor.ClearField("data_location")
            head, tail = _split(tensor, 9)  # TensorProto.raw_data is field 9
        else:
            head, tail = tensor.SerializeToString(), b""
        pieces.append((head, source, tail))
    graph.ClearField("initializer")
    for fn in proto.functions:
        for node in fn.node:
            for attr in node.attribute:
                if attr.t.data_location == TensorProto.EXTERNAL:
                    raise ValueError(f"{model_path}: function {fn.name} has external data")
    graph_low, graph_high = _split(graph, 5)  # GraphProto.initializer is field 5
    model_low, model_high = _split(proto, 7)  # ModelProto.graph is field 7

    def tensor_size(head, source, tail) -> int:
        raw = 0 if source is None else len(_len_field(9, source[2])) + source[2]
        return len(head) + raw + len(tail)

    sizes = [tensor_size(*p) for p in pieces]
    graph_size = len(graph_low) + len(graph_high) + sum(
        len(_len_field(5, n)) + n for n in sizes)
    with open(out, "wb") as raw:
        f = _Hashed(raw)
        f.write(model_low)
        f.write(_len_field(7, graph_size))
        f.write(graph_low)
        for (head, source, tail), size in zip(pieces, sizes):
            f.write(_len_field(5, size))
            f.write(head)
            if source is not None:
                path, offset, length = source
                f.write(_len_field(9, length))
                with open(path, "rb") as data:
                    data.seek(offset)
                    left = length
                    while left:
                        chunk = data.read(min(COPY_CHUNK, left))
                        if not chunk:
                            raise ValueError(f"{path} ends before the {length} bytes at offset "
                                             f"{offset} the model names")
                        f.write(chunk)
                        left -= len(chunk)
            f.write(tail)
        f.write(graph_high)
        f.write(model_high)
    return f.digest.hexdigest()


__all__ = ["WeightsMismatchError", "SizeError", "numbered_lists", "check_config_sizes",
           "placeholder_module", "TensorSource", "DiskWeights",
           "lazy_tensor", "stream_initializers", "user_errors_unwrapped", "check_no_placeholders",
           "inline_external_data", "WrittenDigest"]
