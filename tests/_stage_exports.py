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


def as_pipeline(src: Path, dst: Path, pipeline: str) -> Path:
    """A copy of ``src`` whose model_index.json names ``pipeline``; Wan's image to video gets a
    transformer taking the condition channels (the latents, the mask's 4 and the image's)."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model_index.json").read_text())
    index["_class_name"] = pipeline
    if pipeline == "WanImageToVideoPipeline":
        from qkrope.families.wan import tiny as wan_tiny

        z = 4
        model = wan_tiny.wan_transformer(0, in_channels=2 * z + 4, out_channels=z)
        shutil.rmtree(dst / "transformer")
        model.save_pretrained(dst / "transformer")
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
                    src = as_pipeline(src, self.root / f"{name}-{pipeline}", pipeline)
                out = self.root / f"{name}-{pipeline or 'export'}-out"
                export_pipeline(src, out, dtype="fp32", progress=False)
            self.made[key] = (src, out)
        return self.made[key]
