"""``load_transformer``: an exported diffusers transformer as a drop-in for ``pipe.transformer``
(the generic drop-in is :mod:`qkrope.runtime._dropin`; each family's part is
``qkrope/families/<family>/dropin.py``)."""

from __future__ import annotations

from ._dropin import Transformer, TransformerLoadError, load_transformer, transformer_for_runner

__all__ = ["Transformer", "TransformerLoadError", "load_transformer", "transformer_for_runner"]
