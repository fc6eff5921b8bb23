"""FLUX.3's part of the pipeline drop-in (runtime layer).

FLUX.3's pipelines are modular: ``Flux3ModularPipeline``'s denoiser calls
``components.transformer(hidden_states=, timestep=, return_dict=False, encoder_hidden_states=,
txt_ids=, **fields)``, where ``fields`` are the collected inputs whose names
``inspect.signature(transformer.forward)`` lists (``img_ids``; ``image_cond_hidden_states`` and
``image_cond_ids`` for image-to-image): the drop-in's forward shows ``FORWARD_ARGS`` as its
signature (qkrope.runtime._dropin), so the same fields reach it. Swap it in with
``pipe.update_components(transformer=load_transformer(...))``.

:meth:`Flux3Transformer.prepare` maps a call onto the graph: the packed image tokens and the
text as given, the flow timestep per item, the ids the pipeline passes as the "ids" scheme's
request, and a flow-map export's ``target_timestep`` per item (``Flux3DistilledModularPipeline``).
Refused in one line: the reference image (``image_cond_hidden_states`` / ``image_cond_ids``: the
graph has no input for that stream), a ``target_timestep`` for an export without one and none
for a flow-map export, ``attention_kwargs`` other than a LoRA scale of 1, a text batch other than
the image's.
"""

from __future__ import annotations

import numpy as np

from qkrope.errors import InputError
from qkrope.families._contract import DropinHooks as CONTRACT  # noqa: F401
from qkrope.model_io import TARGET_TIMESTEP
from qkrope.runtime._dropin import (Call, Transformer, require_arguments, per_item,
                                    position_ids, refuse_kwargs, tensor_arg)

from . import IMAGE_ROPE_SCALE

#: The one line a reference image gets.
IMAGE_COND_REFUSED = ("image_cond_hidden_states / image_cond_ids (FLUX.3's reference-image "
                      "stream, image-to-image) are not in the exported graph, which holds the "
                      "text and image streams only. Fix: run image-to-image on the PyTorch "
                      "transformer, or call without reference images")
#: The one line a target_timestep gets where the export is not a flow map's.
TARGET_TIMESTEP_REFUSED = ("target_timestep is a flow-map model's (flow_map=True, "
                           "Flux3DistilledModularPipeline); this export is of a model without "
                           "one (its graph has no target_timestep input). Fix: load the export "
                           "of the flow-map checkpoint, or call without target_timestep")
#: The one line a flow-map export called without one gets.
TARGET_TIMESTEP_MISSING = ("this export is of a FLUX.3 flow-map model (flow_map=True): every "
                           "call needs target_timestep, the timestep the step jumps to. Fix: "
                           "run it in Flux3DistilledModularPipeline, which passes it")


def pipeline_ids(img_shape, txt_len: int, scale: float = IMAGE_ROPE_SCALE):
    """(txt_ids, img_ids) float32 ``[tokens, 4]`` as the FLUX.3 pipelines lay them out for one
    image of ``img_shape`` ``(1, h, w)`` tokens and ``txt_len`` text tokens: the image at (0,
    row * scale, column * scale, 0) (float32 products, as Flux3PrepareLatentsStep's), the text
    at (0, 0, 0, index)."""
    _, h, w = (int(v) for v in img_shape)
    rows, cols = np.meshgrid(np.arange(h, dtype=np.float32), np.arange(w, dtype=np.float32),
                             indexing="ij")
    img = np.zeros((h * w, 4), np.float32)
    img[:, 1] = rows.reshape(-1) * np.float32(scale)
    img[:, 2] = cols.reshape(-1) * np.float32(scale)
    txt = np.zeros((int(txt_len), 4), np.float32)
    txt[:, 3] = np.arange(int(txt_len), dtype=np.float32)
    return txt, img


def sample_request(record, img_shapes, txt_len: int) -> dict:
    """The ids of a sample: the first image's and the text's (:func:`pipeline_ids`)."""
    txt, img = pipeline_ids(img_shapes[0], txt_len)
    return {"txt_ids": txt, "img_ids": img}


class Flux3Transformer(Transformer):
    """What the FLUX.3 modular pipeline calls on its ``transformer`` (module docstring)."""

    PIPELINES = "Flux3ModularPipeline, Flux3DistilledModularPipeline (text-to-image)"
    FORWARD_ARGS = ("hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids",
                    "image_cond_hidden_states", "image_cond_ids", "target_timestep",
                    "attention_kwargs", "return_dict")

    def prepare(self, hidden_states=None, encoder_hidden_states=None, timestep=None,
                img_ids=None, txt_ids=None, image_cond_hidden_states=None, image_cond_ids=None,
                target_timestep=None, attention_kwargs=None, return_dict: bool = True) -> Call:
        if image_cond_hidden_states is not None or image_cond_ids is not None:
            raise InputError(IMAGE_COND_REFUSED)
        flow_map = TARGET_TIMESTEP.role in self._runner.io.roles
        if target_timestep is not None and not flow_map:
            raise InputError(TARGET_TIMESTEP_REFUSED)
        if target_timestep is None and flow_map:
            raise InputError(TARGET_TIMESTEP_MISSING)
        refuse_kwargs(attention_kwargs, "attention_kwargs")
        require_arguments(self.record.short, hidden_states=hidden_states,
                          encoder_hidden_states=encoder_hidden_states,
                          timestep=timestep, img_ids=img_ids, txt_ids=txt_ids)
        image = tensor_arg(hidden_states, "hidden_states", 3,
                           "[batch, image tokens, channels] (the packed latent)")
        text = tensor_arg(encoder_hidden_states, "encoder_hidden_states", 3,
                          "[batch, text tokens, features] (the prompt embeddings)")
        batch = int(image.shape[0])
        if int(text.shape[0]) != batch:
            raise InputError(f"hidden_states has batch {batch} but encoder_hidden_states "
                             f"{int(text.shape[0])}; FLUX.3's forward needs one prompt "
                             f"embedding per latent. Fix: repeat the prompt embeddings")
        channels = int(self.config.get("in_channels"))
        if int(image.shape[-1]) != channels:
            raise InputError(f"hidden_states has {int(image.shape[-1])} channels (last axis); "
                             f"this model takes {channels}. Fix: pass the packed latent of "
                             f"this model's pipeline")
        fix = "pass the ids the FLUX.3 pipeline prepares"
        axes = len(self._setting.axes_dim)
        request = {"txt_ids": position_ids(txt_ids, "txt_ids", int(text.shape[1]), axes,
                                           fix=fix),
                   "img_ids": position_ids(img_ids, "img_ids", int(image.shape[1]), axes,
                                           fix=fix)}
        conditioning = ({TARGET_TIMESTEP.role: per_item(target_timestep, "target_timestep",
                                                        batch, self.dtype)} if flow_map else {})
        return Call(image.to(self.dtype), text.to(self.dtype), request,
                    timestep=per_item(timestep, "timestep", batch, self.dtype),
                    conditioning=conditioning, return_dict=return_dict)


def dropin_class(record):
    """The drop-in class of ``record`` (the registry's entry point)."""
    return Flux3Transformer


__all__ = ["Flux3Transformer", "dropin_class", "sample_request", "pipeline_ids",
           "IMAGE_COND_REFUSED", "TARGET_TIMESTEP_REFUSED", "TARGET_TIMESTEP_MISSING"]
