"""The runtime side shared by every dual-stream family (runtime layer): the position ids its
pipelines lay out (:func:`sample_ids`, from the family's
:class:`qkrope.families._dual_stream.IdsLayout`), the caches from ids with the head-width check
(:func:`caches_from_ids`), the reference forward's keyword arguments (:func:`forward_kwargs`)
and the pipeline drop-in (:class:`DualStreamTransformer`).

The drop-in maps ``pipe.transformer(hidden_states, encoder_hidden_states[,
pooled_projections], timestep, img_ids, txt_ids[, guidance], ...)`` onto the generic drop-in
(:mod:`qkrope.runtime._dropin`) and the "ids" position scheme. Refused in one line, never
ignored: ControlNet residuals, IP-Adapter image embeddings, a LoRA scale other than 1 (or
other ``joint_attention_kwargs``), a ``guidance`` value the model cannot honour (the family's
``DualStream.unguided_guidance``). A family's drop-in is a subclass naming its ``SPEC``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from qkrope.errors import InputError
from qkrope.model_io import GUIDANCE, POOLED_PROJECTIONS

from ._dropin import (Call, Transformer, missing_arguments, per_item, position_ids,
                      refuse_kwargs, tensor_arg)
from .caches import RopeCaches, build_rope_caches, checked_setting
from .schemes import ids as ids_scheme


class IPAdapterUnsupportedError(InputError, AttributeError):
    """An IP-Adapter was asked of the exported model (an AttributeError too: ``hasattr`` on the
    drop-in's ``encoder_hid_proj`` is False)."""


def sample_ids(layout, img_shapes, txt_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(txt_ids, img_ids), float32 ``[tokens, layout.n_axes]``, as the family's pipelines lay
    them out (:class:`qkrope.families._dual_stream.IdsLayout`) for images of ``img_shapes``
    (``(frames, h, w)`` in latent patches, the first the output image, the others condition /
    reference images) and ``txt_len`` text tokens."""
    txt, img = ids_scheme.sample_ids(img_shapes, txt_len, n_axes=layout.n_axes,
                                     image_step=layout.image_step)
    for axis in layout.text_axes:
        txt[:, axis] = np.arange(int(txt_len), dtype=np.float32)
    img[:, 0] += layout.image_first
    img[:, 1:3] += layout.image_offset
    return txt, img


def caches_from_ids(label: str, txt_ids: Any, img_ids: Any, *, axes_dims: Sequence[int],
                    theta: float, head_dim: int,
                    device: torch.device | str | None = None) -> RopeCaches:
    """The RoPE caches of position ids (``[tokens, len(axes_dims)]``), as diffusers' dual-stream
    position embedders compute them (float64, then float32: the "ids" scheme), which must be as
    wide as the model's heads (the model rotates the whole head)."""
    setting = checked_setting("ids", axes_dims, theta, what="axes_dims")
    caches = build_rope_caches("ids", {"txt_ids": txt_ids, "img_ids": img_ids}, setting,
                               device=device)
    if caches.img.shape[-1] != head_dim:
        raise InputError(f"{label}: the RoPE axes {list(axes_dims)} give caches of width "
                         f"{caches.img.shape[-1]}, the model's heads are {head_dim} wide. Fix: "
                         f"re-export the model (its sidecar's axes_dims_rope is inconsistent)")
    return caches


def forward_kwargs(layout, info, by_role: Mapping[str, Any],
                   img_shapes: Sequence[Sequence[int]]) -> dict:
    """diffusers' forward arguments for the graph inputs ``by_role`` (torch tensors by role, as
    :func:`qkrope.runtime.inputs.make_inputs` made them): the same activations, pooled
    projections and guidance where the graph has them, and in place of the caches the position
    ids they were built from (``layout``: the family's pipelines'), so that the stock model
    computes its RoPE from them (float64) as a pipeline's call would."""
    txt_len = int(by_role["encoder_hidden_states"].shape[1])
    txt_ids, img_ids = (torch.from_numpy(a) for a in sample_ids(layout, img_shapes, txt_len))
    kw = dict(hidden_states=by_role["hidden_states"],
              encoder_hidden_states=by_role["encoder_hidden_states"],
              timestep=by_role["timestep"], txt_ids=txt_ids, img_ids=img_ids, return_dict=False)
    for role in (POOLED_PROJECTIONS.role, GUIDANCE.role):
        if role in by_role:
            kw[role] = by_role[role]
    return kw


def refuse_adapters(label: str, joint_attention_kwargs, controlnet_block_samples=None,
                    controlnet_single_block_samples=None) -> None:
    """ControlNet residuals, IP-Adapter image embeddings and any other
    ``joint_attention_kwargs`` than a LoRA scale of 1: one line each."""
    if controlnet_block_samples is not None or controlnet_single_block_samples is not None:
        raise InputError(f"controlnet_block_samples / controlnet_single_block_samples: the "
                         f"exported {label} transformer has no ControlNet residual inputs. Fix: "
                         f"run ControlNet pipelines on the PyTorch model")
    kwargs = joint_attention_kwargs
    if isinstance(kwargs, Mapping) and any(k in kwargs for k in ("ip_adapter_image_embeds",
                                                                  "ip_hidden_states")):
        raise IPAdapterUnsupportedError(
            f"joint_attention_kwargs carries IP-Adapter image embeddings, which the exported "
            f"{label} transformer cannot take. Fix: run IP-Adapter pipelines on the PyTorch model")
    refuse_kwargs(kwargs, "joint_attention_kwargs")


class DualStreamTransformer(Transformer):
    """What a dual-stream family's pipelines call on ``pipe.transformer`` (module docstring);
    a family's drop-in subclasses it with its ``SPEC``
    (:class:`qkrope.families._dual_stream.DualStream`). Built by
    :func:`qkrope.runtime.load_transformer`."""

    SPEC = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.SPEC is not None:
            cls.FORWARD_ARGS = cls.SPEC.forward_args
            cls.PIPELINES = cls.SPEC.pipelines

    def __init__(self, runner, record, *, device=None):
        super().__init__(runner, record, device=device)
        self.family = record
        self.spec = self.spec_for(record)
        self._guided = GUIDANCE.role in runner.io.roles
        self._pooled = POOLED_PROJECTIONS in record.graph.inputs

    @classmethod
    def spec_for(cls, record):
        """The family's :class:`~qkrope.families._dual_stream.DualStream` (a drop-in serving
        several records overrides this)."""
        return cls.SPEC

    @property
    def encoder_hid_proj(self):
        raise IPAdapterUnsupportedError(
            f"IP-Adapter: the exported {self.record.short} transformer has no image-projection "
            f"(encoder_hid_proj) or IP-Adapter attention. Fix: run IP-Adapter pipelines on the "
            f"PyTorch model")

    def refuse(self, call: dict) -> None:
        """The call's arguments the export cannot honour (a family adds its own)."""
        refuse_adapters(self.record.short, call.get("joint_attention_kwargs"),
                        call.get("controlnet_block_samples"),
                        call.get("controlnet_single_block_samples"))
        refuse_adapters(self.record.short, call.get("attention_kwargs"))  # Bria's name

    def prepare(self, **call) -> Call:
        self.refuse(call)
        hidden_states, encoder_hidden_states = (call.get("hidden_states"),
                                                call.get("encoder_hidden_states"))
        pooled, guidance = call.get("pooled_projections"), call.get("guidance")
        names = ["encoder_hidden_states", "timestep", "img_ids", "txt_ids"]
        if self._pooled:
            names.append("pooled_projections")
        missing = [n for n in names if call.get(n) is None]
        if missing:
            raise missing_arguments(self.record.label, missing)
        for name, t in (("hidden_states", hidden_states),
                        ("encoder_hidden_states", encoder_hidden_states)):
            tensor_arg(t, name, 3, "[batch, tokens, features]")
        batch = int(hidden_states.shape[0])
        # one prompt for several images: a pipeline given prompt_embeds may not repeat them for
        # num_images_per_prompt, and diffusers' model broadcasts the text's batch of 1 (through
        # the timestep modulation); the graph has one batch axis, so it is expanded
        if encoder_hidden_states.shape[0] == 1 < batch:
            encoder_hidden_states = encoder_hidden_states.expand(batch, -1, -1)
        conditioning: dict[str, torch.Tensor] = {}
        if self._pooled:
            tensor_arg(pooled, "pooled_projections", 2,
                       f"[batch, {self.config.get('pooled_projection_dim')}] (the pooled CLIP "
                       f"prompt embedding)", "pass the pipeline's pooled_prompt_embeds tensor, "
                       "e.g. torch.stack(items) for a list of [dim] tensors")
            if pooled.shape[0] == 1 < batch:
                pooled = pooled.expand(batch, -1)
            conditioning["pooled_projections"] = pooled.to(self.dtype)
        elif pooled is not None:
            raise InputError(f"pooled_projections was given, but the {self.record.short} "
                             f"transformer takes none (it has no pooled text embedding). Fix: "
                             f"drop it")
        if guidance is not None and self._guided:
            conditioning["guidance"] = per_item(guidance, "guidance", batch, self.dtype)
        elif guidance is not None and self.spec.unguided_guidance == "refuse":
            raise InputError(f"guidance was given, but this {self.record.short} transformer was "
                             f"exported without guidance embeddings (guidance_embeds=False, e.g. "
                             f"a distilled model), so the value cannot be honoured. Fix: drop "
                             f"guidance")
        elif guidance is None and self._guided:
            raise InputError("this transformer embeds a guidance scale (guidance_embeds=True) "
                             "and needs guidance=[batch] values; got None. Fix: pass guidance "
                             "(the pipeline's guidance_scale)")
        # otherwise diffusers' model ignores guidance, and so does this
        timestep = per_item(call.get("timestep"), "timestep", batch, self.dtype)
        axes = len(self._setting.axes_dim)
        fix = f"pass the ids the {self.record.short} pipeline prepares"
        request = {"txt_ids": position_ids(call.get("txt_ids"), "txt_ids",
                                           int(encoder_hidden_states.shape[1]), axes, fix=fix),
                   "img_ids": position_ids(call.get("img_ids"), "img_ids",
                                           int(hidden_states.shape[1]), axes, fix=fix)}
        return Call(hidden_states, encoder_hidden_states, request, timestep=timestep,
                    conditioning=conditioning, return_dict=call.get("return_dict", True))

    def rope_caches(self, call: Call):
        caches = super().rope_caches(call)
        head_dim = self._runner.io.head_dim
        if head_dim is not None and caches.img.shape[-1] != int(head_dim):
            raise InputError(f"{self.record.name}: the RoPE axes {list(self._setting.axes_dim)} "
                             f"give caches of width {caches.img.shape[-1]}, the model's heads are "
                             f"{head_dim} wide. Fix: re-export the model (its sidecar's "
                             f"axes_dims_rope is inconsistent)")
        return caches


def ids_request(layout, img_shapes: Sequence[Sequence[int]], txt_len: int) -> dict:
    """The position request of a sample of these sizes (``make_inputs``, the exporter's
    sample): the ids a dual-stream family's pipelines pass (``layout``: its IdsLayout)."""
    txt, img = sample_ids(layout, img_shapes, txt_len)
    return {"txt_ids": txt, "img_ids": img}


__all__ = ["IPAdapterUnsupportedError", "sample_ids", "caches_from_ids", "forward_kwargs",
           "refuse_adapters", "DualStreamTransformer", "ids_request"]
