"""The polygraphy ``BaseRunner`` behind ``qkrope check``'s comparisons: one class for every
runner the check compares (qkrope's own runners, ONNX Runtime's block outputs), which differ only
in their inputs' metadata and in how they infer."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Mapping, Sequence


def comparator_runner(name: str, prefix: str,
                      inputs: Iterable[tuple[str, str, Sequence[int]]],
                      infer: Callable[[Mapping[str, Any]], Mapping[str, Any]]):
    """A polygraphy ``BaseRunner`` named ``name`` with nothing to activate: its input metadata
    is ``inputs`` (name, qkrope dtype name, shape with -1 for a dynamic dim) and its
    ``infer_impl`` calls ``infer(feed_dict)``, timed as polygraphy's ``inference_time``."""
    from polygraphy.backend.base import BaseRunner

    specs = list(inputs)

    class ComparatorRunner(BaseRunner):
        def __init__(self):
            super().__init__(name=name, prefix=prefix)

        def activate_impl(self):
            pass

        def deactivate_impl(self):
            pass

        def get_input_metadata_impl(self):
            from polygraphy.common import TensorMetadata
            from polygraphy.datatype import DataType

            from qkrope.dtypes import numpy_dtype

            meta = TensorMetadata()
            for tensor, dtype, shape in specs:
                meta.add(tensor, dtype=DataType.from_dtype(numpy_dtype(dtype)), shape=list(shape))
            return meta

        def infer_impl(self, feed_dict):
            start = time.perf_counter()
            outs = infer(feed_dict)
            self.inference_time = time.perf_counter() - start
            return outs

    return ComparatorRunner()
