"""The trace-and-save step every stage export shares."""

from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch

from qkrope._fileio import sha256_file

#: initializer bytes past which a graph keeps its weights in a ``.onnx.data`` file beside it
#: (protobuf's 2 GiB message limit, with room for the graph itself)
EXTERNAL_DATA_BYTES = 3 << 29  # 1.5 GiB


@contextlib.contextmanager
def _sdpa_with_a_head_axis():
    """``torch.nn.functional.scaled_dot_product_attention`` on 3-D ``[B, L, E]`` q/k/v (a VAE's
    single-head mid-block attention) computed as the same attention over a
    head axis of one, ``[B, 1, L, E]``, then squeezed: the same operations on the same values,
    in the 4-D form ONNX's SDPA translation takes (it refuses 3-D inputs)."""
    functional = torch.nn.functional
    sdpa = functional.scaled_dot_product_attention

    def with_head(query, key, value, attn_mask=None, *args, **kwargs):
        if query.dim() != 3:
            return sdpa(query, key, value, attn_mask, *args, **kwargs)
        if attn_mask is not None and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(1)
        return sdpa(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), attn_mask,
                    *args, **kwargs).squeeze(1)

    functional.scaled_dot_product_attention = with_head
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = sdpa


def trace(module: torch.nn.Module, args: tuple, *, input_names: Sequence[str],
          output_names: Sequence[str], dynamic: Any, opset: int, out: Path,
          weights=None) -> list[Path]:
    """Trace ``module`` on ``args`` (``dynamic``: torch.export's dynamic shapes; ``Dim.AUTO``
    axes are every traced size that may vary), optimise the graph with onnxscript and save it
    to ``out`` (and ``out.data`` past :data:`EXTERNAL_DATA_BYTES` of weights). Returns the
    files written, the graph first.

    ``weights``: a :class:`.streamed.StageWeights` whose skeleton ``module`` holds (default:
    the one attached to a skeleton inside ``module``, :func:`.streamed.attached`; None for a
    module with real weights). Then the parameters are placeholders: the initializers are named
    by their state-dict keys, kept by name through the optimiser and read from the
    checkpoint one at a time as the file is written (:func:`.streamed.write`)."""
    from . import streamed

    if weights is None:
        weights = streamed.attached(module)
    registration_log = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration_log.level
    registration_log.setLevel(logging.ERROR)  # torchvision's ops, absent here: noise
    try:
        with warnings.catch_warnings(), torch.no_grad(), _sdpa_with_a_head_axis():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module, args, dynamo=True, opset_version=opset, optimize=weights is None,
                verbose=False, input_names=list(input_names), output_names=list(output_names),
                dynamic_shapes=dynamic)
    finally:
        registration_log.setLevel(level)
    if weights is not None:
        streamed.write(weights, program.model, module, out, external_bytes=EXTERNAL_DATA_BYTES)
    else:
        weights = sum(v.const_value.nbytes for v in program.model.graph.initializers.values()
                      if v.const_value is not None)
        external = weights > EXTERNAL_DATA_BYTES
        program.save(str(out), external_data=external)
    # the graph, then the data file(s) written beside it (named after the graph)
    return [out] + sorted(p for p in out.parent.iterdir()
                          if p.name.startswith(out.name + ".") and p.is_file())


def file_facts(files: Sequence[Path]) -> dict[str, dict[str, Any]]:
    """name -> size and sha256 of each written file (the stage record's ``files``)."""
    return {f.name: {"size": f.stat().st_size, "sha256": sha256_file(f)} for f in files}
