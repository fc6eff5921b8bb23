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
USER_FOLDER = "/path/to/Qwen-Image/transformer"
FLUX_FOLDER = "/path/to/FLUX.1-dev/transformer"
EXPORT_LINE, FLUX_EXPORT_LINE = (
    next(line.strip() for line in TEXT.splitlines()
         if line.strip().startswith(f"qkrope export --model transformer --diffusers {folder}"))
    for folder in (USER_FOLDER, FLUX_FOLDER))
#: the FLUX section's block (its own tiny pipeline); the others run on Qwen-Image's
FLUX_BLOCKS = [k for k, b in enumerate(BLOCKS) if "FluxPipeline" in b]


def _export_as_written(line: str, placeholder: str, folder: Path, cwd: Path) -> None:
    argv = shlex.split(line.replace(placeholder, str(folder)))
    assert argv[0] == "qkrope" and placeholder in line
    old = os.getcwd()
    os.chdir(cwd)  # the README writes its model into the current folder
    try:
        assert main(argv[1:]) == 0
    finally:
        os.chdir(old)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("readme")
    model = tp.tiny_transformer()
    tp.save_transformer(model, d / "tiny_transformer")
    _export_as_written(EXPORT_LINE, USER_FOLDER, d / "tiny_transformer", d)
    assert (d / "transformer.onnx").is_file()
    return d, model


def test_the_readme_has_the_examples_this_test_runs():
    assert len(BLOCKS) == 5, f"{len(BLOCKS)} python blocks; update this test's checks"
    assert len(FLUX_BLOCKS) == 1
    code = [line.split("#")[0] for b in BLOCKS for line in b.splitlines()]
    assert not [line for line in code if "..." in line], "placeholders do not run"


def test_readme_flux_block_runs_as_written(tmp_path, monkeypatch):
    """The FLUX section: its export line on a tiny FLUX.1 dev folder, then its block with a
    tiny FluxPipeline (a VAE of 4 levels, so 256 x 256 pixels are 16 x 16 tokens)."""
    import diffusers

    import _flux_models as fm
    from qkrope.families.flux.dropin import FluxTransformer

    model = fm.transformer("flux1-dev")
    model.save_pretrained(str(tmp_path / "flux"))
    _export_as_written(FLUX_EXPORT_LINE, FLUX_FOLDER, tmp_path / "flux", tmp_path)
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(block_out_channels=(4, 4, 4, 4), layers_per_block=1,
                                  latent_channels=1, norm_num_groups=1, use_quant_conv=False,
                                  use_post_quant_conv=False, shift_factor=0.0609,
                                  scaling_factor=1.5035,  # FLUX.1's VAE values
                                  down_block_types=("DownEncoderBlock2D",) * 4,
                                  up_block_types=("UpDecoderBlock2D",) * 4).eval()
    pipe = diffusers.FluxPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae,
                                  text_encoder=None, tokenizer=None, text_encoder_2=None,
                                  tokenizer_2=None, transformer=model)
    g = torch.Generator().manual_seed(1)
    names = {"pipe": pipe, "prompt_embeds": torch.randn(1, 7, 32, generator=g),
             "pooled_prompt_embeds": torch.randn(1, 32, generator=g)}
    k = FLUX_BLOCKS[0]
    exec(compile(BLOCKS[k], f"README.md python block {k + 1}", "exec"), names)  # noqa: S102
    assert isinstance(names["pipe"].transformer, FluxTransformer)
    assert names["image"].size == (256, 256)


@pytest.mark.parametrize("k", [k for k in range(len(BLOCKS)) if k not in FLUX_BLOCKS])
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
