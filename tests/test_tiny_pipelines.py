"""Every family's tiny pipeline (``qkrope.apps.tiny_pipeline``) end to end, as a user tries one:
save it (``save_tiny_pipeline``: model_index.json, the tiny random transformer, VAE, text
encoders and tokenizers built in code), export its transformer
(``qkrope.export.export_transformer``), and run ``qkrope generate``'s function from a prompt for
2 steps at 32 x 32 on the export: the written file is an image (or a video's frames) of that
size, and the latents agree with the same call on the pipeline's own PyTorch transformer
within the bound the family's pipeline tests derive (per-call parity x (1 + 2 x the largest
guidance scale the pipeline applies by default) x max|latents|; tiny_pipeline.latent_bound).
Plus the entry's refusals: an unknown family and an existing folder are one line each.
"""

from __future__ import annotations

import inspect
import json

import pytest

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
pytest.importorskip("transformers", reason="the tiny pipelines' text encoders require "
                                           "transformers (test extras)")

import torch  # noqa: E402
from PIL import Image  # noqa: E402

from _oneline import error_line  # noqa: E402
from qkrope import families  # noqa: E402
from qkrope.apps import generate as gen  # noqa: E402
from qkrope.apps import tiny_pipeline as tp  # noqa: E402
from qkrope.errors import InputError  # noqa: E402

SIZE = dict(height=32, width=32)
CALL = dict(steps=2, seed=3, **SIZE)
#: the per-call parity of each family's export, relative to max|output|, as its pipeline tests
#: hold it (tests/test_generate.py, test_flux_pipeline.py, test_family_chroma.py,
#: test_family_z_image.py, ...); a family not listed is held to the loosest of them
PARITY = {"qwen-image": tp.TRANSFORMER_PARITY}
#: what a family's pipeline needs beyond the test extras to load: (module, skip reason)
NEEDS = {"cosmos-predict2": ("cosmos_guardrail", "requires cosmos_guardrail: diffusers' Cosmos2 "
                                                 "pipelines build their safety checker from it")}
#: families marked slow: above ~20 s on the shared 2-core machine (FLUX.2: a 28-layer text
#: encoder; HunyuanVideo-1.5: 1108 + 256 text tokens; Kandinsky 5: ~90 s), and Qwen-Image, whose same pipeline
#: tests/test_generate.py runs end to end in the fast tier
SLOW = {"qwen-image", "flux2", "hunyuan-video-1.5", "kandinsky5", "joyimage-edit"}
#: families whose pipeline sets the output size itself: JoyImage Edit rounds every size to its
#: 1024 x 1024 buckets (8192 tokens, hence slow)
FIXED_SIZE = {"joyimage-edit": (1024, 1024)}
#: families whose pipeline's call needs more than a prompt: generate refuses them in one line
#: before any model loads (HunyuanVideo FramePack animates an image, ChronoEdit edits one)
NOT_FROM_A_PROMPT = {"hunyuan-video-framepack": "image", "chronoedit": "image"}
#: known defects of a tiny recipe, each a strict xfail (it fails the run once fixed)
BROKEN = {"prx": "PRXPipeline.from_pretrained fails in diffusers 0.42.1 itself: importing "
                 "diffusers' prx package sets its T5GemmaEncoder wrapper on the transformers "
                 "module object it imported, which sys.modules['transformers'] no longer is, "
                 "so the loader finds no transformers.T5GemmaEncoder for the saved text encoder",
          "flux3": "no tiny recipe: FLUX.3's pipelines are modular (Flux3ModularPipeline), which "
                   "save_tiny_pipeline and qkrope generate do not build or load (save_pipeline "
                   "refuses in one line)",
          "minimax-h3": "no tiny recipe: diffusers 0.42.1 has no MiniMax-H3 pipeline "
                        "(save_pipeline refuses in one line)"}
#: what a family's call needs beyond CALL from the command line's options: Ideogram 4's default
#: guidance_schedule has 48 entries, so 2 steps take a constant --guidance-scale in its place
EXTRA = {"ideogram4": dict(guidance_scale=3.0)}


def _parity(name: str) -> float:
    if name in PARITY:
        return PARITY[name]
    if name in ("flux1", "flux2"):
        import _flux_models as fm

        return fm.FLUX_TRANSFORMER_PARITY
    if name == "chroma":
        import test_family_chroma as tc

        return tc.CHROMA_TRANSFORMER_PARITY
    if name == "z-image":
        import test_family_z_image as tz

        return tz.Z_IMAGE_PARITY
    return 5e-4


def _cfg(pipe) -> float:
    """The largest guidance scale the pipeline's call applies by default (1: none)."""
    params = inspect.signature(pipe.__call__).parameters
    scales = [params[k].default for k in ("guidance_scale", "true_cfg_scale") if k in params]
    guider = getattr(pipe, "guider", None)
    scales.append(getattr(guider, "guidance_scale", 1.0) if guider is not None else 1.0)
    return max([1.0] + [float(s) for s in scales if isinstance(s, (int, float))])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-pipelines")


def _params():
    out = []
    for name in families.names():
        marks = [pytest.mark.slow] if name in SLOW else []
        if name in BROKEN:
            marks.append(pytest.mark.xfail(reason=BROKEN[name], strict=True))
        out.append(pytest.param(name, id=name, marks=marks))
    return out


@pytest.mark.parametrize("name", _params())
def test_the_tiny_pipeline_runs_from_a_prompt_on_its_export(root, name):
    from qkrope.export import export_transformer

    folder = tp.save_tiny_pipeline(name, root / name)
    assert (folder / "model_index.json").is_file()
    # the family named is the family saved: its record's transformer class
    config = json.loads((folder / "transformer" / "config.json").read_text())
    assert config["_class_name"] == families.by_name(name).class_name
    onnx = root / f"{name}.onnx"
    quiet = dict(log=lambda _: None, **CALL, **EXTRA.get(name, {}))
    # a second transformer component (Wan 2.2's expert, Ideogram 4's unconditional one): its
    # own export, given as --transformer-2 (generate keys it by the pipeline's component name)
    second = [c for c in gen.read_pipeline(folder).transformers if c != "transformer"]
    if name in NOT_FROM_A_PROMPT:   # refused from the folder alone: no export is read
        with pytest.raises(InputError, match=NOT_FROM_A_PROMPT[name]) as e:
            gen.generate(folder, onnx, "a cat", **quiet)
        assert "\n" not in str(e.value) and "Fix: call the pipeline in Python" in str(e.value)
        assert not onnx.exists()
        return
    if name in NEEDS:
        try:
            __import__(NEEDS[name][0])
        except ImportError:
            # what a user without that package sees: one line naming it, no traceback
            with pytest.raises(InputError, match=NEEDS[name][0]) as e:
                gen.generate(folder, gen.PYTORCH, "a cat", **quiet)
            assert "\n" not in str(e.value) and "Fix: install" in str(e.value)
            pytest.skip(NEEDS[name][1] + "; its one-line refusal checked")
    # the reference first: the pipeline on its own PyTorch transformer (a folder that does not
    # load back fails here, before the export)
    want, _, ref = gen.generate(folder, gen.PYTORCH, "a cat", output_type="latent",
                                transformer_2=gen.PYTORCH if second else None, **quiet)
    export_transformer(folder / "transformer", onnx, dtype="fp32", progress=False)
    if second:
        onnx_2 = root / f"{name}-2.onnx"
        export_transformer(folder / second[0], onnx_2, dtype="fp32", progress=False)
        quiet["transformer_2"] = onnx_2
    out, _, pipe = gen.generate(folder, onnx, "a cat", **quiet)
    for component in ["transformer", *second]:  # the drop-ins ran
        assert type(getattr(pipe, component)).__module__.startswith("qkrope."), component
    video = getattr(out, "frames", None) is not None
    path = root / f"{name}.{'gif' if video else 'png'}"
    assert gen.write_output(out, path) == [path]
    with Image.open(path) as image:
        assert image.size == FIXED_SIZE.get(name, (SIZE["width"], SIZE["height"]))
        assert getattr(image, "n_frames", 1) == (len(out.frames[0]) if video else 1)

    got, _, _ = gen.generate(folder, onnx, "a cat", output_type="latent", **quiet)
    got, want = (getattr(o, "frames", None) if video else o.images for o in (got, want))
    assert got.shape == want.shape
    bound = tp.latent_bound(want, _cfg(ref), parity=_parity(name))
    diff = float((got - want).abs().max())
    assert 0 < diff <= bound, (diff, bound)


def test_an_unknown_family_is_one_line_listing_the_known_ones(tmp_path, capsys):
    with pytest.raises(InputError, match="unknown model family 'nope'") as e:
        tp.save_tiny_pipeline("nope", tmp_path / "x")
    assert "\n" not in str(e.value)
    for name in families.names():
        assert name in str(e.value)
    assert not (tmp_path / "x").exists()
    assert tp.main(["nope", str(tmp_path / "x")]) == 2
    assert "unknown model family 'nope'" in error_line(capsys)


def test_help_lists_the_families(capsys):
    with pytest.raises(SystemExit):
        tp.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for name in families.names():
        assert name in out


def test_an_existing_folder_is_refused_and_left_alone(tmp_path):
    (tmp_path / "pipe").mkdir()
    (tmp_path / "pipe" / "mine.txt").write_text("keep")
    with pytest.raises(InputError, match="already exists") as e:
        tp.save_tiny_pipeline("qwen-image", tmp_path / "pipe")
    assert "\n" not in str(e.value)
    assert [p.name for p in (tmp_path / "pipe").iterdir()] == ["mine.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]  # no staging left


def test_every_family_has_a_tiny_recipe():
    for record in families.records():
        assert callable(families.hooks(record, "tiny").save_pipeline), record.name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["chroma", "wan"])
def test_the_readme_recipe_runs_as_written(tmp_path, name):
    """The README's try-any-family recipe (the `qkrope generate` row), run as a user types it in
    a new folder: save the tiny pipeline, export its transformer, generate (a video family
    writes the GIF the README names for it)."""
    import re
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    steps = re.search(r"`(python -m qkrope\.apps\.tiny_pipeline FAMILY tiny)`.*?"
                      r"`(qkrope export --model transformer [^`]*)`, `(qkrope generate tiny [^`]*)`"
                      r" \(video families: `(-o \S+)`\)", readme)
    assert steps, "the README's tiny-pipeline recipe is not where this test reads it"
    save, export, run, video_out = steps.groups()
    if name == "wan":
        run = re.sub(r"-o \S+$", video_out, run)
    for line in (save.replace("FAMILY", name), export, run):
        argv = shlex.split(line)
        argv = ([sys.executable] + argv[1:] if argv[0] == "python"
                else [sys.executable, "-m", "qkrope"] + argv[1:])
        res = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, (line, res.stderr[-2000:])
    out = tmp_path / run.split()[-1]
    with Image.open(out) as image:
        assert image.size == (32, 32)
