"""A drop-in for diffusers' ``FluxTransformer2DModel`` (FLUX.1 dev/schnell/Kontext) and
``Flux2Transformer2DModel`` (FLUX.2 dev/klein) backed by an exported model.

``pipe.transformer = qkrope.runtime.load_transformer("flux.onnx")`` (or a ``.engine``) gives
``FluxPipeline``, ``FluxKontextPipeline``, ``Flux2Pipeline`` and ``Flux2KleinPipeline`` what they
use of a transformer: ``config`` (the exported diffusers config), ``dtype``, ``device``,
``cache_context(name)`` (a no-op) and ``forward`` with diffusers' signature and return type.

The RoPE caches are built from the ``txt_ids``/``img_ids`` each call is given
(:func:`caches_from_ids`; a condition or reference image's ids are part of ``img_ids``). What
the exported graph cannot honour is refused with one line, never ignored: ControlNet residuals,
IP-Adapter image embeddings, a LoRA scale other than 1 (or other ``joint_attention_kwargs``),
FLUX.2's KV-cache modes (``kv_cache``, ``kv_cache_mode``, ``num_ref_tokens``), a ``guidance``
value for a FLUX.1 model exported without guidance embeddings. A FLUX.2 model without guidance
embeddings (klein) ignores ``guidance``, as diffusers' own model does.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from qkrope import dtypes, model_io
from qkrope._deps import require
from qkrope.errors import InputError

from ._dropin import frozen_config, is_one, short_repr
from .component import DropinComponent
from .caches import RopeCaches, build_flux_rope_caches
from .runner import Runner


class IPAdapterUnsupportedError(InputError, AttributeError):
    """An IP-Adapter was asked of the exported model (an AttributeError too: ``hasattr`` on the
    drop-in's ``encoder_hid_proj`` is False)."""


def caches_from_ids(family: str, txt_ids: torch.Tensor, img_ids: torch.Tensor, *,
                    axes_dims: Sequence[int], theta: float, head_dim: int,
                    device: torch.device | str | None = None) -> RopeCaches:
    """FLUX's RoPE caches from its position ids (``[tokens, axes]``; FLUX.1 3 axes, FLUX.2 4):
    :func:`qkrope.runtime.build_flux_rope_caches` (diffusers' ``FluxPosEmbed``/``Flux2PosEmbed``
    tables, float64 then float32, computed in numpy), whose width must be the model's
    ``head_dim`` (FLUX rotates the whole head). The drop-in's one ids -> caches step."""
    caches = build_flux_rope_caches(txt_ids, img_ids, axes_dims=axes_dims, theta=theta,
                                    device=device)
    if caches.img.shape[-1] != head_dim:
        raise InputError(f"{family}: the RoPE axes {list(axes_dims)} give caches of width "
                         f"{caches.img.shape[-1]}, the model's heads are {head_dim} wide. Fix: "
                         f"re-export the model (its sidecar's axes_dims_rope is inconsistent)")
    return caches


def _ids(value: Any, name: str, tokens: int, axes: int) -> torch.Tensor:
    """diffusers' ``txt_ids``/``img_ids``: ``[tokens, axes]``, or ``[batch, tokens, axes]`` with
    every batch item the same (the caches have no batch axis)."""
    example = f"{name} must be [{tokens}, {axes}] position ids (or [batch, {tokens}, {axes}])"
    if not isinstance(value, torch.Tensor):
        raise InputError(f"{example}; got {type(value).__name__}. Fix: pass the ids the FLUX "
                         f"pipeline prepares")
    ids = value
    if ids.dim() == 3:
        if ids.shape[0] > 1 and not bool((ids == ids[:1]).all()):
            raise InputError(f"{name} differs between batch items; the RoPE caches have no batch "
                             f"axis, so every item of a batch must have the same positions. Fix: "
                             f"batch only samples of one size and condition images")
        ids = ids[0]
    if ids.dim() != 2 or ids.shape[0] != tokens or ids.shape[1] != axes:
        raise InputError(f"{example}; got {tuple(value.shape)}. Fix: one row per token of its "
                         f"stream (condition/reference images included in img_ids)")
    return ids


class FluxTransformer(DropinComponent):
    """What diffusers' FLUX pipelines call on ``pipe.transformer``, run by a qkrope runner
    (module docstring). Built by :func:`qkrope.runtime.load_transformer` for a FLUX export."""

    def __init__(self, runner: Runner, config: Mapping[str, Any], *,
                 device: torch.device | str | None = None):
        io = runner.io
        self._runner = runner
        self.family = model_io.FAMILY_NAMES[io.config.family]
        self.config = frozen_config(config)
        self.dtype = dtypes.torch_dtype(io.input(io.roles["hidden_states"]).dtype)
        self.device = torch.device(device) if device is not None else runner.device
        self._axes = tuple(int(a) for a in io.config.axes_dims_rope)
        self._theta = (io.config.rope_theta if io.config.rope_theta is not None
                       else self.family.rope_theta(config))
        self._guided = "guidance" in io.roles

    @contextlib.contextmanager
    def cache_context(self, name: str):
        """diffusers' cache hook (first-block caching, ...): nothing is cached here."""
        yield

    @property
    def encoder_hid_proj(self):
        raise IPAdapterUnsupportedError(
            "IP-Adapter: the exported FLUX transformer has no image-projection (encoder_hid_proj)"
            " or IP-Adapter attention. Fix: run IP-Adapter pipelines on the PyTorch model")

    def eval(self) -> "FluxTransformer":
        return self

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor = None,
                pooled_projections: torch.Tensor = None, timestep: torch.Tensor = None,
                img_ids: torch.Tensor = None, txt_ids: torch.Tensor = None,
                guidance: torch.Tensor = None, joint_attention_kwargs: Mapping | None = None,
                controlnet_block_samples=None, controlnet_single_block_samples=None,
                return_dict: bool = True, controlnet_blocks_repeat: bool = False,
                kv_cache=None, kv_cache_mode: str | None = None, num_ref_tokens: int = 0,
                ref_fixed_timestep: float = 0.0):
        """diffusers' ``FluxTransformer2DModel.forward`` / ``Flux2Transformer2DModel.forward``:
        returns ``Transformer2DModelOutput(sample=...)`` or ``(sample,)``."""
        self._refuse_unsupported(joint_attention_kwargs, controlnet_block_samples,
                                 controlnet_single_block_samples, kv_cache, kv_cache_mode,
                                 num_ref_tokens)
        flux1 = self.family is model_io.FLUX1
        needed = [("encoder_hidden_states", encoder_hidden_states), ("timestep", timestep),
                  ("img_ids", img_ids), ("txt_ids", txt_ids)]
        if flux1:
            needed.append(("pooled_projections", pooled_projections))
        missing = [n for n, v in needed if v is None]
        if missing:
            raise InputError(f"the {self.family.label} transformer needs {', '.join(missing)} "
                             f"(diffusers' pipelines pass them); got None")
        for name, t in (("hidden_states", hidden_states),
                        ("encoder_hidden_states", encoder_hidden_states)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                raise InputError(f"{name} must be [batch, tokens, features]; got "
                                 f"{getattr(t, 'shape', type(t).__name__)}")
        batch = int(hidden_states.shape[0])
        # one prompt for several images: FluxPipeline given prompt_embeds does not repeat them
        # for num_images_per_prompt, and diffusers' model broadcasts the text's batch of 1
        # (through the timestep modulation); the graph has one batch axis, so it is expanded
        if encoder_hidden_states.shape[0] == 1 < batch:
            encoder_hidden_states = encoder_hidden_states.expand(batch, -1, -1)
        if flux1 and isinstance(pooled_projections, torch.Tensor) \
                and pooled_projections.dim() == 2 and pooled_projections.shape[0] == 1 < batch:
            pooled_projections = pooled_projections.expand(batch, -1)
        conditioning: dict[str, torch.Tensor] = {}
        if flux1:
            conditioning["pooled_projections"] = pooled_projections.to(self.dtype)
        if guidance is not None and self._guided:
            conditioning["guidance"] = self._per_item(guidance, "guidance", batch)
        elif guidance is not None and flux1:
            raise InputError("guidance was given, but this FLUX.1 transformer was exported "
                             "without guidance embeddings (guidance_embeds=False, e.g. schnell)"
                             ", so the value cannot be honoured. Fix: drop guidance")
        elif guidance is None and self._guided:
            raise InputError("this transformer embeds a guidance scale (guidance_embeds=True, "
                             "e.g. FLUX dev) and needs guidance=[batch] values; got None. Fix: "
                             "pass guidance (the pipeline's guidance_scale)")
        # FLUX.2 without guidance embeddings (klein): diffusers ignores guidance, so does this
        timestep = self._per_item(timestep, "timestep", batch)
        axes = len(self._axes)
        caches = caches_from_ids(
            self.family.name,
            _ids(txt_ids, "txt_ids", int(encoder_hidden_states.shape[1]), axes),
            _ids(img_ids, "img_ids", int(hidden_states.shape[1]), axes),
            axes_dims=self._axes, theta=self._theta, head_dim=int(self._runner.io.head_dim),
            device=hidden_states.device)
        hidden_states, encoder_hidden_states = (t.contiguous() for t in (hidden_states,
                                                                       encoder_hidden_states))
        conditioning = {k: v.contiguous() for k, v in conditioning.items()}
        sample = self._runner(hidden_states, encoder_hidden_states, caches, None, timestep,
                              conditioning=conditioning)
        sample = sample.clone() if not self._runner.copy_outputs else sample
        if not return_dict:
            return (sample,)
        outputs = require("diffusers.models.modeling_outputs",
                          "returning diffusers' Transformer2DModelOutput")
        return outputs.Transformer2DModelOutput(sample=sample)

    def _per_item(self, value: Any, name: str, batch: int) -> torch.Tensor:
        """A number, a 0-dim tensor or ``[batch]`` values as ``[batch]`` in the model dtype."""
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            value = torch.tensor(float(value))
        if not isinstance(value, torch.Tensor):
            raise InputError(f"{name} must be a tensor of {batch} values (one per batch item); "
                             f"got {type(value).__name__}")
        if value.dim() == 0 or (value.dim() == 1 and value.shape[0] == 1 and batch > 1):
            value = value.reshape(1).expand(batch)
        return value.to(self.dtype).contiguous()

    def _refuse_unsupported(self, joint_attention_kwargs, controlnet_block_samples,
                            controlnet_single_block_samples, kv_cache, kv_cache_mode,
                            num_ref_tokens) -> None:
        if controlnet_block_samples is not None or controlnet_single_block_samples is not None:
            raise InputError("controlnet_block_samples / controlnet_single_block_samples: the "
                             "exported FLUX transformer has no ControlNet residual inputs. Fix: "
                             "run ControlNet pipelines on the PyTorch model")
        if kv_cache is not None or kv_cache_mode is not None or num_ref_tokens:
            raise InputError(
                f"FLUX.2's KV cache (kv_cache_mode={kv_cache_mode!r}, num_ref_tokens="
                f"{num_ref_tokens!r}) is not in the exported graph, which recomputes the "
                f"reference tokens every step. Fix: use Flux2KleinPipeline (not the KV pipeline)"
                f", or run the KV pipeline on the PyTorch model")
        kwargs = joint_attention_kwargs
        if kwargs is None:
            return
        if not isinstance(kwargs, Mapping):
            raise InputError(f"joint_attention_kwargs must be a dict (or None); got "
                             f"{type(kwargs).__name__} {short_repr(kwargs)}")
        if any(k in kwargs for k in ("ip_adapter_image_embeds", "ip_hidden_states")):
            raise IPAdapterUnsupportedError(
                "joint_attention_kwargs carries IP-Adapter image embeddings, which the exported "
                "FLUX transformer cannot take. Fix: run IP-Adapter pipelines on the PyTorch model")
        others = sorted((k for k in kwargs if k != "scale"), key=repr)
        if others or not is_one(kwargs.get("scale", 1.0)):
            raise InputError(
                f"joint_attention_kwargs {short_repr(dict(kwargs))} cannot be honoured by an "
                f"exported graph (a LoRA scale other than 1 or processor arguments change "
                f"weights or code that were fixed at export). Fix: fuse the LoRA into the "
                f"weights and re-export, or drop joint_attention_kwargs")

    def __repr__(self) -> str:
        return (f"FluxTransformer({self.family.label}: {self._runner.io.source}, backend="
                f"{self._runner.backend}, dtype={self.dtype}, device={self.device})")


__all__ = ["FluxTransformer", "IPAdapterUnsupportedError", "caches_from_ids"]
