"""``qkrope generate`` says what it will not do before it does anything (issue 42 items 5-7):
sizes, frames and token grids past the export's limits, nonsensical values, output names it
cannot write, a prompt that is not UTF-8, an export of another family, an .mp4 without a video
writer, a Wan 2.2 pipeline with one of its two experts exported, and ``--transformer pytorch``
on a folder saved with the drop-in: each one line, before any model loads (the loaders are
replaced by ones that fail the test). And the Python export API refuses every wrong argument
type in one line, with the same ``layers`` check as the command.

One tiny Qwen-Image pipeline (qkrope.apps.tiny_pipeline) and its export, and one tiny Wan 2.2
pipeline (two experts, tests/_families.py's Wan builder; a 1-layer UMT5 and the byte-level
tokenizer) with its exports, are built once per module."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers",
                                   reason="the tiny pipelines' text encoders require transformers")
pytest.importorskip("tokenizers", reason="the tiny tokenizer requires tokenizers (transformers')")

from _oneline import error_line  # noqa: E402
from qkrope.apps import generate as gen  # noqa: E402
from qkrope.apps import tiny_pipeline as tp  # noqa: E402
from qkrope.cli import main  # noqa: E402
from qkrope.errors import InputError  # noqa: E402
from qkrope.export import api  # noqa: E402


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    d = tmp_path_factory.mktemp("trust-qwen")
    tp.save_text_pipeline(d / "pipe")
    api.export_transformer(d / "pipe" / "transformer", d / "t.onnx", progress=False)
    return d


@pytest.fixture(scope="module")
def wan22(tmp_path_factory):
    """A WanPipeline with two experts (boundary_ratio 0.5), each exported; the tiny Wan
    config's RoPE tables hold 32 positions per axis (rope_max_seq_len)."""
    from _families import WAN_CONFIG, wan_transformer

    d = tmp_path_factory.mktemp("trust-wan22")
    torch.manual_seed(0)
    encoder = transformers.UMT5EncoderModel(transformers.UMT5Config(
        vocab_size=300, d_model=WAN_CONFIG["text_dim"], d_kv=8, d_ff=32, num_layers=1,
        num_heads=2)).eval()
    vae = diffusers.AutoencoderKLWan(base_dim=4, z_dim=WAN_CONFIG["in_channels"],
                                     dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True],
                                     latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    pipe = diffusers.WanPipeline(
        tokenizer=tp.byte_tokenizer(), text_encoder=encoder, vae=vae,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=wan_transformer(0), transformer_2=wan_transformer(1), boundary_ratio=0.5)
    pipe.save_pretrained(str(d / "pipe"))
    for component in ("transformer", "transformer_2"):
        api.export_transformer(d / "pipe" / component, d / f"{component}.onnx", progress=False)
    return d


@pytest.fixture
def no_loading(monkeypatch):
    """Loading a pipeline or an export fails the test: a refusal must come first."""
    def boom(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr("qkrope.runtime.load_transformer", boom)
    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", boom)


def _refused(capsys, argv) -> str:
    assert main(["generate", *argv]) == 2
    line = error_line(capsys)
    assert line.startswith("qkrope generate: error: "), line
    return line


# --------------------------------------------------------------------------------------------
# Item 5: bounds before allocation
# --------------------------------------------------------------------------------------------

def test_a_size_past_the_rope_tables_is_refused_before_loading(qwen, tmp_path, capsys,
                                                               no_loading):
    from qkrope import families

    limit = families.by_name("qwen-image").max_positions
    height = 2 * 16 * (limit + 1)  # centred rows: half the rows on each side of 0
    line = _refused(capsys, [str(qwen / "pipe"), "--transformer", str(qwen / "t.onnx"),
                             "--prompt", "x", "--height", str(height), "--width", "32",
                             "-o", str(tmp_path / "x.png")])
    assert f"--width 32, --height {height}" in line and f"the {limit} of" in line and "Fix: smaller" in line


def test_frames_past_the_tables_are_refused_before_loading(wan22, tmp_path, capsys,
                                                           no_loading):
    # 32 positions per axis, 4 frames per latent frame after the first: 129 frames = 33
    line = _refused(capsys, [str(wan22 / "pipe"), "--transformer", str(wan22 / "transformer.onnx"),
                             "--transformer-2", str(wan22 / "transformer_2.onnx"),
                             "--prompt", "x", "--height", "32", "--width", "32",
                             "--num-frames", "129", "-o", str(tmp_path / "x.gif")])
    assert "129 frames" in line and "33" in line and "the 32 of" in line, line
    # 125 frames (32 latent frames) pass every check; the run is not wanted here
    gen.preflight(wan22 / "pipe", {"transformer": str(wan22 / "transformer.onnx"),
                                   "transformer_2": str(wan22 / "transformer_2.onnx")},
                  height=32, width=32, num_frames=125)


@pytest.mark.parametrize("flags, match", [
    (["--height", "40"], "--height 40 is not a multiple of 16 pixels"),
    (["--width", "-16"], "--width must be a positive integer; got -16"),
    (["--num-frames", "0"], "--num-frames must be a positive integer; got 0"),
    (["--num-frames", "3"], "Fix: --num-frames 1 or 5"),
])
def test_nonsensical_values_are_refused_before_loading(wan22, tmp_path, capsys, no_loading,
                                                       flags, match):
    line = _refused(capsys, [str(wan22 / "pipe"), "--transformer", str(wan22 / "transformer.onnx"),
                             "--transformer-2", str(wan22 / "transformer_2.onnx"),
                             "--prompt", "x", *flags, "-o", str(tmp_path / "x.gif")])
    assert match in line, line


def test_num_frames_is_refused_for_an_image_pipeline(qwen, tmp_path, capsys, no_loading):
    line = _refused(capsys, [str(qwen / "pipe"), "--transformer", str(qwen / "t.onnx"),
                             "--prompt", "x", "--num-frames", "5", "-o", str(tmp_path / "x.png")])
    assert "QwenImagePipeline makes images, so --num-frames does not apply" in line


def test_an_engines_profile_bounds_the_image_tokens():
    """An engine's sidecar: the sizes no optimisation profile holds are refused."""
    from qkrope import model_io

    cache = model_io.CACHE_INPUTS[0].name
    from qkrope import families

    record = families.by_name("qwen-image")
    info = SimpleNamespace(
        config=SimpleNamespace(family=record.name, axes_dims_rope=list(record.axes),
                               rope_theta=None, diffusers_config={}),
        source="e.engine.json", profile_labels=("512x512",),
        profiles=[{cache: {"min": [1, 128], "opt": [1024, 128], "max": [1024, 128]}}])
    gen.check_limits("e.engine", info, height=512, width=512, frames=None, temporal=None)
    with pytest.raises(InputError, match=r"cannot serve --width 1024, --height 512 \(2048 image tokens\): no "
                                         r"optimisation profile .*1\.\.1024") as e:
        gen.check_limits("e.engine", info, height=512, width=1024, frames=None, temporal=None)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------------------
# Item 6: one line, never a traceback
# --------------------------------------------------------------------------------------------

def test_an_output_under_a_file_is_refused_before_loading(qwen, tmp_path, capsys, no_loading):
    (tmp_path / "somefile").write_text("mine")
    line = _refused(capsys, [str(qwen / "pipe"), "--transformer", str(qwen / "t.onnx"),
                             "--prompt", "x", "-o", str(tmp_path / "somefile" / "x.png")])
    assert "somefile is a file, not a folder" in line
    assert (tmp_path / "somefile").read_text() == "mine"


def test_a_numbered_frame_name_that_is_a_folder_is_refused_before_loading(
        wan22, tmp_path, capsys, no_loading):
    (tmp_path / "x_3.png").mkdir()
    line = _refused(capsys, [str(wan22 / "pipe"), "--transformer", str(wan22 / "transformer.onnx"),
                             "--transformer-2", str(wan22 / "transformer_2.onnx"),
                             "--prompt", "x", "--num-frames", "5", "--height", "32",
                             "--width", "32", "-o", str(tmp_path / "x.png")])
    assert "x_3.png is a folder" in line


def test_write_output_checks_every_name_before_the_first(tmp_path):
    from PIL import Image

    (tmp_path / "b_2.png").mkdir()
    images = [Image.new("RGB", (8, 6)) for _ in range(3)]
    with pytest.raises(InputError, match="b_2.png is a folder") as e:
        gen.write_output(SimpleNamespace(images=images), tmp_path / "b.png")
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b_2.png"]  # nothing written


@pytest.mark.parametrize("flag", ["--prompt", "--negative-prompt"])
def test_a_prompt_that_is_not_utf8_is_one_line(qwen, tmp_path, capsys, no_loading, flag):
    bad = b"a \xff cat".decode("utf-8", "surrogateescape")  # what argv gives for $'\xff'
    argv = {"--prompt": "x", flag: bad}
    line = _refused(capsys, [str(qwen / "pipe"), "--transformer", str(qwen / "t.onnx"),
                             *[v for kv in argv.items() for v in kv],
                             "-o", str(tmp_path / "x.png")])
    assert f"{flag} is not valid UTF-8 text" in line and r"b'\xff'" in line


def test_an_export_of_another_family_is_refused_before_loading(qwen, wan22, tmp_path, capsys,
                                                               no_loading):
    line = _refused(capsys, [str(qwen / "pipe"), "--transformer", str(wan22 / "transformer.onnx"),
                             "--prompt", "x", "-o", str(tmp_path / "x.png")])
    assert "is a Wan export, but the pipeline's transformer is QwenImageTransformer2DModel" \
        in line


# --------------------------------------------------------------------------------------------
# Item 7: the video writer, Wan 2.2's two experts, true labels, progress
# --------------------------------------------------------------------------------------------

def test_an_mp4_without_a_video_writer_is_refused_before_loading(qwen, tmp_path, capsys,
                                                                 no_loading, monkeypatch):
    monkeypatch.setattr(gen, "_installed", lambda module: module not in ("imageio", "cv2"))
    line = _refused(capsys, [str(qwen / "pipe"), "--transformer", str(qwen / "t.onnx"),
                             "--prompt", "x", "-o", str(tmp_path / "x.mp4")])
    assert "imageio and imageio-ffmpeg are not installed" in line
    assert "pip install 'qkrope[video]'" in line


def test_the_video_writer_is_installed_and_writes_an_mp4(tmp_path):
    """The test extra installs what `generate -o x.mp4` needs (the video extra)."""
    from PIL import Image

    frames = [Image.new("RGB", (32, 32), (60 * k, 0, 0)) for k in range(3)]
    out = gen.write_output(SimpleNamespace(frames=[frames], images=None), tmp_path / "v.mp4")
    assert out == [tmp_path / "v.mp4"] and (tmp_path / "v.mp4").stat().st_size > 0
    assert [p.name for p in tmp_path.iterdir()] == ["v.mp4"]  # no temporary file left


def test_wan22_with_one_expert_exported_is_refused_before_loading(wan22, tmp_path, capsys,
                                                                  no_loading):
    base = [str(wan22 / "pipe"), "--prompt", "x", "-o", str(tmp_path / "x.gif")]
    line = _refused(capsys, base + ["--transformer", str(wan22 / "transformer.onnx")])
    assert "2 transformer components (transformer, transformer_2)" in line
    assert "--transformer-2 was not given" in line
    line = _refused(capsys, base + ["--transformer", str(wan22 / "transformer.onnx"),
                                    "--transformer-2", "pytorch"])
    assert "--transformer-2 pytorch beside an export" in line


def test_transformer_2_on_a_pipeline_without_one(qwen, wan22, tmp_path, capsys, no_loading):
    line = _refused(capsys, [str(qwen / "pipe"), "--transformer", str(qwen / "t.onnx"),
                             "--transformer-2", str(wan22 / "transformer_2.onnx"),
                             "--prompt", "x", "-o", str(tmp_path / "x.png")])
    assert "has no transformer_2. Fix: leave --transformer-2 out" in line


def _ideogram4_folder(root):
    """A folder whose model_index.json names Ideogram4Pipeline and its two transformer
    components (nothing else is read before the refusals below)."""
    import json

    folder = root / "ideogram4"
    folder.mkdir()
    cls = ["diffusers", "Ideogram4Transformer2DModel"]
    (folder / "model_index.json").write_text(json.dumps({
        "_class_name": "Ideogram4Pipeline", "transformer": cls,
        "unconditional_transformer": cls}))
    return folder


def test_the_second_component_by_its_pipelines_name_and_a_fixed_schedule(tmp_path, capsys,
                                                                        no_loading):
    """--transformer-2 is the pipeline's second transformer component whatever its name
    (Ideogram 4's unconditional_transformer); a call whose default per-step guidance_schedule
    fixes the step count refuses --steps of another count without --guidance-scale, in one
    line before anything loads; with --guidance-scale the schedule is passed as None (both
    exports through --transformer / --transformer-2 end to end: tests/test_tiny_pipelines.py)."""
    folder = _ideogram4_folder(tmp_path)
    plan = gen.read_pipeline(folder)
    assert plan.transformers == ("transformer", "unconditional_transformer")
    assert gen.by_component(plan, {"transformer": "a", "transformer_2": "b"}) == {
        "transformer": "a", "unconditional_transformer": "b"}
    base = [str(folder), "--prompt", "x", "-o", str(tmp_path / "x.png"), "--transformer",
            "pytorch"]
    line = _refused(capsys, base + ["--transformer-2", "pytorch", "--steps", "2"])
    assert "--steps 2: Ideogram4Pipeline's default guidance_schedule has 48 entries" in line
    assert "Fix: --steps 48, or pass --guidance-scale G" in line
    assert gen._call_kwargs(plan, {("--guidance-scale", "guidance_scale"): 3.0}) == {
        "guidance_scale": 3.0, "guidance_schedule": None}


def test_wan22_runs_both_experts_on_their_exports(wan22):
    from qkrope.runtime import Transformer

    calls = []
    out, times, pipe = gen.generate(
        wan22 / "pipe", wan22 / "transformer.onnx", "a cat",
        transformer_2=wan22 / "transformer_2.onnx", steps=2, height=32, width=32,
        num_frames=5, output_type="latent", log=calls.append)
    assert isinstance(pipe.transformer, Transformer) and isinstance(pipe.transformer_2, Transformer)
    assert "transformer: transformer.onnx, transformer_2: transformer_2.onnx" in calls[0]
    assert len(times.transformer_calls) == 2 * 2  # CFG on each step, one step per expert
    assert out.frames.shape[2] == 2  # 5 frames: 2 latent frames


def test_pytorch_on_a_folder_saved_with_the_dropin_says_it_cannot(qwen, tmp_path, capsys):
    from qkrope.runtime import load_transformer

    pipe = diffusers.DiffusionPipeline.from_pretrained(
        str(qwen / "pipe"), transformer=load_transformer(qwen / "t.onnx"))
    pipe.save_pretrained(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "transformer" / "qkrope_component.json").is_file()
    capsys.readouterr()  # the load's and save's own bars
    line = _refused(capsys, [str(tmp_path / "saved"), "--transformer", "pytorch",
                             "--prompt", "x", "-o", str(tmp_path / "x.png")])
    assert "was saved with the qkrope drop-in" in line and "not the PyTorch weights" in line


def test_the_denoising_steps_show_progress(qwen, tmp_path, capsys):
    out = tmp_path / "cat.png"
    assert main(["generate", str(qwen / "pipe"), "--transformer", str(qwen / "t.onnx"),
                 "--prompt", "a cat", "--steps", "2", "--height", "32", "--width", "32",
                 "-o", str(out)]) == 0
    err = capsys.readouterr().err
    # off a terminal: a line per step and one at the end (a tqdm bar on a terminal)
    assert "qkrope generate:   denoising: 1 step of 2 step (50%)" in err, err
    assert "qkrope generate:   denoising: 2 step in" in err, err
    assert out.is_file()


# --------------------------------------------------------------------------------------------
# Item 6/7: the Python export API
# --------------------------------------------------------------------------------------------

WRONG = [
    ("diffusers_dir", 5), ("diffusers_dir", ["d"]), ("diffusers_dir", None),
    ("out", 5), ("out", ["x.onnx"]), ("out", "x.txt"),
    ("dtype", ["fp16"]), ("dtype", 16), ("dtype", True), ("dtype", "float16"),
    ("layers", "2"), ("layers", 1.0), ("layers", True), ("layers", [1]),
    ("opset", "18"), ("opset", 18.0), ("opset", False),
    ("rounding", "1"), ("rounding", 1.0), ("rounding", True), ("rounding", 7),
    ("attention", 1), ("attention", ["primitive"]), ("attention", "flash"),
    ("img_shapes", "1x4x4"), ("img_shapes", [1, 4, 4]), ("img_shapes", [(1, 4)]),
    ("img_shapes", [(1, 4, "4")]), ("img_shapes", [(1, 4, True)]), ("img_shapes", [(0, 4, 4)]),
    ("txt_len", "7"), ("txt_len", 7.0), ("txt_len", True), ("txt_len", 0),
    ("batch", "2"), ("batch", 2.5), ("batch", True), ("batch", -1),
    ("quant", 8), ("quant", True), ("quant", "int8"),
    ("variant", 16), ("variant", ["fp16"]), ("variant", ""),
    ("progress", "no"), ("progress", 0),
]


@pytest.mark.parametrize("name, value", WRONG, ids=[f"{n}={v!r}" for n, v in WRONG])
def test_every_wrong_argument_of_the_export_api_is_one_input_error(qwen, tmp_path, name, value):
    kwargs = {"diffusers_dir": qwen / "pipe" / "transformer", "out": tmp_path / "m.onnx",
              "progress": False}
    kwargs[name] = value
    diffusers_dir = kwargs.pop("diffusers_dir")
    with pytest.raises(InputError) as e:
        api.export_transformer(diffusers_dir, **kwargs)
    message = str(e.value)
    assert "\n" not in message and name in message and "Fix:" in message, message
    assert not (tmp_path / "m.onnx").exists()


def test_layers_past_the_blocks_the_api_and_the_cli_agree(qwen, tmp_path, capsys):
    folder = qwen / "pipe" / "transformer"
    blocks = json.loads((folder / "config.json").read_text())["num_layers"]
    with pytest.raises(InputError) as e:
        api.export_transformer(folder, tmp_path / "a.onnx", layers=blocks + 1, progress=False)
    assert main(["export", "--model", "transformer", "--diffusers", str(folder), "--layers",
                 str(blocks + 1), "--out", str(tmp_path / "c.onnx")]) == 2
    line = error_line(capsys)
    assert line == f"qkrope export: error: {e.value}"
    assert f"--layers {blocks + 1}: the model has {blocks} blocks" in line
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------------------------
# The adversarial review of `qkrope generate` (issue 42 items 5-7, round 2)
# --------------------------------------------------------------------------------------------

@pytest.fixture
def loaded_models(monkeypatch):
    """The class names whose diffusers from_pretrained runs (a spy: each still loads)."""
    seen = []
    original = diffusers.ModelMixin.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.append(cls.__name__)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(diffusers.ModelMixin, "from_pretrained", classmethod(spy))
    return seen


def test_no_pytorch_expert_is_loaded_beside_the_exports(wan22, loaded_models):
    """WanPipeline's transformers are optional components: DiffusionPipeline.from_pretrained
    drops the drop-ins given for them and loads the PyTorch experts (then replaced)."""
    calls = []
    gen.generate(wan22 / "pipe", wan22 / "transformer.onnx", "a cat",
                 transformer_2=wan22 / "transformer_2.onnx", steps=1, height=32, width=32,
                 num_frames=1, output_type="latent", log=calls.append)
    assert loaded_models and not [n for n in loaded_models if "Transformer" in n], loaded_models
    assert "transformer: transformer:" not in calls[0], calls[0]


@pytest.mark.parametrize("flags, match", [
    (["--height", "100000"], "--height 100000"),  # one axis alone
    (["--width", "99968"], "--width 99968"),
    ([], "480"),  # the pipeline's own defaults (480x832, 81 frames) past the tiny tables
])
def test_each_size_is_bounded_alone_and_the_defaults_too(wan22, tmp_path, capsys, no_loading,
                                                        flags, match):
    line = _refused(capsys, [str(wan22 / "pipe"), "--transformer", str(wan22 / "transformer.onnx"),
                             "--transformer-2", str(wan22 / "transformer_2.onnx"),
                             "--prompt", "x", *flags, "-o", str(tmp_path / "x.gif")])
    assert match in line and "RoPE positions" in line and "Fix: smaller" in line, line


def test_an_onnx_runtime_allocation_failure_is_one_line(qwen, monkeypatch):
    import onnxruntime

    from qkrope.runtime.runner import RunnerError

    def fail(self, binding):
        raise RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code "
                           "returned while running MatMul node.\nBFCArena::AllocateRawInternal "
                           "Failed to allocate memory for requested buffer of size 1234")

    monkeypatch.setattr(onnxruntime.InferenceSession, "run_with_iobinding", fail)
    with pytest.raises(RunnerError) as e:
        gen.generate(qwen / "pipe", qwen / "t.onnx", "a cat", steps=1, height=32, width=32,
                     output_type="latent", log=lambda s: None)
    message = str(e.value)
    assert "\n" not in message and "Failed to allocate memory" in message, message
    assert "shapes" in message and "Fix: smaller" in message, message


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="requires Linux /proc")
def test_an_unwritable_output_folder_is_refused_before_loading(qwen, capsys, no_loading):
    line = _refused(capsys, [str(qwen / "pipe"), "--transformer", str(qwen / "t.onnx"),
                             "--prompt", "x", "-o", "/proc/x.png"])
    assert "/proc" in line and "Fix:" in line, line


def test_an_os_error_while_writing_is_one_line(qwen, tmp_path, capsys, monkeypatch):
    import errno

    def full(path, data, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr("qkrope._fileio.write_atomic", full)
    assert main(["generate", str(qwen / "pipe"), "--transformer", str(qwen / "t.onnx"),
                 "--prompt", "x", "--steps", "1", "--height", "32", "--width", "32",
                 "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err  # the run's own lines, then the one error line
    assert "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("qkrope generate: error: "), err
    assert "No space left on device" in line and "x.png" in line, line


@pytest.mark.parametrize("out", [".", "/", "..", "sub/."])
def test_an_output_that_names_a_folder_is_one_line(qwen, capsys, no_loading, out):
    line = _refused(capsys, [str(qwen / "pipe"), "--transformer", str(qwen / "t.onnx"),
                             "--prompt", "x", "-o", out])
    assert "--out" in line and "Fix:" in line, line


def test_another_family_for_a_folder_saved_with_the_dropin(qwen, wan22, tmp_path, capsys):
    from qkrope.runtime import load_transformer

    pipe = diffusers.DiffusionPipeline.from_pretrained(
        str(qwen / "pipe"), transformer=load_transformer(qwen / "t.onnx"))
    pipe.save_pretrained(str(tmp_path / "saved"))
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as mp:
        def boom(*args, **kwargs):
            raise AssertionError("a model was loaded before the refusal")

        mp.setattr("qkrope.runtime.load_transformer", boom)
        mp.setattr(diffusers.DiffusionPipeline, "from_pretrained", boom)
        line = _refused(capsys, [str(tmp_path / "saved"), "--transformer",
                                 str(wan22 / "transformer.onnx"), "--prompt", "x",
                                 "-o", str(tmp_path / "x.png")])
    assert "is a Wan export, but the pipeline's transformer" in line, line
    assert "not a loadable diffusers pipeline" not in line


@pytest.mark.parametrize("flags, match", [
    (["--seed", "99999999999999999999999"], "--seed 99999999999999999999999"),
    (["--seed", "-1"], "--seed -1"),
    (["--steps", "100000000000"], "--steps 100000000000"),
])
def test_seed_and_steps_are_bounded_before_loading(qwen, tmp_path, capsys, no_loading, flags,
                                                   match):
    line = _refused(capsys, [str(qwen / "pipe"), "--transformer", str(qwen / "t.onnx"),
                             "--prompt", "x", *flags, "-o", str(tmp_path / "x.png")])
    assert match in line and "Fix:" in line, line


def test_transformer_calls_are_not_called_steps():
    """A pipeline without callback_on_step_end: its transformer calls are counted as calls."""
    times = gen.StageTimes(transformer_calls=[0.1] * 4, steps=[])
    row = next(r for r in times.table() if "denoising" in r)
    assert "4 transformer call(s)" in row and "step(s)" not in row and "ms/step" not in row, row


def test_a_dtype_other_than_the_exports_is_refused_before_loading(qwen, tmp_path, capsys,
                                                                 no_loading):
    line = _refused(capsys, [str(qwen / "pipe"), "--transformer", str(qwen / "t.onnx"),
                             "--prompt", "x", "--dtype", "fp16", "-o", str(tmp_path / "x.png")])
    assert "--dtype fp16" in line and "fp32" in line and "Fix: leave --dtype out" in line, line


def test_the_same_export_for_both_experts_is_refused(wan22, tmp_path, capsys, no_loading):
    line = _refused(capsys, [str(wan22 / "pipe"), "--transformer", str(wan22 / "transformer.onnx"),
                             "--transformer-2", str(wan22 / "transformer.onnx"),
                             "--prompt", "x", "--height", "32", "--width", "32",
                             "--num-frames", "5", "-o", str(tmp_path / "x.gif")])
    assert "--transformer-2" in line and "transformer_2" in line and "Fix:" in line, line


def test_a_pipeline_without_step_callbacks_counts_calls_not_steps(qwen, tmp_path, capsys,
                                                                  monkeypatch):
    """HunyuanVideo-1.5 takes no callback_on_step_end: its progress and table count the
    transformer's calls, as calls (a stand-in: Qwen-Image's __call__ without that parameter)."""
    original = diffusers.QwenImagePipeline.__call__

    def call(self, prompt=None, num_inference_steps=50, height=None, width=None,
             generator=None, output_type="pil"):
        return original(self, prompt=prompt, num_inference_steps=num_inference_steps,
                        height=height, width=width, generator=generator, output_type=output_type)

    monkeypatch.setattr(diffusers.QwenImagePipeline, "__call__", call)
    assert main(["generate", str(qwen / "pipe"), "--transformer", str(qwen / "t.onnx"),
                 "--prompt", "a cat", "--steps", "2", "--height", "32", "--width", "32",
                 "-o", str(tmp_path / "cat.png")]) == 0
    err = capsys.readouterr().err
    assert "transformer: 2 call" in err and "denoising: 0 step" not in err, err
    assert "2 transformer call(s)" in err and "step(s)" not in err, err


def test_an_import_error_of_the_pipeline_class_is_one_line(qwen, monkeypatch):
    def needs(*args, **kwargs):
        raise ImportError("QwenImagePipeline requires the cosmos_guardrail library.")

    monkeypatch.setattr(diffusers.QwenImagePipeline, "from_pretrained", needs)
    with pytest.raises(InputError) as e:
        gen.generate(qwen / "pipe", qwen / "t.onnx", "a cat", steps=1, log=lambda _: None)
    message = str(e.value)
    assert "cosmos_guardrail library. Fix: install" in message and ".." not in message, message
