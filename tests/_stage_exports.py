"""The tiny pipelines' pipeline exports (``qkrope export --model pipeline``) that the stage tests
share (tests/test_stages.py, tests/test_check_stages.py), made once per pytest process through
the session fixture ``stage_exports`` (conftest.py) and read only: a test that changes one
copies it first."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path


#: the pipeline names with the Wan 2.1 form of image to video (its CLIP image encoder)
WAN21_I2V = "WanImageToVideoPipeline+image_encoder"


def as_pipeline(src: Path, dst: Path, pipeline: str, family: str) -> Path:
    """A copy of ``src`` (the tiny pipeline of ``family``) whose model_index.json names
    ``pipeline``, with the components that differ in it from the family's tiny hook
    (``pipeline_parts``, where it has one); Wan's image to video gets its components
    (``qkrope.families.wan.tiny.image_to_video_parts``): Wan 2.2's form, or Wan 2.1's with the
    image encoder for :data:`WAN21_I2V`."""
    from qkrope import families

    shutil.copytree(src, dst)
    index = json.loads((dst / "model_index.json").read_text())
    index["_class_name"] = pipeline.split("+")[0]
    record = families.by_name(family)
    hook = getattr(families.hooks(record, "tiny"), "pipeline_parts", None)
    parts = hook(record, index["_class_name"], 0) if hook is not None else {}
    if index["_class_name"] == "WanImageToVideoPipeline":
        from qkrope.families.wan import tiny as wan_tiny

        parts = wan_tiny.image_to_video_parts(0, image_encoder=pipeline == WAN21_I2V)
    if parts:
        for name, part in parts.items():
            shutil.rmtree(dst / name, ignore_errors=True)
            part.save_pretrained(dst / name)
            module = type(part).__module__.split(".")[0]
            index[name] = [module, type(part).__name__]
    (dst / "model_index.json").write_text(json.dumps(index))
    return dst


class StageExports:
    """``(family, pipeline class or None) -> (the tiny pipeline folder, its fp32 export)``."""

    def __init__(self, root: Path):
        self.root, self.made, self.sources = root, {}, {}

    def source(self, name: str) -> Path:
        from qkrope.apps import tiny_pipeline as tp

        if name not in self.sources:
            self.sources[name] = Path(tp.save_tiny_pipeline(name, self.root / name))
        return self.sources[name]

    def __call__(self, name: str, pipeline: str | None = None) -> tuple[Path, Path]:
        from qkrope.export.stages import export_pipeline

        key = (name, pipeline)
        if key not in self.made:
            # quiet: the saves' progress bars would land in the first caller's capsys
            with contextlib.redirect_stderr(io.StringIO()), \
                    contextlib.redirect_stdout(io.StringIO()):
                src = self.source(name)
                if pipeline is not None:  # the same components under another pipeline class
                    src = as_pipeline(src, self.root / f"{name}-{pipeline}", pipeline, name)
                out = self.root / f"{name}-{pipeline or 'export'}-out"
                export_pipeline(src, out, dtype="fp32", progress=False)
            self.made[key] = (src, out)
        return self.made[key]
