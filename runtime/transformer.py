"""A drop-in for diffusers' ``QwenImageTransformer2DModel`` backed by an exported model.

``pipe.transformer = load_transformer("transformer.onnx")`` (ONNX Runtime, any provider) or
``load_transformer("transformer.engine")`` (TensorRT) gives diffusers' ``QwenImagePipeline`` and
``QwenImageEditPipeline`` what they use of a transformer, with nothing else changed:

- ``config``: the diffusers config recorded in the export's sidecar (``in_channels``,
  ``guidance_embeds``, ``axes_dims_rope``, ...), as a diffusers ``FrozenDict`` (attribute and key
  access);
- ``dtype`` and ``device`` of the exported model;
- ``cache_context(name)``: a no-op context (nothing is cached between calls);
- ``forward`` / ``__call__`` with diffusers' signature and return type: ``img_shapes`` in
  diffusers' per-batch form (``[[(1, h, w), ...]] * batch``; every item the same, since the RoPE
  caches have no batch axis), ``txt_seq_lens`` where an installed diffusers still passes it,
  ``guidance``, ``attention_kwargs``, ``return_dict``.

The RoPE caches are built (and memoised) from ``img_shapes`` and the text length by
:func:`qkrope.runtime.build_qwen_rope_caches` and every input is validated before anything
runs. What diffusers' own model takes is taken here too: strided views (a slice of the prompt
embeddings) are copied contiguous for the runner, a 0-dim ``timestep`` is one per batch item. Outputs are tensors the caller owns (a true-CFG pipeline keeps the conditional prediction
while it computes the unconditional one). What the exported graph cannot honour is refused with
a clear error, never ignored: ControlNet residuals, additional timestep conditioning, a LoRA
scale or any other ``attention_kwargs``, a ``guidance`` value for a model exported without
guidance embeddings.
"""

from __future__ import annotations

import contextlib
import numbers
import operator
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from qkrope import dtypes
from qkrope._deps import require
from qkrope.errors import InputError, QkropeError

from ._dropin import frozen_config as _frozen_config
from ._dropin import is_one as _is_one, short_repr as _short_repr
from .caches import QWEN_AXES_DIM, build_qwen_rope_caches, checked_device
from .backends import load
from .runner import Runner


class TransformerLoadError(QkropeError, ValueError):
    """The file is not an exported diffusers transformer (an attention block, or no config)."""


class QwenImageTransformer:
    """What diffusers' Qwen-Image pipelines call on ``pipe.transformer``, run by a qkrope runner
    (see the module docstring). Build it with :func:`load_transformer`."""

    def __init__(self, runner: Runner, *, device: torch.device | str | None = None):
        io = runner.io
        cfg = io.config.diffusers_config if io.config is not None else None
        if not isinstance(cfg, Mapping) or "timestep" not in io.roles:
            raise TransformerLoadError(
                f"{io.source} is not an exported diffusers transformer (its sidecar has "
                f"{'no diffusers_config' if not isinstance(cfg, Mapping) else 'no timestep input'}"
                f"; an attention block cannot stand in for a pipeline's transformer). Fix: export "
                f"with `qkrope export --model transformer --diffusers DIR`.")
        layers = io.config.num_layers_exported
        total = cfg.get("num_layers")
        if layers is not None and total is not None and int(layers) != int(total):
            raise TransformerLoadError(
                f"{io.source} holds {layers} of the model's {total} transformer blocks (exported "
                f"with --layers), so it is not the whole transformer a pipeline needs. Fix: "
                f"export without --layers.")
        self._runner = runner
        self.config = _frozen_config(cfg)
        self.dtype = dtypes.torch_dtype(io.input(io.roles["hidden_states"]).dtype)
        self.device = checked_device(device) if device is not None else runner.device
        self._axes_dim = tuple(cfg.get("axes_dims_rope") or QWEN_AXES_DIM)

    # what the pipelines use of a ModelMixin -------------------------------------------------
    @contextlib.contextmanager
    def cache_context(self, name: str):
        """diffusers' cache hook (first-block caching, ...): nothing is cached here."""
        yield

    def eval(self) -> "QwenImageTransformer":
        return self

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor = None,
                encoder_hidden_states_mask: torch.Tensor = None, timestep: torch.Tensor = None,
                img_shapes: Sequence | None = None, txt_seq_lens: Sequence[int] | None = None,
                guidance: torch.Tensor | None = None, attention_kwargs: Mapping | None = None,
                controlnet_block_samples=None, additional_t_cond=None, return_dict: bool = True):
        """diffusers' ``QwenImageTransformer2DModel.forward``: returns
        ``Transformer2DModelOutput(sample=...)`` or ``(sample,)`` with ``return_dict=False``."""
        self._refuse_unsupported(guidance, attention_kwargs, controlnet_block_samples,
                                 additional_t_cond)
        if encoder_hidden_states is None or timestep is None or img_shapes is None:
            missing = [n for n, v in (("encoder_hidden_states", encoder_hidden_states),
                                      ("timestep", timestep), ("img_shapes", img_shapes)) if v is None]
            raise InputError(f"the transformer needs {', '.join(missing)} (diffusers' pipelines "
                             f"pass them); got None")
        if not isinstance(encoder_hidden_states, torch.Tensor) or encoder_hidden_states.dim() != 3:
            raise InputError(f"encoder_hidden_states must be [batch, text_tokens, "
                             f"{self.config.get('joint_attention_dim')}]; got "
                             f"{getattr(encoder_hidden_states, 'shape', type(encoder_hidden_states))}")
        txt = int(encoder_hidden_states.shape[1])
        batch = int(encoder_hidden_states.shape[0])
        if txt_seq_lens is not None:
            _check_txt_seq_lens(txt_seq_lens, batch, txt)
        if isinstance(timestep, numbers.Real) and not isinstance(timestep, bool):
            timestep = torch.tensor(float(timestep))
        if isinstance(timestep, torch.Tensor) and timestep.dim() == 0:
            # one timestep for the whole batch (what diffusers' pipelines may pass)
            timestep = timestep.reshape(1).expand(batch)
        if isinstance(timestep, torch.Tensor):
            timestep = timestep.to(self.dtype)
        mask = encoder_hidden_states_mask
        if mask is not None and isinstance(mask, torch.Tensor):
            mask = mask.to(torch.bool)  # diffusers passes 1/0 integers: True = attend
        # diffusers' model takes strided views (a slice of the prompt embeddings, an expanded
        # timestep); the runner binds memory as is and refuses them, so the drop-in copies
        # the ones that are not contiguous
        hidden_states, encoder_hidden_states, mask, timestep = (
            t.contiguous() if isinstance(t, torch.Tensor) else t
            for t in (hidden_states, encoder_hidden_states, mask, timestep))
        caches = build_qwen_rope_caches(img_shapes, txt, axes_dim=self._axes_dim,
                                        device=hidden_states.device
                                        if isinstance(hidden_states, torch.Tensor) else None)
        if isinstance(hidden_states, torch.Tensor) and hidden_states.dim() == 3 \
                and caches.img.shape[0] != hidden_states.shape[1]:
            raise InputError(
                f"img_shapes {img_shapes} give {caches.img.shape[0]} image tokens but "
                f"hidden_states has {hidden_states.shape[1]}: img_shapes are the latent patch "
                f"grids (frames, height / vae_scale / 2, width / vae_scale / 2) of the images")
        # copy_outputs: the caller owns the result (a reused buffer would make true CFG's
        # conditional and unconditional predictions the same tensor)
        sample = self._runner(hidden_states, encoder_hidden_states, caches, mask, timestep)
        sample = sample.clone() if not self._runner.copy_outputs else sample
        if not return_dict:
            return (sample,)
        outputs = require("diffusers.models.modeling_outputs",
                          "returning diffusers' Transformer2DModelOutput")
        return outputs.Transformer2DModelOutput(sample=sample)

    def _refuse_unsupported(self, guidance, attention_kwargs, controlnet_block_samples,
                            additional_t_cond) -> None:
        if controlnet_block_samples is not None:
            raise InputError("controlnet_block_samples: the exported transformer has no ControlNet "
                             "residual inputs. Fix: run a ControlNet pipeline on the PyTorch model")
        if additional_t_cond is not None:
            raise InputError("additional_t_cond: the exported transformer takes no additional "
                             "timestep conditioning (use_additional_t_cond models are not exported)")
        if guidance is not None:
            why = ("this transformer was exported without guidance embeddings "
                   "(guidance_embeds=False), so the value cannot be honoured. Fix: call the "
                   "pipeline without guidance_scale"
                   if not self.config.get("guidance_embeds", False) else
                   "guidance-distilled Qwen-Image models are not exported by qkrope yet (the "
                   "graph has no guidance input)")
            raise InputError(f"guidance was given, but {why}")
        if attention_kwargs is None:
            return
        if not isinstance(attention_kwargs, Mapping):
            raise InputError(f"attention_kwargs must be a dict (or None); got "
                             f"{type(attention_kwargs).__name__} {_short_repr(attention_kwargs)}. "
                             f"Fix: drop it, or pass a dict such as {{'scale': 1.0}}")
        others = sorted((k for k in attention_kwargs if k != "scale"), key=repr)
        scale = attention_kwargs.get("scale", 1.0)
        if others or not _is_one(scale):
            raise InputError(
                f"attention_kwargs {_short_repr(dict(attention_kwargs))} cannot be honoured by an "
                f"exported graph (a LoRA scale other than 1 or processor arguments change "
                f"weights or code that were fixed at export). Fix: fuse the LoRA into the "
                f"weights and re-export, or drop attention_kwargs")

    def __repr__(self) -> str:
        return (f"QwenImageTransformer({self._runner.io.source}, backend={self._runner.backend}, "
                f"dtype={self.dtype}, device={self.device})")


def _check_txt_seq_lens(value: Any, batch: int, txt: int) -> None:
    """diffusers' ``txt_seq_lens``: one text length per batch item, each in 0..txt (the lengths
    themselves come from the mask; they are checked, not used)."""
    expected = (f"txt_seq_lens must be a list of {batch} integer text lengths (one per batch "
                f"item, each between 0 and the {txt} text tokens of encoder_hidden_states)")
    items = value.tolist() if isinstance(value, torch.Tensor) and value.dim() == 1 else value
    try:
        if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
            raise TypeError
        lens = [operator.index(n) for n in items]
    except TypeError:
        raise InputError(f"{expected}; got {_short_repr(value)}. Fix: pass "
                         f"prompt_embeds_mask.sum(dim=1).tolist(), or omit it") from None
    if len(lens) != batch or any(n < 0 or n > txt for n in lens):
        raise InputError(f"{expected}; got {lens}. Fix: pass prompt_embeds_mask.sum(dim=1)"
                         f".tolist(), or omit it")


def load_transformer(path: str | os.PathLike, *, plugin: str | os.PathLike | None = None,
                     providers: Sequence | None = None,
                     provider_options: Sequence[Mapping] | None = None, sess_options=None,
                     cuda_graph: bool = False,
                     device: torch.device | str | None = None):
    """Open an exported diffusers transformer (Qwen-Image: :class:`QwenImageTransformer`;
    FLUX.1/FLUX.2: :class:`qkrope.runtime.flux_transformer.FluxTransformer`, by the sidecar's
    ``config.family``) (``.onnx``: ONNX Runtime with ``providers``,
    ``provider_options`` and ``sess_options``; ``.engine``/``.plan``: TensorRT with the
    QKNormRoPE ``plugin`` and ``cuda_graph``) as a drop-in for ``pipe.transformer`` (module
    docstring). The options go to :func:`qkrope.runtime.load` as given, its defaults included
    (ONNX Runtime without memory patterns). An unknown ``device`` is refused before the model
    is opened."""
    if device is not None:
        device = checked_device(device)
    runner = load(path, plugin=plugin, providers=providers, provider_options=provider_options,
                  sess_options=sess_options, cuda_graph=cuda_graph)
    return transformer_for_runner(runner, device=device)


def transformer_for_runner(runner: Runner, *, device: torch.device | str | None = None):
    """The drop-in (Qwen-Image or FLUX, by the model's family) over any runner: a local model
    (:func:`load_transformer`), a Triton server (:mod:`qkrope.runtime.runner_triton`)."""
    family = getattr(runner.io.config, "family", None)
    if family in ("flux1", "flux2"):  # FLUX.1 / FLUX.2 (qkrope.model_io.FAMILIES)
        return _flux_transformer(runner, device)
    return QwenImageTransformer(runner, device=device)


def _flux_transformer(runner: Runner, device):
    """The FLUX drop-in (:class:`qkrope.runtime.flux_transformer.FluxTransformer`) for a FLUX
    export, with the same checks as Qwen-Image's: a whole exported transformer."""
    from .flux_transformer import FluxTransformer

    io = runner.io
    cfg = io.config.diffusers_config
    if not isinstance(cfg, Mapping) or "timestep" not in io.roles:
        raise TransformerLoadError(
            f"{io.source} is not an exported diffusers transformer (its sidecar has no "
            f"diffusers_config or no timestep input). Fix: export with `qkrope export --model "
            f"transformer --diffusers DIR`.")
    return FluxTransformer(runner, cfg, device=device)


__all__ = ["QwenImageTransformer", "TransformerLoadError", "load_transformer",
           "transformer_for_runner"]
