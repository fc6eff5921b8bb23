"""The pipeline's other model stages to ONNX: text encoders (:mod:`.text_encoder`), VAEs
(:mod:`.vae`, the causal video VAE with its feature cache as graph inputs and outputs), and the
whole pipeline folder (:mod:`.pipeline`: ``qkrope export --model pipeline``).

Each stage is traced with ``torch.onnx.export(dynamo=True)`` around a small wrapper that returns
exactly what the family's pipeline reads of the component (qkrope.stages, the record's
``stages``), every axis a traced size may vary (batch, tokens, latent height and width)
dynamic. This layer sits beside the transformer export and shares only the root's helpers with
it; the transformer keeps its own module (qkrope.export.api).
"""

from __future__ import annotations

from .pipeline import export_pipeline

__all__ = ["export_pipeline"]
