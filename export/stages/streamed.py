"""The stage exports without the component's weights in memory, as the transformer's
(:mod:`qkrope.export.streaming`): a placeholder skeleton is traced, and each initializer is read
from the component folder's safetensors while the graph is written: a small one (up to
``KEEP_BYTES``, norms and biases the optimiser's rules read) once, a large one copied from its
shard in chunks (:class:`_CopiedInChunks`), so the peak holds neither the model nor its largest
tensor (Wan's 2 GiB UMT5 embedding).

:func:`skeleton` builds a text encoder (a transformers model) or a VAE (a diffusers model) from
its folder's config.json as ``from_pretrained(folder, dtype)`` would build it, every parameter
an uninitialised CPU tensor of the dtype that load gives it (no page of it is ever written, so
none is resident), and keeps beside it a :class:`StageWeights`: which checkpoint tensor fills
each state-dict key, checked against the safetensors headers before anything is traced. The
stage functions (:mod:`.text_encoder`, :mod:`.vae`) run unchanged on the skeleton; their
:func:`qkrope.export.stages._onnx.trace` finds its weights (:func:`attached`) and streams them.
The eager calls those functions make to learn shapes (the text encoder's hidden-state count,
the causal VAE's cache slots) run on the placeholders: reading pages never written maps the
kernel's zero page, so they cost time, not memory, and their values are never used.

How a checkpoint key finds its parameter is the loading library's own rule:

- transformers 5 renames checkpoint keys on load (Qwen2.5-VL's ``model.layers.*`` are
  ``model.language_model.layers.*`` in the module, ``visual.*`` is ``model.visual.*``): the
  model's conversion mapping (``transformers.conversion_mapping.get_model_conversion_mapping``)
  is applied with transformers' ``rename_source_key``, base-model prefix included. A key that
  needs a conversion beyond a rename (a merge or split of tensors) is refused in one line if the
  graph reads it.
- diffusers renames the deprecated attention-block keys (``query`` -> ``to_q``, ...) of a
  single-file checkpoint (``ModelMixin._fix_state_dict_keys_on_load``), applied here the same way.

Tied parameters (T5's shared embedding and ``encoder.embed_tokens``, a tied ``lm_head``) are one
placeholder, filled from whichever of their keys the checkpoint holds. Where the checkpoint holds
two of them with different bytes, transformers leaves them untied, and so does the skeleton (two
placeholders, each filled from its own key). A parameter the checkpoint does not hold is refused
in one line if the graph reads it (from_pretrained would have given it random values).
"""

from __future__ import annotations

import os
import shutil
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

import onnx_ir as ir
import torch
from torch import nn

from qkrope.diffusers_weights import (DiffusersWeightsError, TensorHeader, _check_listed,
                                      _read_header, check_complete, check_regular_file,
                                      read_weight_map, tensor_headers)
from qkrope.errors import InputError

from ..streaming import (COPY_CHUNK, KEEP_BYTES, DiskWeights, WeightsMismatchError, _Budget,
                         _default_dtype, _parameters_on_meta, check_no_placeholders,
                         kept_in_fp32, lazy_tensor)

#: a transformers model folder's weights (``save_pretrained``'s names)
TRANSFORMERS_WEIGHTS = "model.safetensors"
TRANSFORMERS_INDEX = "model.safetensors.index.json"


# --------------------------------------------------------------------------------------------
# The component folder's weights
# --------------------------------------------------------------------------------------------

def _transformers_headers(folder: Path) -> tuple[dict[str, TensorHeader], bool]:
    """Every tensor of a transformers model folder by checkpoint key (headers only) and whether
    it is sharded: ``model.safetensors``, or the shards its index names."""
    index, single = folder / TRANSFORMERS_INDEX, folder / TRANSFORMERS_WEIGHTS
    if index.is_file():
        weight_map = read_weight_map(index)
        shards = sorted(set(weight_map.values()))
        bad = [s for s in shards if Path(s).name != s]
        missing = [s for s in shards if not (folder / s).is_file()]
        if bad or missing:
            raise DiffusersWeightsError(
                f"{index} names shards {'outside its folder' if bad else 'that are missing'}: "
                f"{', '.join((bad or missing)[:4])}. Fix: copy the whole model folder (every "
                f"shard) or save it again with save_pretrained")
        files = [folder / s for s in shards]
    else:
        check_regular_file(single, what="the weights file")
        if not single.is_file():
            others = sorted(p.name for p in folder.glob("*") if p.suffix in (".bin", ".pt",
                                                                               ".safetensors"))
            raise DiffusersWeightsError(
                f"{folder} has no {TRANSFORMERS_WEIGHTS} or {TRANSFORMERS_INDEX} (it holds "
                f"{', '.join(others[:4]) or 'no weight files'}); the streamed export reads "
                f"safetensors only. Fix: save the model with save_pretrained("
                f"safe_serialization=True)")
        files, weight_map = [single], None
    out: dict[str, TensorHeader] = {}
    for f in files:
        check_regular_file(f, what="a weights file")
        check_complete(f)
        try:
            heads = _read_header(f)
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            first = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
            raise DiffusersWeightsError(f"{f} is not a readable safetensors file ({first}). "
                                        f"Fix: copy or save the model again") from None
        if weight_map is not None:
            _check_listed(f, set(heads), weight_map)
        out.update(heads)
    return out, weight_map is not None


def checkpoint_headers(folder: Path, library: str) -> tuple[dict[str, TensorHeader], bool]:
    """``(headers by checkpoint key, sharded)`` of a component folder saved by ``library``."""
    if library == "transformers":
        return _transformers_headers(folder)
    from qkrope.diffusers_weights import INDEX_NAME

    return tensor_headers(folder), (folder / INDEX_NAME).is_file()


def _same_bytes(a: TensorHeader, b: TensorHeader) -> bool:
    """Whether two checkpoint tensors hold the same dtype, shape and bytes (compared in chunks:
    two tied copies of a 2 GiB embedding cost no memory to compare)."""
    if (a.dtype, tuple(a.shape), a.end - a.start) != (b.dtype, tuple(b.shape), b.end - b.start):
        return False
    if (a.file, a.start) == (b.file, b.start):
        return True
    with open(a.file, "rb") as fa, open(b.file, "rb") as fb:
        fa.seek(a.start)
        fb.seek(b.start)
        left = a.end - a.start
        while left:
            n = min(COPY_CHUNK, left)
            if fa.read(n) != fb.read(n):
                return False
            left -= n
    return True


# --------------------------------------------------------------------------------------------
# Checkpoint keys -> state-dict keys, the loading library's rule
# --------------------------------------------------------------------------------------------

def _transformers_keys(module: nn.Module, ckpt_keys: Iterable[str], *, source: str
                       ) -> tuple[dict[str, str], dict[str, str]]:
    """``(state-dict key -> checkpoint key, state-dict key -> checkpoint key that needs a
    conversion)`` by transformers' own renaming on load (module docstring)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                     dot_natural_key, rename_source_key)
    except ImportError as exc:
        import transformers

        raise InputError(f"{source}: transformers {transformers.__version__} lacks the key "
                         f"mapping the streamed export applies ({exc}). Fix: install "
                         f"transformers 5 (pip install -e '.[test]')") from None
    transforms = get_model_conversion_mapping(module)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    state = dict.fromkeys(module.state_dict(keep_vars=True), True)
    prefix = module.base_model_prefix
    plain: dict[str, str] = {}
    converted: dict[str, str] = {}
    for ck in sorted(ckpt_keys, key=dot_natural_key):
        key, pattern = rename_source_key(ck, renamings, converters, prefix, state)
        if key not in state and ck in state:  # as transformers: not renamed after all
            key, pattern = rename_source_key(ck, [], [], base_model_prefix=prefix,
                                             meta_state_dict=state)
        if key not in state:
            continue  # a key the model does not have (from_pretrained ignores it too)
        if pattern is not None:
            converted.setdefault(key, ck)
            continue
        if key in plain:
            raise WeightsMismatchError(
                f"{source}: the checkpoint keys {plain[key]} and {ck} both load into {key} "
                f"(transformers' renaming of {type(module).__name__}). Fix: save the model "
                f"again with save_pretrained")
        plain[key] = ck
    return plain, converted


def _diffusers_keys(module: nn.Module, ckpt_keys: Iterable[str], *, sharded: bool
                    ) -> dict[str, str]:
    """state-dict key -> checkpoint key, with diffusers' renaming of the deprecated attention
    blocks of a single-file checkpoint (as its from_pretrained applies it)."""
    keys = {k: k for k in ckpt_keys}
    if not sharded and hasattr(module, "_fix_state_dict_keys_on_load"):
        module._fix_state_dict_keys_on_load(keys)  # renames in place; values: the old keys
    state = module.state_dict(keep_vars=True)
    return {k: v for k, v in keys.items() if k in state}


# --------------------------------------------------------------------------------------------
# An initializer written from its shard in chunks
# --------------------------------------------------------------------------------------------

class _CopiedInChunks(ir.LazyTensor):
    """A large initializer whose ``tofile`` (what ``onnx_ir.save`` calls to write it) reads its
    shard :data:`~qkrope.export.streaming.COPY_CHUNK` bytes at a time, converts each chunk to
    the export dtype and writes it: a 2 GiB embedding costs 16 MiB in flight, so the export's
    peak does not grow with the largest tensor. Each chunk is checked as
    :meth:`DiskWeights.tensor <qkrope.export.streaming.DiskWeights.tensor>` checks the whole
    (``cast_problem``: NaN/inf, overflow of the export dtype); on a problem the whole tensor is
    read through it, which raises its one-line refusal naming every offending tensor. A
    conversion is elementwise, so the bytes are those of the whole tensor converted at once.
    Anything that asks for the value itself (``tobytes``, ``numpy``) gets the whole read."""

    def __init__(self, weights: DiskWeights, key: str, *, dtype, shape):
        from onnx_ir.tensor_adapters import TorchTensor

        super().__init__(lambda: TorchTensor(weights.tensor(key).contiguous(), name=key),
                         dtype=dtype, shape=ir.Shape(list(shape)), name=key)
        self._weights, self._key = weights, key

    def tofile(self, file) -> None:
        import math

        from qkrope.diffusers_weights import confirm_identity
        from qkrope.weight_values import cast_problem

        weights, key = self._weights, self._key
        header, target = weights.headers[key], weights.targets[key]
        source = getattr(torch, header.dtype, None)
        count = math.prod(header.shape)
        if (not isinstance(source, torch.dtype) or source.itemsize * count
                != header.end - header.start or not count):
            super().tofile(file)  # the whole read, which names what is wrong
            return
        weights.reads += 1
        per = max(1, COPY_CHUNK // source.itemsize)
        buffer = bytearray(per * source.itemsize)
        with open(header.file, "rb") as fh:
            confirm_identity(header.file, header.ident, f"before {key} was read", fh.fileno())
            fh.seek(header.start)
            done = 0
            while done < count:
                n = min(per, count - done)
                view = memoryview(buffer)[:n * source.itemsize]
                got = fh.readinto(view)
                if got != len(view):
                    weights.tensor(key)  # the whole read: its one-line error
                    raise WeightsMismatchError(f"{weights.source}: {header.file.name} ends "
                                               f"inside {key}. Fix: copy the shard again")
                chunk = torch.frombuffer(view, dtype=source, count=n)
                out, problem = cast_problem(chunk, target)
                if problem is not None:
                    weights.tensor(key)  # raises the whole tensor's one-line refusal
                    raise WeightsMismatchError(f"{weights.source}: {key}: {problem}")
                file.write(memoryview(out.contiguous().view(torch.uint8).numpy()))
                done += n
            confirm_identity(header.file, header.ident, f"while {key} was read", fh.fileno())


def _stream(model, weights: DiskWeights, keys: Iterable[str]) -> None:
    """Each initializer of ``model`` named by one of ``keys`` filled from ``weights`` when it
    is written: those up to :data:`~qkrope.export.streaming.KEEP_BYTES` read once and kept (the
    optimiser's rules read small values, as in the transformer export), larger ones copied
    from their shard in chunks (:class:`_CopiedInChunks`)."""
    from onnx_ir.tensor_adapters import from_torch_dtype

    for key in keys:
        value = model.graph.initializers.get(key)
        if value is None or key not in weights:
            continue
        old = value.const_value
        if old.dtype != from_torch_dtype(weights.targets[key]) or \
                list(old.shape) != weights.shape(key):
            raise WeightsMismatchError(f"{key} is {weights.shape(key)} "
                                       f"{weights.targets[key]} in the weights, the graph has "
                                       f"{list(old.shape)} {old.dtype.name} (an export bug)")
        if old.nbytes <= KEEP_BYTES:
            value.const_value = lazy_tensor(lambda key=key: weights.tensor(key),
                                            dtype=old.dtype, shape=list(old.shape), name=key,
                                            keep=True)
        else:
            value.const_value = _CopiedInChunks(weights, key, dtype=old.dtype,
                                                shape=list(old.shape))


# --------------------------------------------------------------------------------------------
# The skeleton
# --------------------------------------------------------------------------------------------

@dataclass
class StageWeights:
    """The weights of a component's skeleton: ``module`` (its placeholder parameters),
    ``source`` (the checkpoint tensor of each state-dict key, read when written), the parameter
    keys the checkpoint does not hold (``missing``) and those transformers would convert
    (``converted``: key -> checkpoint key), refused if a graph reads one."""

    module: nn.Module
    source: DiskWeights
    where: str
    missing: frozenset = frozenset()
    converted: Mapping[str, str] = field(default_factory=dict)

    def bind(self, model, wrapper: nn.Module) -> list[str]:
        """In ``model`` (onnx_ir, traced from ``wrapper``, which holds :attr:`module`): each
        initializer lifted from a state-dict key named by that key, and made a lazy tensor
        read from the checkpoint. Returns the keys. One line for a key the checkpoint cannot
        fill; an initializer still holding a placeholder is refused."""
        keys = _name_initializers(model, wrapper, self.module)
        for key in keys:
            if key in self.converted:
                raise WeightsMismatchError(
                    f"{self.where}: transformers makes {key} from the checkpoint's "
                    f"{self.converted[key]} with a conversion (not a rename), which the "
                    f"streamed stage export does not apply. Fix: export the transformer alone "
                    f"(--model transformer) and run this stage in PyTorch")
            if key in self.missing:
                raise WeightsMismatchError(
                    f"{self.where} has no tensor for {key} of {type(self.module).__name__}, "
                    f"which the exported graph reads (from_pretrained would have given it "
                    f"random values). Fix: pass the folder the config belongs to (every shard)")
        _stream(model, self.source, keys)
        check_no_placeholders(model, self.module)
        return keys


#: skeleton -> its weights (weak: a skeleton dropped drops them)
_ATTACHED: "weakref.WeakKeyDictionary[nn.Module, StageWeights]" = weakref.WeakKeyDictionary()


def attached(module: nn.Module) -> StageWeights | None:
    """The :class:`StageWeights` of the skeleton inside ``module`` (itself or a submodule, as a
    stage's wrapper holds it), or None for a module with real weights."""
    for sub in module.modules():
        found = _ATTACHED.get(sub)
        if found is not None:
            return found
    return None


def _name_initializers(model, wrapper: nn.Module, module: nn.Module) -> list[str]:
    """Name each initializer of ``model`` that torch.export lifted from one of ``module``'s
    parameters or persistent buffers by that tensor's state-dict key in ``module`` (the wrapper
    may reach a submodule by two paths, ``vae.decoder`` and ``coder``: the tensor decides, not
    the path). Returns the keys found in the graph."""
    key_of: dict[int, str] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        key_of.setdefault(id(value), key)
    found: list[str] = []
    seen: set[str] = set()
    tensors = [*wrapper.named_parameters(remove_duplicate=False),
               *wrapper.named_buffers(remove_duplicate=False)]
    for name, tensor in tensors:
        key = key_of.get(id(tensor))
        value = model.graph.initializers.get(name)
        if key is None or value is None or key in seen:
            continue
        value.name = key
        found.append(key)
        seen.add(key)
    return found


class _OnceBudget(_Budget):
    """The transformer export's budget, each parameter counted once: a tied parameter is
    registered again under its second name (T5's shared embedding as ``encoder.embed_tokens``),
    which is no new tensor."""

    def __init__(self, headers: Mapping[str, TensorHeader], source: str):
        super().__init__(headers, source)
        self._counted: dict[int, nn.Parameter] = {}  # kept: an id is not reused meanwhile

    def add(self, param) -> None:
        if id(param) not in self._counted:
            self._counted[id(param)] = param
            super().add(param)


def _build(build: Callable[[], nn.Module], dtype: torch.dtype,
           headers: Mapping[str, TensorHeader], source: str) -> nn.Module:
    """``build()`` under the default dtype ``dtype`` with every parameter on the meta device
    (buffers built as usual), refused at once past what the weight files hold (the transformer
    export's budget, :class:`qkrope.export.streaming.SizeError`)."""
    budget = _OnceBudget(headers, source)
    with _default_dtype(dtype), _parameters_on_meta(budget), torch.no_grad():
        return build()


def _materialise(module: nn.Module, fp32: Callable[[str], bool], keys: Mapping[str, str],
                 headers: Mapping[str, TensorHeader]) -> dict[str, str]:
    """Each meta parameter of ``module`` an uninitialised CPU tensor (float32 where ``fp32``
    says so for its key, else its built dtype), tied parameters one tensor unless the
    checkpoint holds two of their keys with different bytes. Returns state-dict key ->
    checkpoint key for every parameter and buffer the checkpoint fills (tied keys included)."""
    groups: dict[int, list[tuple[str, nn.Module, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, owner in module.named_modules(remove_duplicate=False):
        for pname, param in owner._parameters.items():
            if param is None:
                continue
            key = f"{name}.{pname}" if name else pname
            groups.setdefault(id(param), []).append((key, owner, pname))
            params[id(param)] = param
    filled = dict(keys)
    for pid, aliases in groups.items():
        param = params[pid]

        def placeholder(key: str, param=param) -> nn.Parameter:
            target = param.dtype
            if target.is_floating_point and fp32(key):
                target = torch.float32
            return nn.Parameter(torch.empty(param.shape, dtype=target), requires_grad=False)

        present = [k for k, _, _ in aliases if k in keys]
        slots = {(id(owner), pname) for _, owner, pname in aliases}
        untie = len(slots) > 1 and len(present) > 1 and not all(
            _same_bytes(headers[keys[present[0]]], headers[keys[k]]) for k in present[1:])
        first = placeholder(present[0] if present else aliases[0][0])
        for key, owner, pname in aliases:
            if untie and key in keys and key != present[0]:
                owner._parameters[pname] = placeholder(key)  # its own value (transformers)
                continue
            owner._parameters[pname] = first
            if present and key not in keys:
                filled[key] = keys[present[0]]  # a tied key, filled from its partner
    return filled


def _transformers_module(cls, folder: Path, dtype: torch.dtype, headers, source: str):
    """The transformers model of ``folder``'s config.json as from_pretrained builds it
    (config dtype set, default dtype ``dtype``), parameters on meta; and its float32 rule
    (``_get_dtype_plan``: ``_keep_in_fp32_modules`` for fp16, the strict ones for fp16/bf16)."""
    from transformers.core_model_loading import build_glob_alternation

    config = cls.config_class.from_pretrained(str(folder), local_files_only=True)
    config.dtype = dtype
    for sub in getattr(config, "sub_configs", {}) or {}:
        sub_config = getattr(config, sub, None)
        if sub_config is not None:
            sub_config.dtype = dtype
    module = _build(lambda: cls(config), dtype, headers, source)
    plan = module._get_dtype_plan(dtype)
    if not plan:
        return module, lambda key: False
    pattern, groups, _ = build_glob_alternation(list(plan))

    def fp32(key: str) -> bool:
        m = pattern.search(key)
        return m is not None and plan[groups[m.lastgroup]] == torch.float32

    return module, fp32


def skeleton(cls, folder: str | os.PathLike, *, dtype: torch.dtype,
             library: str) -> nn.Module:
    """The component of ``folder`` (its class ``cls`` of ``library``, "transformers" or
    "diffusers") as a placeholder skeleton in ``dtype`` (module docstring); its
    :class:`StageWeights` are attached (:func:`attached`), every key checked against the
    safetensors headers first."""
    folder = Path(folder)
    source = f"{folder}"
    headers, sharded = checkpoint_headers(folder, library)
    try:
        if library == "transformers":
            module, fp32 = _transformers_module(cls, folder, dtype, headers, source)
            keys, converted = _transformers_keys(module, headers, source=source)
        else:
            import diffusers

            verbosity = diffusers.utils.logging.get_verbosity()
            diffusers.utils.logging.set_verbosity_error()
            try:
                config = cls.load_config(str(folder), local_files_only=True)
                module = _build(lambda: cls.from_config(config), dtype, headers, source)
            finally:
                diffusers.utils.logging.set_verbosity(verbosity)
            keep = tuple(cls._keep_in_fp32_modules or ())
            fp32 = (lambda key: kept_in_fp32(key, keep))  # diffusers' rule, any dtype
            keys, converted = _diffusers_keys(module, headers, sharded=sharded), {}
    except InputError:
        raise
    except (RuntimeError, ValueError, TypeError, OverflowError, AssertionError, OSError) as exc:
        text = " ".join(str(exc).split())
        raise InputError(f"{source}: the {cls.__name__} its config.json describes cannot be "
                         f"built ({type(exc).__name__}: "
                         f"{text[:160] + '...' if len(text) > 160 else text}). Fix: check its "
                         f"sizes, or save the model again with save_pretrained") from None
    filled = _materialise(module, fp32, keys, headers)
    module.eval()
    state = module.state_dict(keep_vars=True)
    missing = frozenset(k for k, _ in module.named_parameters(remove_duplicate=False)
                        if k not in filled)
    mapped = {k: headers[filled[k]] for k in state if k in filled}
    weights = DiskWeights.for_module(module, mapped, source=source,
                                     skip=lambda key: key not in filled)
    _ATTACHED[module] = StageWeights(module, weights, source, missing,
                                     {k: v for k, v in converted.items() if k not in filled})
    return module


# --------------------------------------------------------------------------------------------
# Writing a traced graph
# --------------------------------------------------------------------------------------------

def write(weights: StageWeights, model, wrapper: nn.Module, out: Path, *,
          external_bytes: int) -> None:
    """Name, stream and optimise ``model`` (traced from ``wrapper`` with ``optimize=False``;
    the parameters are kept by name, :func:`qkrope.export.finalize._optimize`), then write it
    to ``out``: its weights in ``out.data`` past ``external_bytes`` of initializers, else one
    file, made from the external-data form by copying the data in chunks. At most one large
    tensor is in memory at a time."""
    import onnx_ir as ir

    from ..finalize import _optimize
    from ..streaming import inline_external_data, user_errors_unwrapped

    keys = weights.bind(model, wrapper)
    _optimize(model, keys)
    nbytes = sum(v.const_value.nbytes for v in model.graph.initializers.values()
                 if v.const_value is not None)
    form = out.parent / f".{out.name}.streamed"
    shutil.rmtree(form, ignore_errors=True)
    form.mkdir()
    try:
        data = out.name + ".data"
        with user_errors_unwrapped():
            ir.save(model, form / out.name, external_data=data)
        if nbytes > external_bytes:
            (form / out.name).replace(out)
            if (form / data).exists():
                (form / data).replace(out.parent / data)
        else:
            inline_external_data(form / out.name, out)
    finally:
        shutil.rmtree(form, ignore_errors=True)


__all__ = ["StageWeights", "skeleton", "attached", "write", "checkpoint_headers",
           "TRANSFORMERS_WEIGHTS", "TRANSFORMERS_INDEX"]
