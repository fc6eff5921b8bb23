"""The torch.export call of an export: ``torch.onnx.export(..., dynamo=True)`` with the fused
op translated to one ``qkrope::QKNormRoPE`` node per call, each graph input's named axes
dynamic, the parameters named by their state-dict keys, the initializers streamed from the
weight files (:mod:`qkrope.export.streaming`) and the graph optimised
(:func:`qkrope.export.finalize._optimize`)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from qkrope._progress import Steps

from . import latent_axes
from .attention import DEFAULT_ATTENTION_FORM, attention_form
from .finalize import _optimize
from .onnx_function import qk_norm_rope_translation

def _dynamic_shapes(names: Sequence[str]) -> dict[str, dict[int, Any]]:
    """torch.export's dynamic dimensions of each graph input: its named axes
    (:data:`qkrope.model_io.TENSORS`; a 5-D latent's: :mod:`.latent_axes`)."""
    return latent_axes.dynamic_shapes(names, None)

def _torch_export(module: nn.Module, args: tuple, input_names: Sequence[str],
                  output_names: Sequence[str], opset: int, *, parameters_of: str,
                  steps: Steps | None = None, what: str = "the model",
                  attention: str = DEFAULT_ATTENTION_FORM, weights=None, patch=None):
    """torch.onnx.export (dynamo) -> onnx_ir Model with QKNormRoPE nodes (no body yet) whose
    parameters are named by their state-dict keys (:func:`_keep_parameters`).

    ``parameters_of`` is the attribute of the wrapper ``module`` that holds the diffusers module
    (``"attn"``, ``"transformer"``): its state-dict keys name the initializers. ``weights``
    (a :class:`qkrope.export.streaming.TensorSource`, e.g. the shards' DiskWeights): the
    module's parameters are placeholders and each initializer reads its value from there when
    it is written."""
    import logging
    import warnings

    # torch.onnx logs one warning per torchvision op it cannot register when torchvision is
    # absent; that is noise for this model, so it is silenced for the duration of the export.
    registration_log = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration_log.level
    registration_log.setLevel(logging.ERROR)
    steps = steps or Steps("qkrope export", 0, enabled=False)
    with steps.step(f"tracing {what} (torch.export, ONNX translation)"), \
            warnings.catch_warnings(), torch.no_grad(), attention_form(attention):
        warnings.simplefilter("ignore")
        try:
            program = torch.onnx.export(
                module, args, dynamo=True, opset_version=opset, optimize=False, verbose=False,
                input_names=list(input_names), output_names=list(output_names),
                dynamic_shapes=latent_axes.dynamic_shapes(input_names, patch),
                custom_translation_table={
                    torch.ops.qkrope.qk_norm_rope.default: qk_norm_rope_translation},
            )
        finally:
            registration_log.setLevel(level)
    model = program.model
    latent_axes.rename(model, patch)  # a 5-D latent's axes by name (export/latent_axes.py)
    inner = getattr(module, parameters_of)
    keys = _rename_parameters(model, inner.state_dict(), prefix=parameters_of + ".")
    if weights is not None:
        from .streaming import check_no_placeholders, stream_initializers

        stream_initializers(model, weights, keys)
        check_no_placeholders(model, inner)
    with steps.step(f"optimising the graph (onnxscript; {len(keys)} parameters kept by name)"):
        _optimize(model, keys)
    return model


def _rename_parameters(model, state_dict, *, prefix: str) -> list[str]:
    """Name each initializer torch.export lifted from a parameter or buffer by its key in the
    wrapped module's state dict (``transformer.img_in.weight`` -> ``img_in.weight``); returns
    the keys found in the graph."""
    found = []
    for key in state_dict:
        value = model.graph.initializers.get(prefix + key)
        if value is not None:
            value.name = key
            found.append(key)
    return found
