"""``qkrope generate``: a saved pipeline folder from a prompt to an image file, the transformer on
its export (the drop-in), with per-stage timings.

The pipeline is qkrope.apps.tiny_pipeline.save_text_pipeline: the tiny random QwenImagePipeline
with a 1-layer Qwen2 text encoder and a byte-level tokenizer, saved with save_pretrained
(nothing downloaded). The latents of the run on the export must agree with the run on the
pipeline's own PyTorch transformer within tiny_pipeline.latent_bound (its derivation is beside
it; no true CFG here, so cfg_scale 1)."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
pytest.importorskip("transformers", reason="QwenImagePipeline requires transformers (test extras)")
pytest.importorskip("tokenizers", reason="the tiny tokenizer requires tokenizers (transformers')")

from qkrope.apps import generate as gen  # noqa: E402
from qkrope.apps import tiny_pipeline as tp  # noqa: E402
from qkrope.cli import main  # noqa: E402

CALL = dict(steps=2, height=32, width=48, seed=3)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("generate")
    tp.save_text_pipeline(d / "pipe")
    assert main(["export", "--model", "transformer", "--diffusers", str(d / "pipe" / "transformer"),
                 "--out", str(d / "t.onnx")]) == 0
    return d


def test_cli_writes_the_image_and_the_stage_timings(saved, tmp_path, capsys):
    out = tmp_path / "cat.png"
    assert main(["generate", str(saved / "pipe"), "--transformer", str(saved / "t.onnx"),
                 "--prompt", "a cat", "--steps", "2", "--height", "32", "--width", "48",
                 "-o", str(out)]) == 0
    cap = capsys.readouterr()
    assert cap.out.strip() == str(out)
    from PIL import Image

    assert Image.open(out).size == (48, 32)
    err = cap.err
    assert "QwenImagePipeline" in err and "transformer: t.onnx" in err
    for stage in ("load pipeline", "load transformer", "text encoders", "denoising",
                  "VAE decode", "pipeline call"):
        assert re.search(rf"^  {stage}[^\n]*?\s+[\d.]+ ms", err, flags=re.M), (stage, err)
    assert "\r" not in err  # off a terminal: lines, no progress bars
    assert re.search(r"denoising .* 2 step\(s\), [\d.]+ ms/step; transformer [\d.]+ ms in 2 "
                     r"call\(s\)", err), err
    assert re.search(r"text encoders .* 1 call\(s\)", err), err
    assert re.search(r"VAE decode .* 1 call\(s\)", err), err


def test_the_export_gives_the_pytorch_pipelines_latents(saved):
    got, times, pipe = gen.generate(saved / "pipe", saved / "t.onnx", "a red apple",
                                    output_type="latent", log=lambda _: None, **CALL)
    want, ref_times, ref = gen.generate(saved / "pipe", "pytorch", "a red apple",
                                        output_type="latent", log=lambda _: None, **CALL)
    assert type(pipe.transformer).__name__ == "QwenImageTransformer"  # the drop-in ran
    assert isinstance(ref.transformer, torch.nn.Module)
    got, want = got.images, want.images
    assert got.shape == want.shape
    bound = tp.latent_bound(want)
    assert float((got - want).abs().max()) <= bound
    # each step timed once, each inside the call; the hooks were removed after the call
    for t in (times, ref_times):
        assert len(t.steps) == CALL["steps"] and all(s > 0 for s in t.steps)
        assert sum(t.steps) + sum(t.text_encoders) <= t.total
        assert t.vae == []  # latents: the VAE does not run
    assert "forward" not in vars(pipe.transformer)
    assert not ref.text_encoder._forward_hooks and not ref.text_encoder._forward_pre_hooks


@pytest.mark.parametrize("argv, match", [
    (["--prompt", "x", "-o", "x.png", "--transformer", "pytorch"], "model_index.json"),
    (["--prompt", "x", "-o", "x.txt", "--transformer", "pytorch"], "--out must end in"),
    (["--prompt", "x", "-o", "x.png", "--transformer", "missing.onnx"], "--transformer"),
    (["--prompt", "x", "-o", "x.png", "--transformer", "pytorch", "--steps", "0"],
     "--steps must be a positive integer"),
])
def test_bad_input_is_one_line(saved, tmp_path, capsys, monkeypatch, argv, match):
    monkeypatch.chdir(tmp_path)
    folder = str(saved / "pipe" / "transformer") if "model_index" in match else str(saved / "pipe")
    assert main(["generate", folder, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("qkrope generate: error: ") and match in err and "\n" not in err


def test_an_option_the_pipeline_does_not_take_is_refused():
    from qkrope.errors import InputError

    class Pipe:
        def __call__(self, prompt, num_inference_steps=10, height=None, width=None):
            pass

    assert gen._call_kwargs(Pipe(), {("--steps", "num_inference_steps"): 3,
                                     ("--height", "height"): None}) == {"num_inference_steps": 3}
    with pytest.raises(InputError, match="Pipe takes no true_cfg_scale, so --true-cfg-scale"):
        gen._call_kwargs(Pipe(), {("--true-cfg-scale", "true_cfg_scale"): 4.0})


def test_write_output_images_and_frames(tmp_path):
    from types import SimpleNamespace

    from PIL import Image

    imgs = [Image.new("RGB", (8, 6), (40 * k, 0, 0)) for k in range(3)]
    one = gen.write_output(SimpleNamespace(images=imgs[:1]), tmp_path / "a.png")
    assert one == [tmp_path / "a.png"] and Image.open(one[0]).size == (8, 6)
    many = gen.write_output(SimpleNamespace(images=imgs), tmp_path / "b.jpg")
    assert [p.name for p in many] == ["b_1.jpg", "b_2.jpg", "b_3.jpg"]
    gif = gen.write_output(SimpleNamespace(frames=[imgs], images=None), tmp_path / "v.gif")
    assert Image.open(gif[0]).n_frames == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left
