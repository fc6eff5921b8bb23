"""The pipeline's other model stages on their exports: text and image encoders and VAEs as
diffusers components with no torch parameters (:mod:`.component`), loaded by
``from_pretrained`` from a
folder that ``qkrope export --model pipeline`` wrote (model_index.json names them as
``["qkrope.runtime", <class>]``, as it names the transformer drop-in).

What a stage reads and returns is its family's declaration (qkrope.stages, the record's
``stages``), kept in the stage folder's record (``qkrope_stage.json``): the drop-in knows which
outputs its graph holds without importing the family.
"""

from __future__ import annotations

from .component import (ImageEncoderExport, StageComponent, TextEncoderExport, VaeExport,
                        load_stage)

__all__ = ["StageComponent", "TextEncoderExport", "ImageEncoderExport", "VaeExport",
           "load_stage"]
