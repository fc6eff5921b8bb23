"""The drop-in as a pipeline component, trusted (issue 42): what a pipeline saves is the export
it loaded; diffusers' save/load options are honoured or refused, never ignored; LoRA and
IP-Adapter loaders, accelerate's offloading, a refused ``pipe.to(dtype)`` and another family's
export are one line before anything half-happens; ``refit_weights`` refuses tensors an engine
cannot take and names a command that exists.

Built on the tiny Qwen-Image pipeline (qkrope.apps.tiny_pipeline) exported once per module and
run through ONNX Runtime on the CPU; each test that rewrites the export works on its own copy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from types import SimpleNamespace

import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
pytest.importorskip("transformers", reason="diffusers' Qwen-Image and FLUX pipelines import "
                                           "transformers (test extras)")

import _flux_models as fm  # noqa: E402

from qkrope.apps import tiny_pipeline as tp  # noqa: E402
from qkrope.apps.refit import RefitError  # noqa: E402
from qkrope.apps.refit_live import refit_weights  # noqa: E402
from qkrope.cli import main  # noqa: E402
from qkrope.runtime import load_transformer  # noqa: E402
from qkrope.runtime.component import (ComponentError, ComponentLoadError,  # noqa: E402
                                      ComponentSaveError)

ABSENT = dict(text_encoder=None, tokenizer=None)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The tiny Qwen-Image transformer's folder and its fp32 export."""
    from _tiny_model import export_tiny_transformer

    return export_tiny_transformer(tmp_path_factory.mktemp("qwen"))


@pytest.fixture
def onnx(exported, tmp_path):
    """This test's own copy of the export (model and sidecar)."""
    src = exported[1]
    d = tmp_path / "export"
    d.mkdir()
    for f in src.parent.glob(src.name + "*"):
        shutil.copyfile(f, d / f.name)
    return d / src.name


def _pipeline(transformer, **components):
    kw = {**ABSENT, **components}
    return diffusers.QwenImagePipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
                                       vae=tp.tiny_vae(), transformer=transformer, **kw)


def _run(pipe):
    pe, pm = tp.prompt_embeds(1, 7, seed=1)
    return pipe(prompt_embeds=pe, prompt_embeds_mask=pm, height=32, width=32,
                num_inference_steps=2, output_type="latent",
                generator=torch.Generator().manual_seed(0)).images


def _one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text and text, text
    return text


def _bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# --------------------------------------------------------------------------------------------
# 1. what is saved is what ran
# --------------------------------------------------------------------------------------------

def _rewrite_in_place(path):
    """Change one bit of the file's middle byte, in place (same inode, same size): in the tiny
    export, a bit of a weight's raw data (the model still reads)."""
    middle = os.path.getsize(path) // 2
    with open(path, "r+b") as f:
        f.seek(middle)
        byte = f.read(1)
        f.seek(middle)
        f.write(bytes([byte[0] ^ 0x01]))


def _replace(path):
    """Another file renamed over ``path`` (a new inode; one byte differs)."""
    tmp = path.with_name(path.name + ".new")
    shutil.copyfile(path, tmp)
    _rewrite_in_place(tmp)
    os.replace(tmp, path)


@pytest.mark.parametrize("how", ["in-place", "replaced"])
def test_save_refuses_an_export_rewritten_since_it_was_loaded(onnx, tmp_path, how):
    pipe = _pipeline(load_transformer(onnx))
    pipe.save_pretrained(tmp_path / "saved")
    before = _bytes(tmp_path / "saved" / "transformer")
    (_rewrite_in_place if how == "in-place" else _replace)(onnx)
    with pytest.raises(ComponentSaveError) as exc:
        pipe.save_pretrained(tmp_path / "saved")
    text = _one_line(exc)
    assert str(onnx) in text and "rewritten or replaced since the pipeline loaded it" in text
    assert "load_transformer(" in text and "qkrope export --model transformer" in text
    assert _bytes(tmp_path / "saved" / "transformer") == before  # the old save is intact
    with pytest.raises(ComponentSaveError):
        pipe.save_pretrained(tmp_path / "other")
    assert not (tmp_path / "other").exists()  # refused before the pipeline wrote anything


def test_save_refuses_an_edited_sidecar(onnx, tmp_path):
    pipe = _pipeline(load_transformer(onnx))
    side = onnx.with_name(onnx.name + ".json")
    data = json.loads(side.read_text())
    data["sample"]["txt_len"] = int(data["sample"]["txt_len"]) + 1
    side.write_text(json.dumps(data))
    with pytest.raises(ComponentSaveError, match="its facts differ") as exc:
        pipe.save_pretrained(tmp_path / "saved")
    assert str(side) in _one_line(exc)
    assert not (tmp_path / "saved").exists()


def test_save_takes_a_file_with_the_loaded_content(onnx, tmp_path):
    """A file whose stat changed but whose content is the one loaded (copied back, touched)
    is confirmed by its sha256 and saved; the saved folder is a copy that does not change when
    the source is rewritten later."""
    pipe = _pipeline(load_transformer(onnx))
    before = _run(pipe)
    tmp = onnx.with_name("copy")
    shutil.copyfile(onnx, tmp)
    os.replace(tmp, onnx)  # same bytes, new inode and time
    pipe.save_pretrained(tmp_path / "saved")
    saved = tmp_path / "saved" / "transformer" / onnx.name
    assert saved.read_bytes() == onnx.read_bytes()
    assert os.stat(saved).st_ino != os.stat(onnx).st_ino and os.stat(saved).st_nlink == 1
    _rewrite_in_place(onnx)
    again = diffusers.QwenImagePipeline.from_pretrained(tmp_path / "saved", **ABSENT)
    assert torch.equal(_run(again), before)


def test_full_verify_hashes_the_copies(onnx, tmp_path, monkeypatch):
    """QKROPE_VERIFY=full: content rewritten in place with its time put back (what the stat
    check cannot see) is refused by the hash of the copy."""
    pipe = _pipeline(load_transformer(onnx))
    st = os.stat(onnx)
    _rewrite_in_place(onnx)
    os.utime(onnx, ns=(st.st_atime_ns, st.st_mtime_ns))
    monkeypatch.setenv("QKROPE_VERIFY", "full")
    with pytest.raises(ComponentSaveError, match="does not hash to the sha256") as exc:
        pipe.transformer.save_pretrained(tmp_path / "saved" / "transformer")
    _one_line(exc)
    assert not (tmp_path / "saved" / "transformer").exists()


def _refittable_dropin(onnx, folder):
    """A drop-in on a stand-in ``--refit`` engine of ``onnx`` in ``folder`` (the fake TensorRT
    of tests/test_refit_live.py, whose refitter changes what the engine computes), and the
    engine."""
    pytest.importorskip("peft", reason="tests/test_refit_live.py's helpers import peft")
    from test_refit_live import _dropin, refittable_engine

    folder.mkdir()
    engine_file, info = refittable_engine(onnx, folder)
    return _dropin((onnx, engine_file, info))


def test_save_refuses_an_engine_refitted_in_process(onnx, tmp_path):
    """refit_weights changes the weights in memory, never the engine file: a pipeline that ran
    them cannot save the file as what ran (it holds the build's weights). A refit refused
    before the engine changed leaves it savable."""
    dropin, engine = _refittable_dropin(onnx, tmp_path / "engine")
    pipe = _pipeline(dropin)
    pipe.save_pretrained(tmp_path / "before")  # as built: saved
    weights = tp.tiny_transformer(seed=3).state_dict()
    with pytest.raises(RefitError, match="not weights of the engine"):
        refit_weights(dropin, {**weights, "not.a.weight": torch.zeros(1)})
    assert engine.refits == []
    pipe.save_pretrained(tmp_path / "before")  # still the file's weights: saved again
    refit_weights(dropin, weights)
    assert engine.refits
    for save in (pipe.save_pretrained, dropin.save_pretrained):
        with pytest.raises(ComponentSaveError, match="refitted in process") as exc:
            save(tmp_path / "after")
        text = _one_line(exc)
        assert "qkrope refit " in text and "--diffusers" in text and "load_transformer(" in text
        assert not (tmp_path / "after").exists()  # refused before anything was written
    # the runner itself refitted (refit_weights takes it too): the drop-in over it refuses
    other, _ = _refittable_dropin(onnx, tmp_path / "engine2")
    refit_weights(other._runner, weights)
    with pytest.raises(ComponentSaveError, match="refitted in process"):
        _pipeline(other).save_pretrained(tmp_path / "after")
    assert not (tmp_path / "after").exists()


def test_save_never_removes_the_users_files_in_the_folder(onnx, exported, tmp_path):
    """The component folder is replaced whole: one that holds the user's own files (diffusers
    weights, notes) is refused in one line naming them, before anything is written; a previous
    drop-in save and the export's own files are replaced as before."""
    target = tmp_path / "own" / "transformer"
    shutil.copytree(exported[0], target)  # the user's diffusers weights
    for f in onnx.parent.iterdir():  # the export itself lies beside them
        shutil.copyfile(f, target / f.name)
    (target / "MY_NOTES.md").write_text("mine")
    pipe = _pipeline(load_transformer(target / onnx.name))  # (refreshes its sidecar's stat)
    before = _bytes(target)
    for save, into in ((pipe.save_pretrained, tmp_path / "own"),
                       (pipe.transformer.save_pretrained, target)):
        with pytest.raises(ComponentSaveError, match="replaces that folder whole") as exc:
            save(into)
        text = _one_line(exc)
        assert str(target) in text and "MY_NOTES.md" in text and "config.json" in text
        assert "new folder" in text and "move them away" in text
        assert _bytes(target) == before
        assert sorted(p.name for p in (tmp_path / "own").iterdir()) == ["transformer"]
    # a file where the component folder goes is the user's too
    (tmp_path / "file").mkdir()
    (tmp_path / "file" / "transformer").write_text("mine")
    with pytest.raises(ComponentSaveError, match="not a folder") as exc:
        pipe.save_pretrained(tmp_path / "file")
    _one_line(exc)
    assert (tmp_path / "file" / "transformer").read_text() == "mine"

    # the legitimate round trips: over a previous save, and a loaded save into its own folder
    plain = _pipeline(load_transformer(onnx))
    plain.save_pretrained(tmp_path / "saved")
    plain.save_pretrained(tmp_path / "saved")
    again = diffusers.QwenImagePipeline.from_pretrained(tmp_path / "saved", **ABSENT)
    out = _run(again)
    again.save_pretrained(tmp_path / "saved")
    assert sorted(os.listdir(tmp_path / "saved" / "transformer")) == sorted(
        [onnx.name, onnx.name + ".json", "qkrope_component.json"])
    assert torch.equal(_run(diffusers.QwenImagePipeline.from_pretrained(tmp_path / "saved",
                                                                        **ABSENT)), out)
    # a previous save of another export (its record names its files) is replaced
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for f in onnx.parent.iterdir():
        shutil.copyfile(f, renamed / f.name.replace("transformer", "other"))
    _pipeline(load_transformer(renamed / "other.onnx")).save_pretrained(tmp_path / "saved")
    assert sorted(os.listdir(tmp_path / "saved" / "transformer")) == sorted(
        ["other.onnx", "other.onnx.json", "qkrope_component.json"])


@pytest.mark.parametrize("option,match", [
    (dict(variant="fp16"), "has no variant 'fp16'"),
    (dict(safe_serialization=False), "holds no pickle"),
    (dict(max_shard_size="1MB"), "max_shard_size='1MB'"),
    (dict(push_to_hub=True, repo_id="nobody/nothing"), "upload_folder"),
    (dict(use_flashpack=True), "use_flashpack=True"),
], ids=["variant", "pickle", "shards", "push-to-hub", "flashpack"])
def test_save_options_are_refused_before_anything_is_written(onnx, tmp_path, option, match):
    pipe = _pipeline(load_transformer(onnx))
    with pytest.raises(ComponentError, match=match) as exc:
        pipe.save_pretrained(tmp_path / "saved", **option)
    _one_line(exc)
    assert not (tmp_path / "saved").exists()


def test_save_and_load_options_of_the_component(onnx, tmp_path):
    dropin = load_transformer(onnx)
    with pytest.raises(ComponentError, match="takes no compression") as exc:
        dropin.save_pretrained(tmp_path / "t", compression=True)
    _one_line(exc)
    dropin.save_pretrained(tmp_path / "t", safe_serialization=True, variant=None)  # honoured
    load = diffusers.QwenImagePipeline.from_pretrained
    pipe = _pipeline(dropin)
    pipe.save_pretrained(tmp_path / "saved")
    with pytest.raises(ComponentLoadError, match="variant='fp16'.*no variants") as exc:
        dropin.from_pretrained(tmp_path / "saved" / "transformer", variant="fp16")
    _one_line(exc)
    with pytest.raises(ComponentLoadError, match="offload_folder"):
        dropin.from_pretrained(tmp_path / "saved" / "transformer", offload_folder="x")
    # the hints that mean nothing for an export are honoured
    assert load(tmp_path / "saved", low_cpu_mem_usage=False, use_safetensors=True,
                **ABSENT).transformer.dtype == torch.float32


# --------------------------------------------------------------------------------------------
# 2. LoRA and IP-Adapters
# --------------------------------------------------------------------------------------------

def _lora_state_dict(dropin):
    """A LoRA of the first block's to_q in diffusers' names (what load_lora_weights reads)."""
    dim = int(dropin.config["num_attention_heads"]) * int(dropin.config["attention_head_dim"])
    return {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, dim),
            "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(dim, 2)}


@pytest.mark.parametrize("call", [
    lambda pipe: pipe.load_lora_weights(_lora_state_dict(pipe.transformer)),
    lambda pipe: pipe.fuse_lora(),
    lambda pipe: pipe.transformer.unfuse_lora(),
    lambda pipe: pipe.unload_lora_weights(),
    lambda pipe: pipe.set_adapters(["style"]),
    lambda pipe: pipe.delete_adapters(["style"]),
    lambda pipe: pipe.enable_lora(),
    lambda pipe: pipe.disable_lora(),
    lambda pipe: pipe.transformer.load_lora_adapter(_lora_state_dict(pipe.transformer)),
    lambda pipe: pipe.transformer.add_adapter(object()),
    lambda pipe: pipe.transformer.set_adapter("style"),
    lambda pipe: pipe.transformer.enable_lora_hotswap(target_rank=4),
    lambda pipe: pipe.transformer._load_ip_adapter_weights([{}]),
], ids=["load_lora_weights", "fuse_lora", "unfuse_lora", "unload_lora_weights", "set_adapters",
        "delete_adapters", "enable_lora", "disable_lora", "load_lora_adapter", "add_adapter",
        "set_adapter", "enable_lora_hotswap", "load_ip_adapter"])
def test_lora_and_ip_adapters_are_refused_with_what_works(exported, call):
    pytest.importorskip("peft", reason="diffusers' LoRA loaders need peft (test extras)")
    pipe = _pipeline(load_transformer(exported[1]))
    before = _run(pipe)
    with pytest.raises(ComponentError, match="weights fixed at export") as exc:
        call(pipe)
    text = _one_line(exc)
    assert "refit_live.refit_weights" in text and "qkrope export --model transformer" in text
    assert torch.equal(_run(pipe), before)  # nothing half-happened


def test_flux_load_ip_adapter_is_refused(tmp_path_factory):
    """FLUX's pipeline loader reaches the transformer's IP-Adapter weights through the
    drop-in, which refuses them in one line."""
    dropin = load_transformer(fm.exported("flux1-dev", tmp_path_factory.getbasetemp()))
    with pytest.raises(ComponentError, match="load_ip_adapter.*refit_weights") as exc:
        dropin._load_ip_adapter_weights([{"image_proj": {}, "ip_adapter": {}}])
    _one_line(exc)


# --------------------------------------------------------------------------------------------
# 3. refit_weights: tensors an engine cannot take, the command for an ONNX drop-in
# --------------------------------------------------------------------------------------------

def _engine_runner():
    """A stand-in for a loaded ``--refit`` engine's runner: what refit_weights checks before it
    touches the engine (which this one has not: reaching it would be an AttributeError)."""
    return SimpleNamespace(backend="tensorrt", sidecar=SimpleNamespace(refittable=True),
                           cuda_graph=False, device=torch.device("cpu"), path="m.engine")


@pytest.mark.parametrize("value,match", [
    (torch.empty(4, 4, device="meta"), r"is a meta tensor \[4, 4\].*load the weights"),
    (torch.eye(4).to_sparse(), r"is a sparse_coo tensor.*to_dense\(\)"),
    (torch.eye(4).to(torch.float8_e4m3fn), r"is float8_e4m3fn.*bf16/fp16/fp32"),
    (torch.eye(4, dtype=torch.complex64), r"is a complex64 tensor"),
    (torch.nested.nested_tensor([torch.eye(4)]), r"is a nested tensor.*dense weight"),
], ids=["meta", "sparse", "float8", "complex", "nested"])
def test_refit_refuses_tensors_an_engine_cannot_take(value, match):
    weights = {"proj_out.bias": torch.zeros(4), "proj_out.weight": value}
    with pytest.raises(RefitError, match=match) as exc:
        refit_weights(_engine_runner(), weights)
    assert "proj_out.weight" in _one_line(exc)
    module = torch.nn.Linear(4, 4)
    module.weight = torch.nn.Parameter(value, requires_grad=False)
    with pytest.raises(RefitError, match=match):
        refit_weights(_engine_runner(), module)


def test_refit_on_an_onnx_drop_in_names_a_command_that_works(exported, tmp_path):
    folder, onnx_path = exported
    with pytest.raises(RefitError) as exc:
        refit_weights(load_transformer(onnx_path), {})
    text = _one_line(exc)
    commands = re.findall(r"`qkrope ([^`]+)`", text.split("Fix:", 1)[1])
    assert commands, text
    for command in commands:  # DIR: the saved (fused) transformer folder
        args = command.replace("DIR", str(folder)).split()
        assert main(args + ["--out", str(tmp_path / "again.onnx")]) == 0, command


# --------------------------------------------------------------------------------------------
# 4. offloading
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["enable_model_cpu_offload", "enable_sequential_cpu_offload"])
def test_cpu_offload_is_refused_before_any_component_is_touched(exported, method):
    pytest.importorskip("accelerate", reason="diffusers' CPU offload needs accelerate")
    encoder = torch.nn.Linear(2, 2)  # a component diffusers would offload
    pipe = _pipeline(load_transformer(exported[1]), text_encoder=encoder)
    with pytest.raises(ComponentError, match=rf"{method}: accelerate's offload hooks") as exc:
        getattr(pipe, method)(device="cuda")
    assert "exclude_modules=['transformer']" in _one_line(exc)
    assert not hasattr(pipe.vae, "_hf_hook") and not hasattr(encoder, "_hf_hook")
    assert "_offload_device" not in vars(pipe)


def test_group_offload_of_the_other_components_works(exported):
    """What the refusal offers: the other components offloaded, the drop-in where it runs."""
    pipe = _pipeline(load_transformer(exported[1]))
    before = _run(pipe)
    pipe.enable_group_offload(onload_device=torch.device("cpu"), offload_type="leaf_level",
                              exclude_modules=["transformer"])
    assert torch.equal(_run(pipe), before)


# --------------------------------------------------------------------------------------------
# 5. a refused pipe.to(dtype) moves nothing
# --------------------------------------------------------------------------------------------

def test_refused_pipe_to_moves_no_component(exported):
    # a stand-in text encoder (any diffusers model): "text_encoder" sorts before "transformer",
    # so diffusers' loop moves it first
    encoder = tp.tiny_vae()
    pipe = _pipeline(load_transformer(exported[1]), text_encoder=encoder)
    with pytest.raises(ComponentError, match="computes in torch.float32") as exc:
        pipe.to(torch.float16)
    _one_line(exc)
    with pytest.raises(ComponentError, match="computes in torch.float32"):
        pipe.to("cpu", torch.bfloat16)
    assert {p.dtype for p in encoder.parameters()} == {torch.float32}
    assert next(pipe.vae.parameters()).dtype == torch.float32
    assert pipe.to("cpu") is pipe and pipe.to(dtype=torch.float32) is pipe  # accepted
    assert pipe.transformer.device == torch.device("cpu")


# --------------------------------------------------------------------------------------------
# 6. another family's export
# --------------------------------------------------------------------------------------------

def test_an_export_of_another_family_is_refused_where_it_is_put(exported, tmp_path_factory,
                                                                  tmp_path):
    flux = load_transformer(fm.exported("flux1-dev", tmp_path_factory.getbasetemp()))
    pattern = r"QwenImagePipeline\.transformer takes a Qwen-Image transformer.*a FLUX\.1 export"
    with pytest.raises(ComponentError, match=pattern) as exc:
        _pipeline(flux)
    assert "FluxPipeline" in _one_line(exc)  # the pipelines it runs with

    qwen = load_transformer(exported[1])
    pipe = _pipeline(qwen)
    with pytest.raises(ComponentError, match=pattern):
        pipe.transformer = flux
    assert pipe.transformer is qwen and pipe.config["transformer"][1] == type(qwen).__name__

    pipe.save_pretrained(tmp_path / "saved")
    with pytest.raises(ComponentError, match=pattern) as exc:
        diffusers.QwenImagePipeline.from_pretrained(tmp_path / "saved", transformer=flux,
                                                    **ABSENT)
    _one_line(exc)
    # the family's own pipeline takes it
    pipe = diffusers.FluxPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
                                  vae=fm.vae(fm.FLUX1), transformer=flux, text_encoder=None,
                                  tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    assert pipe.transformer is flux


# --------------------------------------------------------------------------------------------
# 7. DiffusionPipeline.from_pretrained keeps every drop-in it is given
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    """A tiny Wan pipeline folder (its transformer and transformer_2 are optional components)
    and its transformer's export, loaded."""
    from qkrope.export.api import export_transformer

    d = tmp_path_factory.mktemp("wan")
    tp.save_tiny_pipeline("wan", d / "pipe")
    export_transformer(d / "pipe" / "transformer", out=d / "t.onnx", progress=False)
    return d / "pipe", d / "t.onnx"


def test_base_class_from_pretrained_keeps_an_optional_components_drop_in(wan, monkeypatch):
    folder, onnx_path = wan
    dropin = load_transformer(onnx_path)
    loaded = []

    def spy(cls, *args, **kwargs):  # the PyTorch transformer must never load
        loaded.append(args)
        raise AssertionError("WanTransformer3DModel.from_pretrained ran")
    monkeypatch.setattr(diffusers.WanTransformer3DModel, "from_pretrained", classmethod(spy))
    pipe = diffusers.DiffusionPipeline.from_pretrained(folder, transformer=dropin)
    assert type(pipe) is diffusers.WanPipeline and not loaded
    assert pipe.transformer is dropin

    # a drop-in the pipeline has no place for is one line, not silently dropped
    with pytest.raises(ComponentLoadError, match=r"did not take .* passed as 'transformer_3'"
                       ) as exc:
        diffusers.DiffusionPipeline.from_pretrained(folder, transformer=dropin,
                                                    transformer_3=dropin)
    _one_line(exc)


def test_base_class_from_pretrained_refuses_another_familys_drop_in(wan, exported):
    qwen = load_transformer(exported[1])
    with pytest.raises(ComponentError, match=r"WanPipeline\.transformer takes a Wan") as exc:
        diffusers.DiffusionPipeline.from_pretrained(wan[0], transformer=qwen)
    _one_line(exc)


@pytest.mark.parametrize("call", [
    lambda d: d.load_state_dict({"proj_out.weight": torch.zeros(2, 2)}, strict=False),
    lambda d: d.load_state_dict({}),
    lambda d: torch.nn.Module.load_state_dict(d, {}),
], ids=["strict-false", "empty", "torch-module"])
def test_load_state_dict_is_refused_not_a_silent_no_op(exported, call):
    dropin = load_transformer(exported[1])
    assert dropin.state_dict() == {}  # honestly empty: no torch parameters
    with pytest.raises(ComponentError, match="no torch parameters to load into") as exc:
        call(dropin)
    text = _one_line(exc)
    assert "refit_live.refit_weights" in text and "qkrope export --model transformer" in text
