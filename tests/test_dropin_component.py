"""The drop-in as a diffusers pipeline component (runtime/component.py, issue 36): saved and
loaded back with the pipeline, ``.to()``, and diffusers' model hooks, on the tiny Qwen-Image
pipeline (qkrope.apps.tiny_pipeline) and the tiny FLUX.1 / FLUX.2 pipelines
(tests/_flux_models.py), each exported and run through ONNX Runtime on the CPU.

A reloaded pipeline runs the same exported file in the same runtime as the drop-in it was saved
from, on the same inputs in the same process, so its latents must be the same bits.
"""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys

import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
pytest.importorskip("transformers", reason="diffusers' Qwen-Image and FLUX pipelines import "
                                           "transformers (test extras)")

import _flux_models as fm  # noqa: E402

import qkrope.runtime  # noqa: E402
from qkrope.apps import tiny_pipeline as tp  # noqa: E402
from qkrope.errors import InputError  # noqa: E402
from qkrope.runtime import load_transformer  # noqa: E402
from qkrope.runtime.component import (COMPONENT_FILE, ComponentError,  # noqa: E402
                                      ComponentLoadError, ComponentSaveError, DropinComponent)

KINDS = ["qwen", "flux1-dev", "flux2-klein"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.getbasetemp()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from _tiny_model import export_tiny_transformer

    transformer = tp.tiny_transformer()
    _, onnx = export_tiny_transformer(tmp_path_factory.mktemp("qwen"), transformer=transformer)
    return transformer, tp.tiny_vae(), onnx


class Case:
    """One family's tiny pipeline: how to build it, call it, and reload it without the text
    encoders (which the tiny pipelines bypass with prompt embeddings)."""

    def __init__(self, kind, qwen, root):
        self.kind = kind
        if kind == "qwen":
            self.torch_transformer, self.vae, self.onnx = qwen
            self.cls = diffusers.QwenImagePipeline
            self.absent = dict(text_encoder=None, tokenizer=None)
            pe, pm = tp.prompt_embeds(1, 7, seed=1)
            self.call = dict(prompt_embeds=pe, prompt_embeds_mask=pm, height=32, width=32)
            return
        if kind == "flux2-klein" and not hasattr(diffusers, "Flux2KleinPipeline"):
            pytest.skip("requires diffusers with Flux2KleinPipeline")
        family = fm.VARIANTS[kind][0]
        self.torch_transformer, self.vae = fm.transformer(kind), fm.vae(family)
        self.onnx = fm.exported(kind, root)
        g = torch.Generator().manual_seed(1)
        self.call = dict(prompt_embeds=torch.randn(1, 6, 32, generator=g), height=16, width=16)
        if family is fm.FLUX1:
            self.cls = diffusers.FluxPipeline
            self.absent = dict(text_encoder=None, tokenizer=None, text_encoder_2=None,
                               tokenizer_2=None)
            self.call.update(pooled_prompt_embeds=torch.randn(1, 32, generator=g),
                             guidance_scale=3.5)
        else:
            self.cls = diffusers.Flux2KleinPipeline
            self.absent = dict(text_encoder=None, tokenizer=None)
            self.call.update(negative_prompt_embeds=torch.randn(1, 4, 32, generator=g),
                             guidance_scale=3.0)  # classifier-free guidance

    def pipeline(self, transformer=None):
        return self.cls(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=self.vae,
                        transformer=transformer if transformer is not None
                        else load_transformer(self.onnx), **self.absent)

    def run(self, pipe):
        return pipe(**self.call, num_inference_steps=2, output_type="latent",
                    generator=torch.Generator().manual_seed(0)).images


@pytest.fixture(params=KINDS)
def case(request, qwen, root):
    return Case(request.param, qwen, root)


def _one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text
    return text


# --------------------------------------------------------------------------------------------
# 1. Save and load with the pipeline
# --------------------------------------------------------------------------------------------

def test_save_and_reload_the_pipeline(case, tmp_path):
    pipe = case.pipeline()
    before = case.run(pipe)
    pipe.save_pretrained(tmp_path / "saved")

    folder = tmp_path / "saved" / "transformer"
    record = json.loads((folder / COMPONENT_FILE).read_text())
    assert record["class"] == type(pipe.transformer).__name__
    assert record["model"] == case.onnx.name
    for name in record["files"]:  # the export's files beside it, byte for byte
        assert filecmp.cmp(case.onnx.parent / name, folder / name, shallow=False)
    assert (folder / (case.onnx.name + ".json")).is_file()  # its sidecar
    index = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    assert index["transformer"] == ["qkrope.runtime", type(pipe.transformer).__name__]
    assert not [p for p in (tmp_path / "saved").iterdir() if p.name.startswith(".")]

    for cls in (diffusers.DiffusionPipeline, case.cls):
        again = cls.from_pretrained(tmp_path / "saved", **case.absent)
        assert type(again) is case.cls and type(again.transformer) is type(pipe.transformer)
        assert again.transformer.config == pipe.transformer.config
        assert torch.equal(case.run(again), before)  # same file, runtime and inputs


def test_save_twice_into_the_same_folder(qwen, root, tmp_path):
    """Saving a reloaded pipeline over the folder it came from replaces the component folder
    whole (its files were copied first)."""
    case = Case("qwen", qwen, root)
    case.pipeline().save_pretrained(tmp_path)
    again = diffusers.QwenImagePipeline.from_pretrained(tmp_path, **case.absent)
    again.save_pretrained(tmp_path)
    third = diffusers.QwenImagePipeline.from_pretrained(tmp_path, **case.absent)
    assert torch.equal(case.run(third), case.run(case.pipeline()))


def test_stock_pipeline_folder_takes_the_drop_in(qwen, root, tmp_path):
    """diffusers checks a passed component against the saved one's base class (ModelMixin):
    from_pretrained(DIR, transformer=load_transformer(...)) on a folder saved with the PyTorch
    transformer takes the drop-in."""
    case = Case("qwen", qwen, root)
    case.pipeline(case.torch_transformer).save_pretrained(tmp_path)
    dropin = load_transformer(case.onnx)
    pipe = diffusers.QwenImagePipeline.from_pretrained(tmp_path, transformer=dropin,
                                                       **case.absent)
    assert pipe.transformer is dropin
    assert torch.equal(case.run(pipe), case.run(case.pipeline()))


def test_reload_in_a_fresh_process(qwen, root, tmp_path):
    """What a user does later: import qkrope.runtime, then from_pretrained. Without the import
    diffusers says which module to import (it imports nothing a folder names)."""
    case = Case("qwen", qwen, root)
    case.pipeline().save_pretrained(tmp_path)
    script = (
        "import sys, diffusers\n"
        "kw = dict(text_encoder=None, tokenizer=None)\n"
        "try:\n"
        "    diffusers.DiffusionPipeline.from_pretrained(sys.argv[1], **kw)\n"
        "except ValueError as exc:\n"
        "    print('REFUSED', 'import qkrope.runtime' in str(exc))\n"
        "import qkrope.runtime\n"
        "pipe = diffusers.DiffusionPipeline.from_pretrained(sys.argv[1], **kw)\n"
        "print('LOADED', type(pipe.transformer).__name__)\n")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "REFUSED True" in out.stdout and "LOADED QwenImageTransformer" in out.stdout


def test_save_is_refused_when_the_export_is_gone(qwen, root, tmp_path):
    case = Case("qwen", qwen, root)
    moved = tmp_path / "moved"
    moved.mkdir()
    for f in case.onnx.parent.glob(case.onnx.name + "*"):
        os.link(f, moved / f.name)
    pipe = case.pipeline(load_transformer(moved / case.onnx.name))
    for f in moved.iterdir():
        f.unlink()
    with pytest.raises(ComponentSaveError, match=r"transformer=qkrope\.runtime\.load_transformer"
                       ) as exc:
        pipe.save_pretrained(tmp_path / "saved")
    _one_line(exc)
    assert not (tmp_path / "saved").exists()  # refused before the pipeline wrote anything


def test_load_options(qwen, root, tmp_path):
    case = Case("qwen", qwen, root)
    case.pipeline().save_pretrained(tmp_path)
    load = diffusers.QwenImagePipeline.from_pretrained
    with pytest.raises(ComponentLoadError, match="exported in torch.float32") as exc:
        load(tmp_path, dtype=torch.float16, **case.absent)
    assert "'transformer': torch.float32" in _one_line(exc)
    pipe = load(tmp_path, dtype={"transformer": torch.float32, "default": torch.float32},
                **case.absent)
    assert pipe.transformer.dtype == torch.float32
    direct = DropinComponent.from_pretrained  # what diffusers' loader calls, with its options
    assert direct(tmp_path / "transformer", device_map={"": "cpu"}, variant=None,
                  low_cpu_mem_usage=True).device == torch.device("cpu")
    with pytest.raises(ComponentLoadError, match="one fixed graph on one device"):
        direct(tmp_path / "transformer", device_map={"blocks.0": "cpu", "blocks.1": "cuda"})
    with pytest.raises(ComponentLoadError, match="quantization_config"):
        direct(tmp_path / "transformer", quantization_config=object())
    with pytest.raises(ComponentError, match="cannot move to meta"):
        direct(tmp_path / "transformer", device="meta")
    with pytest.raises(ComponentLoadError, match="no qkrope_component.json"):
        DropinComponent.from_pretrained(tmp_path / "vae")
    (tmp_path / "transformer" / COMPONENT_FILE).write_text('{"format": "other"}')
    with pytest.raises(ComponentLoadError, match="not a qkrope component record") as exc:
        load(tmp_path, **case.absent)
    _one_line(exc)


# --------------------------------------------------------------------------------------------
# 2. .to(), dtype, device, parameters
# --------------------------------------------------------------------------------------------

def test_to_honours_the_device_and_the_export_dtype(case):
    t = load_transformer(case.onnx)
    assert isinstance(t, DropinComponent) and isinstance(t, diffusers.ModelMixin)
    assert t.to("cpu") is t and t.to(torch.float32) is t and t.float() is t and t.cpu() is t
    assert t.to(device="cpu", dtype=torch.float32) is t and t.to(torch.zeros(1)) is t
    assert t.device == torch.device("cpu") and t.dtype == torch.float32
    assert list(t.parameters()) == [] and t.num_parameters() == 0  # weights live in the export
    pipe = case.pipeline(t)
    assert pipe.to("cpu") is pipe and pipe.to(torch.float32) is pipe
    assert pipe.device == torch.device("cpu")
    assert getattr(qkrope.runtime, type(t).__name__) is type(t)  # what model_index.json names


@pytest.mark.parametrize("call", [
    lambda t: t.to(torch.float16), lambda t: t.half(), lambda t: t.bfloat16(),
    lambda t: t.to("cpu", torch.bfloat16), lambda t: t.double(),
    lambda t: t.type(torch.float16)], ids=["to-fp16", "half", "bfloat16", "to-cpu-bf16",
                                          "double", "type"])
def test_to_another_dtype_is_refused(qwen, root, call):
    t = load_transformer(Case("qwen", qwen, root).onnx)
    with pytest.raises(ComponentError, match="computes in torch.float32, fixed at export") as exc:
        call(t)
    assert "re-export" in _one_line(exc) or "qkrope exports" in str(exc.value)
    assert t.dtype == torch.float32


def test_pipe_to_another_dtype_is_refused_not_ignored(case):
    """pipe.to(torch.float16) used to leave the drop-in in fp32 and fail at the next call."""
    pipe = case.pipeline()
    with pytest.raises(ComponentError, match=r"--dtype fp16") as exc:
        pipe.to(torch.float16)
    _one_line(exc)


def test_to_a_device_the_runtime_cannot_feed_is_refused(qwen, root):
    t = load_transformer(Case("qwen", qwen, root).onnx)
    with pytest.raises(ComponentError, match="runs on cpu") as exc:
        t.to("meta")
    _one_line(exc)
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="not available"):
            t.to("cuda")
    with pytest.raises(ComponentError, match="no torch tensors"):
        t.share_memory()
    assert t.device == torch.device("cpu")


# --------------------------------------------------------------------------------------------
# 3. diffusers' model hooks
# --------------------------------------------------------------------------------------------

def _cache_configs():
    step = lambda: 500  # noqa: E731 - the pipeline's current timestep
    return {
        "PyramidAttentionBroadcast": diffusers.PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2, current_timestep_callback=step),
        "FasterCache": diffusers.FasterCacheConfig(current_timestep_callback=step),
        "FirstBlockCache": diffusers.FirstBlockCacheConfig(threshold=0.2),
        "TaylorSeerCache": diffusers.TaylorSeerCacheConfig(),
        "MagCache": diffusers.MagCacheConfig(calibrate=True),
    }


@pytest.mark.parametrize("name", ["PyramidAttentionBroadcast", "FasterCache",
                                  "FirstBlockCache", "TaylorSeerCache", "MagCache"])
def test_cache_hooks_are_refused(case, name):
    t = load_transformer(case.onnx)
    with pytest.raises(ComponentError, match=rf"enable_cache\({name}\).*one fixed call") as exc:
        t.enable_cache(_cache_configs()[name])
    _one_line(exc)
    assert not t.is_cache_enabled
    t.disable_cache()  # nothing to disable
    with t.cache_context("cond"):  # what the pipelines call every step
        pass


@pytest.mark.parametrize("apply", ["apply_faster_cache", "apply_mag_cache"])
def test_hook_registries_are_refused(qwen, root, apply):
    """The apply_* functions that attach diffusers' HookRegistry to the model itself."""
    t = load_transformer(Case("qwen", qwen, root).onnx)
    name = apply.removeprefix("apply_").replace("_", "").lower()
    config = next(c for n, c in _cache_configs().items() if n.lower().startswith(name))
    with pytest.raises(ComponentError, match="wrap the PyTorch model's blocks") as exc:
        getattr(diffusers, apply)(t, config)
    _one_line(exc)
    assert "_diffusers_hook" not in t.__dict__


@pytest.mark.parametrize("call,match", [
    (lambda t: t.enable_layerwise_casting(), "weights fixed at export in torch.float32"),
    (lambda t: t.enable_layerwise_casting(torch.float8_e4m3fn, torch.bfloat16),
     "qkrope quantize"),
    (lambda t: t.enable_group_offload(onload_device=torch.device("cpu")),
     "exclude_modules=\\['transformer'\\]"),
    (lambda t: t.set_attn_processor(diffusers.models.attention_processor.AttnProcessor()),
     "run custom processors on the PyTorch transformer"),
    (lambda t: t.set_attention_backend("native"), "kernels of its runtime"),
    (lambda t: t.enable_xformers_memory_efficient_attention(), "xformers"),
    (lambda t: t.enable_npu_flash_attention(), "npu"),
], ids=["layerwise-casting", "layerwise-casting-fp8", "group-offload", "set-attn-processor",
        "attention-backend", "xformers", "npu"])
def test_model_hooks_are_refused(case, call, match):
    t = load_transformer(case.onnx)
    with pytest.raises(ComponentError, match=match) as exc:
        call(t)
    _one_line(exc)


def test_pipeline_group_offload_is_refused(qwen, root):
    case = Case("qwen", qwen, root)
    pipe = case.pipeline()
    with pytest.raises(ComponentError, match="exclude_modules"):
        pipe.enable_group_offload(onload_device=torch.device("cpu"), num_blocks_per_group=1)


def test_hooks_that_mean_nothing_for_a_fixed_graph_work(case):
    """fuse/unfuse_qkv_projections, set_default_attn_processor, reset_attention_backend and
    disable_xformers are no-ops (the graph already is what they ask for), attn_processors is
    empty; the pipeline's result is unchanged."""
    pipe = case.pipeline()
    before = case.run(pipe)
    t = pipe.transformer
    assert t.attn_processors == {}
    t.fuse_qkv_projections()
    t.set_default_attn_processor()
    t.reset_attention_backend()
    t.disable_xformers_memory_efficient_attention()
    assert torch.equal(case.run(pipe), before)
    t.unfuse_qkv_projections()
    assert torch.equal(case.run(pipe), before)


def test_refusing_properties_keep_their_message(root):
    """A property that refuses with an AttributeError subclass (FLUX's encoder_hid_proj: no
    IP-Adapter) keeps its message under torch's Module.__getattr__."""
    from qkrope.families.flux.dropin import IPAdapterUnsupportedError

    t = load_transformer(fm.exported("flux1-dev", root))
    with pytest.raises(IPAdapterUnsupportedError, match="IP-Adapter"):
        t.encoder_hid_proj
    assert not hasattr(t, "encoder_hid_proj")
    with pytest.raises(AttributeError):
        t.no_such_attribute


def test_an_engine_drop_in_saves_its_engine_and_sidecar(tmp_path, monkeypatch):
    """The TensorRT branch without TensorRT: an engine-backed drop-in (a stand-in runner with
    what the TensorRT runner has: path, backend, cuda_graph) saves the engine and its sidecar,
    and loading passes the engine and the recorded cuda_graph to load_transformer, with no ONNX
    Runtime option."""
    class Runner:
        backend, cuda_graph, device = "tensorrt", True, torch.device("cpu")
        path = tmp_path / "model" / "m.engine"

    class EngineDropin(DropinComponent):
        def __init__(self):
            self._runner, self.dtype, self.device = Runner(), torch.bfloat16, Runner.device

    Runner.path.parent.mkdir()
    Runner.path.write_bytes(b"engine")
    (tmp_path / "model" / "m.engine.json").write_text("{}")
    EngineDropin().save_pretrained(tmp_path / "saved" / "transformer")
    folder = tmp_path / "saved" / "transformer"
    record = json.loads((folder / COMPONENT_FILE).read_text())
    assert record["files"] == ["m.engine", "m.engine.json"] and record["cuda_graph"] is True
    assert record["dtype"] == "bfloat16" and record["backend"] == "tensorrt"
    assert (folder / "m.engine").read_bytes() == b"engine"

    seen = {}

    def load(path, **options):
        seen.update(options, path=path)
        return EngineDropin()

    monkeypatch.setattr(qkrope.runtime, "load_transformer", load)
    assert isinstance(DropinComponent.from_pretrained(folder), EngineDropin)
    assert seen == {"path": folder / "m.engine", "cuda_graph": True, "plugin": None}
    with pytest.raises(ComponentLoadError, match="exported in torch.bfloat16") as exc:
        DropinComponent.from_pretrained(folder, torch_dtype=torch.float16)
    assert "--dtype fp16" in _one_line(exc)
    (tmp_path / "model" / "m.engine.json").unlink()
    with pytest.raises(ComponentSaveError, match="m.engine.json"):
        EngineDropin().save_pretrained(tmp_path / "again")
