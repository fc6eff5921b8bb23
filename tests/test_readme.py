"""The README's deployment examples run as written: its `qkrope export --model transformer` line
(with a tiny random diffusers transformer for the folder) and every ```python block, in a folder
holding the export, with the names a block says the user brings (``pipe``, the prompt
embeddings, ``model``) bound to the tiny pipeline's."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
pytest.importorskip("transformers", reason="QwenImagePipeline requires transformers (test extras)")

from qkrope.apps import tiny_pipeline as tp  # noqa: E402
from qkrope.cli import main  # noqa: E402
from qkrope.runtime import QwenImageTransformer, caches_for  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"
TEXT = README.read_text(encoding="utf-8")
BLOCKS = re.findall(r"^```python\n(.*?)^```$", TEXT, flags=re.S | re.M)
EXPORT_LINE = next(line.strip() for line in TEXT.splitlines()
                   if line.strip().startswith("qkrope export --model transformer --diffusers"))
USER_FOLDER = "/path/to/Qwen-Image/transformer"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("readme")
    model = tp.tiny_transformer()
    tp.save_transformer(model, d / "tiny_transformer")
    argv = shlex.split(EXPORT_LINE.replace(USER_FOLDER, str(d / "tiny_transformer")))
    assert argv[0] == "qkrope" and USER_FOLDER in EXPORT_LINE
    cwd = os.getcwd()
    os.chdir(d)  # the README writes transformer.onnx into the current folder
    try:
        assert main(argv[1:]) == 0
    finally:
        os.chdir(cwd)
    assert (d / "transformer.onnx").is_file()
    return d, model


def test_the_readme_has_the_examples_this_test_runs():
    assert len(BLOCKS) == 4, f"{len(BLOCKS)} python blocks; update this test's checks"
    code = [line.split("#")[0] for b in BLOCKS for line in b.splitlines()]
    assert not [line for line in code if "..." in line], "placeholders do not run"


@pytest.mark.parametrize("k", range(4))
def test_readme_python_block_runs_as_written(folder, monkeypatch, k):
    d, model = folder
    monkeypatch.chdir(d)
    pe, pm = tp.prompt_embeds(1, 7, seed=1)
    ne, nm = tp.prompt_embeds(1, 5, seed=2)
    names = {"pipe": tp.pipeline(model, tp.tiny_vae()), "model": model, "prompt_embeds": pe,
             "prompt_embeds_mask": pm, "negative_prompt_embeds": ne,
             "negative_prompt_embeds_mask": nm}
    exec(compile(BLOCKS[k], f"README.md python block {k + 1}", "exec"), names)  # noqa: S102
    if "pipe.transformer = " in BLOCKS[k]:
        assert isinstance(names["pipe"].transformer, QwenImageTransformer)
    if "image = pipe(" in BLOCKS[k]:
        assert names["image"].size == (256, 256)
    if "sess.run(" in BLOCKS[k]:
        assert names["noise_pred"].shape == (2, 256, tp.TRANSFORMER_CONFIG["out_channels"] * 4)
    if "to_cos_sin_caches(" in BLOCKS[k]:  # "converts to the same caches"
        assert names["noise_pred"].shape == (2, 256, tp.TRANSFORMER_CONFIG["out_channels"] * 4)
        want = caches_for("transformer.onnx", [(1, 16, 16)], 64)
        assert torch.equal(names["caches"].img, want.img)
        assert torch.equal(names["caches"].txt, want.txt)
