"""TensorRT engine-inspector layer information (``LayerInformationFormat.JSON``) as the tests of
``qkrope bench`` write it: one layer's fields as TensorRT lists them, any given ones changed."""

from __future__ import annotations

import json

_LAYER = {"Name": "x", "LayerType": "CaskGemmMatrixMultiply", "Inputs": [], "Outputs": [],
          "TacticName": "sm90_xmma_gemm_bf16bf16_bf16f32", "Metadata": ""}


def _layers(*layers):
    return json.dumps({"Layers": [dict(_LAYER, **l) if isinstance(l, dict) else l
                                  for l in layers], "Bindings": ["hidden_states"]})
