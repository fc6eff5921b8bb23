"""The diffusers drop-in, once for every family: ``pipe.transformer = load_transformer(path)``
gives a pipeline what it uses of its transformer, run by a qkrope runner.

The generic part (:class:`Transformer`): the exported diffusers ``config`` (a ``FrozenDict``),
``dtype``, ``device``, ``cache_context`` (a no-op), ``eval``, and ``forward`` with the family's
signature and diffusers' return type. ``forward`` binds the call to the family's argument names
(``FORWARD_ARGS``) and refuses, in one line, arguments the family's forward does not take (another
family's pipeline arguments: it says what was received and what this export takes); the family's
``prepare`` maps the rest to the runner's inputs and the RoPE request of its position scheme;
the caches are built here (:func:`qkrope.runtime.caches.build_rope_caches`, memoised) and
checked against the model's heads; outputs are tensors the caller owns.

The family part lives in ``qkrope/families/<family>/dropin.py``: a :class:`Transformer` subclass
with ``FORWARD_ARGS`` and ``prepare`` (its refusals, defaults and conversions), found through the
family registry by :func:`load_transformer`. ``forward`` is the generic one for every family (no
family overrides it); what differs between families is what ``prepare`` returns:

- the latent layout in: ``prepare`` makes the runner's tokens of the pipeline's latent
  (``Call.hidden_states``);
- the latent layout out: ``Call.unpack`` maps the runner's sample back to the pipeline's layout
  (None: the sample as the runner gives it);
- the split of one diffusers call into several runner calls and the return type: ``prepare``
  returns a :class:`Split` (one :class:`Call` per group of batch items, each naming its
  ``items``); ``forward`` runs each, unpacks it, and returns diffusers' list of per-sample
  tensors in the call's batch order (stacked into one batch tensor with ``Split.stack``). A
  plain :class:`Call` returns one batch tensor;
- the wrapping of the sample (``Transformer2DModelOutput`` or a tuple): :meth:`Transformer.output`.
"""

from __future__ import annotations

import contextlib
import inspect
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from qkrope import dtypes, model_io
from qkrope._deps import require
from qkrope.errors import InputError, QkropeError

from .component import DropinComponent


class TransformerLoadError(QkropeError, ValueError):
    """The file is not an exported diffusers transformer (an attention block, or no config)."""


def short_repr(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def is_one(scale: Any) -> bool:
    """A LoRA scale of exactly 1 (a number or a one-element tensor), which changes nothing."""
    if isinstance(scale, torch.Tensor):
        return scale.numel() == 1 and not scale.is_complex() and float(scale) == 1.0
    return (isinstance(scale, numbers.Real) and not isinstance(scale, bool)
            and float(scale) == 1.0)


def frozen_config(cfg: Mapping[str, Any]):
    """The exported diffusers config as diffusers' FrozenDict (attribute and key access)."""
    try:
        from diffusers.configuration_utils import FrozenDict
    except ImportError:  # diffusers is what uses the config; without it a plain mapping will do
        return dict(cfg)
    return FrozenDict({k: (tuple(v) if isinstance(v, list) else v) for k, v in cfg.items()})


def refuse_kwargs(kwargs: Any, name: str) -> None:
    """``attention_kwargs`` / ``joint_attention_kwargs``: None, or a dict whose only key is a
    LoRA ``scale`` of exactly 1; anything else changes what was fixed at export."""
    if kwargs is None:
        return
    if not isinstance(kwargs, Mapping):
        raise InputError(f"{name} must be a dict (or None); got {type(kwargs).__name__} "
                         f"{short_repr(kwargs)}. Fix: drop it, or pass a dict such as "
                         f"{{'scale': 1.0}}")
    others = sorted((k for k in kwargs if k != "scale"), key=repr)
    if others or not is_one(kwargs.get("scale", 1.0)):
        raise InputError(
            f"{name} {short_repr(dict(kwargs))} cannot be honoured by an exported graph (a LoRA "
            f"scale other than 1 or processor arguments change weights or code that were fixed "
            f"at export). Fix: fuse the LoRA into the weights and re-export, or drop {name}")


def missing_arguments(who: str, missing: list[str]) -> InputError:
    """The one-line error of a call that gives required arguments as None."""
    who = f"the {who} transformer" if who else "the transformer"
    return InputError(f"{who} needs {', '.join(missing)}; got None. Fix: pass what the "
                      f"family's diffusers pipeline passes its transformer (the drop-in takes "
                      f"the same call)")


def require_arguments(who: str, **given: Any) -> None:
    """Raise :func:`missing_arguments` naming every keyword of ``given`` that is None (in the
    order given): the check a drop-in's ``prepare`` makes of the arguments its graph needs."""
    missing = [name for name, value in given.items() if value is None]
    if missing:
        raise missing_arguments(who, missing)


def per_item(value: Any, name: str, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """A number, a 0-dim tensor or ``[batch]`` values as ``[batch]`` in ``dtype``."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = torch.tensor(float(value))
    if not isinstance(value, torch.Tensor):
        raise InputError(f"{name} must be a tensor of {batch} values (one per batch item); got "
                         f"{type(value).__name__} {short_repr(value, 60)}. Fix: pass a number "
                         f"or a [batch] tensor, as the pipelines do")
    if value.dim() == 0 or (value.dim() == 1 and value.shape[0] == 1 and batch > 1):
        value = value.reshape(1).expand(batch)
    return value.to(dtype).contiguous()


def position_ids(value: Any, name: str, tokens: int, axes: int, *, fix: str) -> torch.Tensor:
    """diffusers' per-token position ids (``txt_ids`` / ``img_ids``): ``[tokens, axes]``, or the
    deprecated ``[batch, tokens, axes]`` whose item 0 diffusers uses. The caches have no batch
    axis, so batch items that differ are refused in one line (diffusers would give every item
    item 0's positions); a stride-0 batch (an ``expand``) holds one item and is not compared.
    The shape is checked first. ``fix``: what to pass instead (the pipeline that makes them)."""
    example = f"{name} must be [{tokens}, {axes}] position ids (or [batch, {tokens}, {axes}])"
    if not isinstance(value, torch.Tensor):
        raise InputError(f"{example}; got {type(value).__name__}. Fix: {fix}")
    item = value[0] if value.dim() == 3 and value.shape[0] >= 1 else value
    if item.dim() != 2 or item.shape[0] != tokens or item.shape[1] != axes:
        raise InputError(f"{example}; got {tuple(value.shape)}. Fix: one row per token of its "
                         f"stream (condition/reference images included in img_ids)")
    if value.dim() == 3 and value.shape[0] > 1 and value.stride(0) != 0 \
            and not bool((value == value[:1]).all()):
        raise InputError(f"{name} differs between batch items; the RoPE caches have no batch "
                         f"axis, so every item of a batch must have the same positions. Fix: "
                         f"batch only samples of one size and condition images")
    return item


def tensor_arg(value: Any, name: str, rank: int, layout: str, fix: str = "") -> torch.Tensor:
    """A tensor argument of ``rank`` dimensions (``layout`` names them for the message)."""
    if not isinstance(value, torch.Tensor) or value.dim() != rank:
        got = (f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
               else f"a {type(value).__name__} {short_repr(value, 60)}")
        raise InputError(f"{name} must be a {rank}-D tensor {layout}; got {got}. Fix: "
                         + (fix or f"pass the {rank}-D torch.Tensor the pipeline computes for "
                                   f"{name}"))
    return value


class _SignedForward:
    """``Transformer.forward`` as a descriptor: read off a drop-in, a callable whose signature
    (``__signature__``) is the family's ``FORWARD_ARGS`` (each defaulting to None), not the
    generic ``(*args, **kwargs)``. diffusers' modular denoisers pass a collected field to their
    transformer only where ``inspect.signature(transformer.forward)`` names it (FLUX.3's
    ``img_ids``, Qwen-Image's ``img_shapes``, ...); the call itself is the generic forward's."""

    def __init__(self, function):
        self.function = function
        self.__doc__ = function.__doc__
        self._signatures: dict[type, inspect.Signature] = {}

    def signature(self, owner: type) -> inspect.Signature:
        if owner not in self._signatures:
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
            self._signatures[owner] = inspect.Signature(
                [inspect.Parameter(n, kind, default=None) for n in owner.FORWARD_ARGS])
        return self._signatures[owner]

    def __get__(self, instance, owner=None):
        if instance is None:
            return self.function
        return _BoundForward(self.function, instance, self.signature(type(instance)))


class _BoundForward:
    """A drop-in's ``forward``, bound, with the family's signature (:class:`_SignedForward`)."""

    __slots__ = ("__func__", "__self__", "__signature__")

    def __init__(self, function, instance, signature: inspect.Signature):
        self.__func__, self.__self__, self.__signature__ = function, instance, signature

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)



@dataclass
class Call:
    """What a family's ``prepare`` makes of one forward call (or of one group of a
    :class:`Split`): the runner's inputs, the position request (the fields of the family's
    scheme) the caches are built from, and how the runner's sample goes back to the pipeline."""

    hidden_states: torch.Tensor
    encoder_hidden_states: torch.Tensor
    request: dict
    timestep: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    conditioning: dict = field(default_factory=dict)
    return_dict: bool = True
    #: The latent layout out: the runner's sample ``[batch, tokens, features]`` as the
    #: pipeline's latent (unpatchified); None: the sample as the runner gives it.
    unpack: Callable[[torch.Tensor], Any] | None = None
    #: In a :class:`Split`: the batch items of the diffusers call this call runs, in the order
    #: of its rows (None: every item, in order).
    items: Sequence[int] | None = None


@dataclass
class Split:
    """One diffusers call run as several runner calls (groups of batch items whose positions or
    shapes differ, so no one graph call holds them all). ``forward`` runs each :class:`Call`,
    unpacks its sample, and returns diffusers' list of ``batch`` per-sample tensors (each
    group's rows placed at its ``items``): the return type of a forward that takes and returns
    per-sample lists; with ``stack`` the per-sample tensors stacked into one batch tensor (a
    forward that takes and returns batch tensors, whose items' positions differ)."""

    calls: Sequence[Call]
    batch: int
    return_dict: bool = True
    stack: bool = False


class Transformer(DropinComponent):
    """A pipeline's ``transformer`` backed by an exported model (module docstring); a family's
    drop-in subclasses it with ``FORWARD_ARGS`` and ``prepare``. Built by
    :func:`load_transformer`."""

    #: The family's forward arguments, in diffusers' order (positional calls bind to them).
    FORWARD_ARGS: tuple = ()
    #: The pipelines this drop-in serves, for messages.
    PIPELINES: str = ""

    def __init__(self, runner, record, *, device: torch.device | str | None = None):
        from . import schemes
        from .caches import checked_device, model_setting
        from .latents import latent_of

        io = runner.io
        cfg = io.config.diffusers_config if io.config is not None else None
        if not isinstance(cfg, Mapping) or "timestep" not in io.roles:
            raise TransformerLoadError(
                f"{io.source} is not an exported diffusers transformer (its sidecar has "
                f"{'no diffusers_config' if not isinstance(cfg, Mapping) else 'no timestep input'}"
                f"; an attention block cannot stand in for a pipeline's transformer). Fix: export "
                f"with `qkrope export --model transformer --diffusers DIR`.")
        layers = io.config.num_layers_exported
        # the model's blocks: every list its record runs (FLUX: double + single), in the config
        keys = [blocks.key for blocks in record.block_lists] or [record.blocks_key]
        counts = [cfg.get(key) for key in keys]
        total = sum(int(c) for c in counts) if all(
            isinstance(c, int) and not isinstance(c, bool) for c in counts) else None
        if layers is not None and total is not None and int(layers) != int(total):
            raise TransformerLoadError(
                f"{io.source} holds {layers} of the model's {total} transformer blocks (exported "
                f"with --layers), so it is not the whole transformer a pipeline needs. Fix: "
                f"export without --layers.")
        self._runner = runner
        self.record = record
        self.config = frozen_config(cfg)
        self.dtype = dtypes.torch_dtype(io.input(io.roles["hidden_states"]).dtype)
        self.device = checked_device(device) if device is not None else runner.device
        self._setting = model_setting(io.config, record, io.source)
        self._scheme = schemes.scheme(record.scheme)
        self._latent = latent_of(record, cfg)

    # what the pipelines use of a ModelMixin -------------------------------------------------
    @contextlib.contextmanager
    def cache_context(self, name: str, **kwargs):
        """diffusers' cache hook (first-block caching, ...; Wan's pipelines add the step's
        ``step_index`` / ``sigma``): nothing is cached here."""
        yield

    def eval(self):
        return self

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def _bind(self, args: tuple, kwargs: dict) -> dict:
        """The call's arguments by name; arguments this family's forward does not take are
        refused in one line, naming the family whose pipeline passes them where one does."""
        names = self.FORWARD_ARGS
        if len(args) > len(names):
            raise InputError(f"the {self.record.short} transformer takes at most {len(names)} "
                             f"positional arguments ({', '.join(names)}); got {len(args)}")
        bound = dict(zip(names, args))
        twice = sorted(set(bound) & set(kwargs))
        if twice:
            raise InputError(f"the {self.record.short} transformer got {', '.join(twice)} both "
                             f"by position and by name")
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            owner = _owner_of(unknown, self.record)
            raise InputError(
                f"the {self.record.short} transformer received {', '.join(unknown)}"
                + (f", which {owner}'s pipelines pass" if owner else "")
                + f"; this export takes {', '.join(names)} ({self.PIPELINES or 'its pipelines'})"
                f". Fix: run this export with its own family's pipeline"
                + (f", or export the {owner} model to run {owner}'s" if owner else ""))
        bound.update(kwargs)
        return bound

    def prepare(self, **call) -> "Call | Split":  # the family's part
        raise NotImplementedError

    @_SignedForward
    def forward(self, *args, **kwargs):
        """diffusers' forward of the family: returns ``Transformer2DModelOutput(sample=...)`` or
        ``(sample,)`` with ``return_dict=False``; the sample is the family's latent layout (a
        batch tensor), or a list of per-sample tensors where ``prepare`` returns a
        :class:`Split`."""
        prepared = self.prepare(**self._bind(args, kwargs))
        if isinstance(prepared, Split):
            sample = self._assemble(prepared)
            if prepared.stack:
                sample = torch.stack(sample)
        else:
            sample = self._unpacked(prepared, self.run(prepared))
        return self.output(sample, prepared.return_dict)

    def run(self, call: Call) -> torch.Tensor:
        """One runner call: the caches of the call's request, the inputs as the runner binds
        them; the runner's sample, a tensor the caller owns."""
        caches = self.rope_caches(call)
        if self._latent.rank != 3 and isinstance(call.hidden_states, torch.Tensor):
            # a latent the model patchifies itself: its token grid must be the request's
            tokens = self._latent.tokens(tuple(call.hidden_states.shape))
            # latents the model joins before its own (history) have cache rows too, each at
            # the latent's patch (model_io.HISTORY_ROLES)
            tokens += sum(self._latent.tokens(tuple(v.shape), k)
                          for k, v in call.conditioning.items()
                          if model_io.role_of(k) in model_io.HISTORY_ROLES)
            if tokens != caches.img.shape[0]:
                raise InputError(
                    f"the position request ({', '.join(call.request)}) gives "
                    f"{caches.img.shape[0]} image tokens but hidden_states "
                    f"{list(call.hidden_states.shape)} patchifies into {tokens} (patch "
                    f"{list(self._latent.patch)}). Fix: pass the positions of this latent")
        # diffusers' model takes strided views (a slice of the prompt embeddings, an expanded
        # timestep); the runner binds memory as is and refuses them, so the drop-in copies
        # the ones that are not contiguous
        hidden_states, encoder_hidden_states, mask, timestep = (
            t.contiguous() if isinstance(t, torch.Tensor) else t
            for t in (call.hidden_states, call.encoder_hidden_states, call.mask, call.timestep))
        conditioning = {k: v.contiguous() for k, v in call.conditioning.items()}
        sample = self._runner(hidden_states, encoder_hidden_states, caches, mask, timestep,
                              conditioning=conditioning)
        # copy_outputs: the caller owns the result (a reused buffer would make true CFG's
        # conditional and unconditional predictions the same tensor)
        if self._runner.copy_outputs:
            return sample
        # a model of several outputs (a video and an audio prediction) gives their tuple
        return tuple(t.clone() for t in sample) if isinstance(sample, tuple) else sample.clone()

    @staticmethod
    def _unpacked(call: Call, sample):
        """The latent layout out: the call's ``unpack`` of the runner's sample."""
        return call.unpack(sample) if call.unpack is not None else sample

    def _assemble(self, split: Split) -> list:
        """A :class:`Split`'s groups run and unpacked, their rows put back in the diffusers
        call's batch order: a list of ``split.batch`` per-sample tensors."""
        out: list = [None] * int(split.batch)
        for call in split.calls:
            items = range(len(out)) if call.items is None else [int(i) for i in call.items]
            rows = self._unpacked(call, self.run(call))
            rows = list(rows.unbind(0)) if isinstance(rows, torch.Tensor) else list(rows)
            if len(rows) != len(items) or len(set(items)) != len(items) or any(
                    not 0 <= i < len(out) or out[i] is not None for i in items):
                raise RuntimeError(f"{type(self).__name__}.prepare split a batch of "
                                   f"{len(out)} badly: a group of items {list(items)} gave "
                                   f"{len(rows)} samples (each item in exactly one group)")
            for i, row in zip(items, rows):
                out[i] = row
        missing = [i for i, row in enumerate(out) if row is None]
        if missing:
            raise RuntimeError(f"{type(self).__name__}.prepare left batch items {missing} out "
                               f"of every group")
        return out

    def output(self, sample, return_dict: bool):
        """diffusers' return of the sample: ``Transformer2DModelOutput(sample=...)``, or
        ``(sample,)`` with ``return_dict=False``."""
        if not return_dict:
            return (sample,)
        outputs = require("diffusers.models.modeling_outputs",
                          "returning diffusers' Transformer2DModelOutput")
        return outputs.Transformer2DModelOutput(sample=sample)

    def rope_caches(self, call: Call):
        """The caches of the call's position request (memoised), on the activations' device,
        as wide as the model's heads where it rotates the whole head."""
        from .caches import build_rope_caches

        device = call.hidden_states.device if isinstance(call.hidden_states, torch.Tensor) \
            else None
        caches = build_rope_caches(self.record.scheme, call.request, self._setting,
                                   device=device)
        head_dim = self._runner.io.head_dim
        if head_dim is not None and caches.img.shape[-1] > int(head_dim):
            raise InputError(f"{self.record.short}: the RoPE axes {list(self._setting.axes_dim)} "
                             f"give caches of width {caches.img.shape[-1]}, wider than the "
                             f"model's {head_dim}-wide heads. Fix: re-export the model (its "
                             f"sidecar's axes_dims_rope is inconsistent)")
        return caches

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.record.short}: {self._runner.io.source}, "
                f"backend={self._runner.backend}, dtype={self.dtype}, device={self.device})")


def _owner_of(names: Sequence[str], record) -> str | None:
    """The families (other than ``record``'s folder) whose drop-in's forward takes all of
    ``names``, as a user calls them ("FLUX.1 / FLUX.2"), or None."""
    from qkrope import families

    owners = []
    for other in families.records():
        if other.package == record.package:
            continue
        args = getattr(families.hooks(other, "dropin").dropin_class(other), "FORWARD_ARGS", ())
        if names and all(n in args for n in names):
            owners.append(other.short)
    return " / ".join(owners) or None


def load_transformer(path: str | os.PathLike, *, plugin: str | os.PathLike | None = None,
                     providers: Sequence | None = None,
                     provider_options: Sequence[Mapping] | None = None, sess_options=None,
                     cuda_graph: bool = False, allow_host_code: bool = False,
                     device: torch.device | str | None = None) -> Transformer:
    """Open an exported diffusers transformer as a drop-in for ``pipe.transformer``: the drop-in
    of the family its sidecar names (``config.family``; none: the registry's default), found
    through the family registry (``.onnx``: ONNX Runtime with ``providers``,
    ``provider_options`` and ``sess_options``; ``.engine``/``.plan``: TensorRT with the
    QKNormRoPE ``plugin``, ``cuda_graph`` and ``allow_host_code``). The options go to
    :func:`qkrope.runtime.load` as given, its defaults included (ONNX Runtime without memory
    patterns). An unknown ``device`` is refused before the model is opened."""
    from qkrope import families

    from .backends import load
    from .caches import checked_device

    if device is not None:
        device = checked_device(device)
    runner = load(path, plugin=plugin, providers=providers, provider_options=provider_options,
                  sess_options=sess_options, cuda_graph=cuda_graph,
                  allow_host_code=allow_host_code)
    return transformer_for_runner(runner, device=device)


def transformer_for_runner(runner, *, device=None) -> "Transformer":
    """The drop-in of the runner's model family (through the registry) over any runner: a local
    model (:func:`load_transformer`) or a Triton server (:mod:`qkrope.runtime.runner_triton`)."""
    from qkrope import families
    from .caches import checked_device

    if device is not None:
        device = checked_device(device)
    record = families.by_name(getattr(runner.io.config, "family", None),
                              source=str(runner.io.source))
    cls = families.hooks(record, "dropin").dropin_class(record)
    return cls(runner, record, device=device)
