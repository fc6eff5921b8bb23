"""The dynamic axes of a 5-D latent the model patchifies itself (a "video-5d" family record,
:mod:`qkrope.runtime.latents`), for torch.export and for the exported graph's names.

A latent axis is a whole number of patches: the model reshapes ``latent_height`` into
``(latent_height / patch, patch)``, which torch.export accepts only from a dimension declared as
``patch * tokens``. :func:`dynamic_shapes` declares the latent axes that way (one token
dimension per axis, shared by every input that has the axis); torch.onnx then names the graph's
dimension by the expression (``2*latent_height_tokens``), which :func:`rename` turns back into
the axis name (``latent_height``) on the graph's inputs and outputs. :func:`axis_values` gives
the sample's values of the latent axes for the sidecar.
"""

from __future__ import annotations

from typing import Any, Sequence

from qkrope import model_io

#: The latent axes, in patch order (frames, height, width).
LATENT_AXES = (model_io.LATENT_FRAMES, model_io.LATENT_HEIGHT, model_io.LATENT_WIDTH)


def _token_dim(axis: str) -> str:
    return f"{axis}_tokens"


def dynamic_shapes(names: Sequence[str], patch: Sequence[int] | None) -> dict:
    """torch.export's dynamic dimensions of each graph input (its named axes,
    :data:`qkrope.model_io.TENSORS`), a latent axis as ``patch * Dim(<axis>_tokens)`` where its
    patch is wider than 1 (``patch``: ``(frames, height, width)``; None: no latent axes)."""
    import torch

    dim = torch.export.Dim
    axes: dict[str, Any] = {a: dim(a) for a in model_io.AXES}
    if patch is not None:
        for axis, p in zip(LATENT_AXES, patch):
            if int(p) > 1:
                axes[axis] = int(p) * dim(_token_dim(axis))
    return {n: {i: axes[a] for i, a in enumerate(model_io.TENSORS[n].axes) if a is not None}
            for n in names}


def rename(model, patch: Sequence[int] | None) -> None:
    """The graph's input and output dimensions named by a latent axis's expression
    (``2*latent_height_tokens``) get the axis name (in place)."""
    if patch is None:
        return
    import onnx_ir as ir

    names = {f"{int(p)}*{_token_dim(a)}": a for a, p in zip(LATENT_AXES, patch) if int(p) > 1}
    for value in list(model.graph.inputs) + list(model.graph.outputs):
        if value.shape is None:
            continue
        dims = [ir.SymbolicDim(names[str(d)]) if not isinstance(d, int) and str(d) in names
                else d for d in value.shape]
        value.shape = ir.Shape(dims)


def axis_values(grid: Sequence[int], patch: Sequence[int] | None) -> dict:
    """The sample's value of each latent axis (``grid``: its token grid)."""
    if patch is None:
        return {}
    return {a: int(g) * int(p) for a, g, p in zip(LATENT_AXES, grid, patch)}
