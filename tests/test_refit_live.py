"""refit_weights (qkrope.apps.refit_live): a LoRA fused into a live tiny Qwen-Image pipeline goes
into a loaded ``--refit`` engine behind the drop-in, in process, with ``qkrope refit``'s checks.

No TensorRT here: the engine is the fake TensorRT's (tests/fake_tensorrt.py: its ``Refitter``
and ``ICudaEngine``), made to compute. Its execution context runs ONNX Runtime on the export
the engine stands for, with every initializer the refitter was given replaced by those bytes
(the model re-serialised in memory), so a refit changes what the engine computes as a real one
would. The TensorRT runner drives it on the CPU with the stand-in CUDA of
tests/_runner_helpers.py.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import fake_tensorrt as ft
from _runner_helpers import FakeCuda

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
pytest.importorskip("transformers", reason="QwenImagePipeline requires transformers")
pytest.importorskip("peft", reason="diffusers' load_lora_weights needs peft (test extras)")

from qkrope.apps import tiny_pipeline as tp  # noqa: E402
from qkrope.apps.refit import RefitError  # noqa: E402
from qkrope.apps.refit_live import live_state_dict, refit_weights  # noqa: E402

pytestmark = pytest.mark.slow

TRT_NAME = {"float32": "FLOAT", "bool": "BOOL", "float16": "HALF", "bfloat16": "BF16"}
NP = {"float32": np.float32, "bool": np.bool_}
MAX_TOKENS = 4096


class OrtContext(ft.IExecutionContext):
    """Reads the inputs at their addresses, runs the engine's ONNX Runtime session, writes the
    outputs at theirs."""

    def execute_async_v3(self, stream_handle):
        e = self.engine
        feed = {}
        for name, dtype in e.input_dtypes.items():
            shape = self.shapes[name]
            n = int(np.prod(shape)) * np.dtype(NP[dtype]).itemsize
            raw = (ctypes.c_char * n).from_address(self.addresses[name])
            feed[name] = np.frombuffer(raw, NP[dtype]).reshape(shape).copy()
        for name, value in zip(e.output_names, e.session().run(e.output_names, feed)):
            value = np.ascontiguousarray(value, np.float32)
            ctypes.memmove(self.addresses[name], value.ctypes.data, value.nbytes)
        return super().execute_async_v3(stream_handle)


class OrtEngine(ft.ICudaEngine):
    """A refittable fake engine for an exported model (float32) that computes: its weights are
    the export's parameters; a session is made anew after each refit."""

    def __init__(self, onnx_path: Path, info):
        io = []
        for t in info.inputs:
            dims = [d if isinstance(d, int) else -1 for d in t.shape]
            lo = [d if d >= 0 else 1 for d in dims]
            hi = [d if d >= 0 else MAX_TOKENS for d in dims]
            io.append((t.name, TRT_NAME[t.dtype], dims, [lo, hi, hi], ft.TensorIOMode.INPUT))
        for t in info.outputs:
            io.append((t.name, TRT_NAME[t.dtype], [d if isinstance(d, int) else -1
                                                    for d in t.shape], None,
                       ft.TensorIOMode.OUTPUT))
        super().__init__(io, output_like={"sample": "hidden_states"})
        shapes = info.config.parameter_shapes
        self.weights = {k: ("FLOAT", int(np.prod(shapes[k]))) for k in info.config.parameters}
        self.shapes, self.refittable, self.required = shapes, True, ()
        self.values, self.refits = {}, []
        self.onnx_path = onnx_path
        self.input_dtypes = {t.name: t.dtype for t in info.inputs}
        self.output_names = [t.name for t in info.outputs]
        self._session, self._made_at = None, None

    def create_execution_context(self):
        ctx = OrtContext(self)
        self.contexts.append(ctx)
        return ctx

    def session(self):
        """ONNX Runtime on the export with the refitted initializers (the model re-serialised in
        memory with those bytes), made anew after each refit."""
        if self._session is None or self._made_at != len(self.refits):
            import onnx
            import onnxruntime as ort

            model = onnx.load(str(self.onnx_path))
            for init in model.graph.initializer:
                if init.name in self.values:
                    arr = np.frombuffer(self.values[init.name], np.float32)
                    init.CopyFrom(onnx.numpy_helper.from_array(
                        arr.reshape(self.shapes[init.name]), init.name))
            options = ort.SessionOptions()
            options.intra_op_num_threads = options.inter_op_num_threads = 1
            self._session = ort.InferenceSession(model.SerializeToString(), options,
                                                 providers=["CPUExecutionProvider"])
            self._made_at = len(self.refits)
        return self._session


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The tiny transformer's export, and an engine file + refittable sidecar standing for it."""
    from qkrope.cli import main as cli_main

    d = tmp_path_factory.mktemp("refit_live")
    base = tp.tiny_transformer()
    tp.save_transformer(base, d / "t")
    onnx = d / "tiny.onnx"
    assert cli_main(["export", "--model", "transformer", "--diffusers", str(d / "t"),
                     "--out", str(onnx)]) == 0
    return (onnx, *refittable_engine(onnx, d))


def refittable_engine(onnx, folder):
    """(engine file, the export's ModelInfo): a stand-in engine file in ``folder`` for the
    export ``onnx``, with a sidecar that says refittable (tests/_triton_helpers.tiny_engine)."""
    from _triton_helpers import tiny_engine
    from qkrope.sidecars import EngineInfo

    engine_file, _, info = tiny_engine(onnx, folder)
    side = dataclasses.replace(EngineInfo.load(engine_file), refittable=True)
    Path(str(engine_file) + ".json").write_text(json.dumps(side.to_dict()))
    return engine_file, info


def _dropin(exported, *, cuda_graph=False):
    """(the drop-in, its computing fake engine) for ``exported`` = (onnx, engine file, info):
    the TensorRT runner on the stand-in CUDA, as load_transformer(engine file) makes it."""
    from qkrope.runtime import loader_tensorrt, runner_tensorrt
    from qkrope.runtime.transformer import transformer_for_runner
    from qkrope.sidecars import EngineInfo

    onnx, engine_file, info = exported
    trt, _ = ft.make_fake_trt()
    engine = OrtEngine(onnx, info)
    loaded = loader_tensorrt.LoadedEngine(engine, trt, EngineInfo.load(engine_file),
                                          str(engine_file))
    runner = runner_tensorrt.TensorRTRunner(loaded, device=torch.device("cpu"), cuda=FakeCuda(),
                                            cuda_graph=cuda_graph)
    runner._check_device = lambda device: None  # CPU tensors for the stand-in CUDA
    return transformer_for_runner(runner), engine


def _lora(model, seed=5, rank=2, scale=0.3):
    """A random LoRA (peft's key format) on the attention projections of both blocks."""
    g = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    sd = {}
    for i in range(tp.TRANSFORMER_CONFIG["num_layers"]):
        for proj in ("to_q", "to_k", "add_v_proj", "to_out.0"):
            lin = modules[f"transformer_blocks.{i}.attn.{proj}"]
            key = f"transformer.transformer_blocks.{i}.attn.{proj}"
            sd[f"{key}.lora_A.weight"] = torch.randn(rank, lin.in_features, generator=g) * scale
            sd[f"{key}.lora_B.weight"] = torch.randn(lin.out_features, rank, generator=g) * scale
    return sd


def _latents(pipe):
    pe, pm = tp.prompt_embeds(1, 7, seed=1)
    return pipe(prompt_embeds=pe, prompt_embeds_mask=pm, height=32, width=32,
                num_inference_steps=2, output_type="latent",
                generator=torch.Generator().manual_seed(0)).images


def test_a_fused_lora_goes_into_the_engine_in_process(exported):
    """The drop-in's latents follow the LoRA-fused PyTorch pipeline's after the refit (and the
    base model's before); the engine file is untouched, nothing is rebuilt or re-exported."""
    _, engine_file, _ = exported
    stat = engine_file.stat()
    data = engine_file.read_bytes()
    vae = tp.tiny_vae()
    torch_pipe = tp.pipeline(tp.tiny_transformer(), vae)
    base = _latents(torch_pipe)
    dropin, engine = _dropin(exported)
    before = _latents(tp.pipeline(dropin, vae))
    torch_pipe.load_lora_weights(_lora(torch_pipe.transformer), adapter_name="style")
    with pytest.raises(RefitError, match=r"\['style'\] loaded but not fused.*fuse_lora"):
        refit_weights(dropin, torch_pipe.transformer)
    assert engine.refits == []  # refused: nothing refitted
    torch_pipe.fuse_lora()
    fused = _latents(torch_pipe)
    report = refit_weights(dropin, torch_pipe.transformer)
    after = _latents(tp.pipeline(dropin, vae))
    assert len(engine.refits) == 1 and report.refitted == sorted(engine.weights)
    assert not report.not_covered and not report.not_in_engine
    # ONNX Runtime vs PyTorch on the same weights: the latent bound of the pipeline tests
    for got, want in ((before, base), (after, fused)):
        diff, bound = float((got - want).abs().max()), tp.latent_bound(want)
        assert diff <= bound, (diff, bound)
    # the LoRA moves the latents far beyond that bound, so "changed" is not noise
    change = float((after - before).abs().max())
    assert change > 10 * tp.latent_bound(fused), change
    assert engine_file.read_bytes() == data
    assert (engine_file.stat().st_mtime_ns, engine_file.stat().st_ino) == \
        (stat.st_mtime_ns, stat.st_ino)


def test_an_in_memory_state_dict_gets_refits_checks(exported):
    """A state dict by diffusers name: refitted as given; a transposed weight, a non-finite one,
    an unknown key are refused with refit's messages, leaving the engine as it was."""
    dropin, engine = _dropin(exported)
    sd = tp.tiny_transformer(seed=3).state_dict()
    key = "img_in.weight"  # [inner_dim 64, in_channels 16]: its transpose has another shape
    shape = list(sd[key].shape)
    assert shape[0] != shape[1]
    for bad, says in (({key: sd[key].T.contiguous()},
                       rf"{key}: engine float32 x {sd[key].numel()} \[{shape[0]}, {shape[1]}\]"),
                      ({key: torch.full_like(sd[key], float("nan"))},
                       rf"{key}: \d+ of \d+ values are NaN"),
                      ({"not.a.weight": torch.zeros(1)}, r"not weights of the engine")):
        with pytest.raises(RefitError, match=says) as err:
            refit_weights(dropin, {**sd, **bad})
        assert "\n" not in str(err.value)
    assert engine.refits == []
    refit_weights(dropin, sd)
    assert engine.refits == [sorted(engine.weights)]
    assert engine.values[key] == sd[key].numpy().tobytes()


def test_what_cannot_be_refitted_in_process_is_refused(exported, tmp_path):
    from qkrope.runtime import load_transformer

    onnx, engine_file, _ = exported
    sd = tp.tiny_transformer().state_dict()
    with pytest.raises(RefitError, match=r"on onnxruntime.*load the \.engine"):
        refit_weights(load_transformer(onnx), sd)
    with pytest.raises(RefitError, match=r"cuda_graph=True"):
        refit_weights(_dropin(exported, cuda_graph=True)[0], sd)
    dropin, engine = _dropin(exported)
    dropin._runner.sidecar = dataclasses.replace(dropin._runner.sidecar, refittable=False)
    with pytest.raises(RefitError, match=r"not built refittable.*qkrope build --refit"):
        refit_weights(dropin, sd)
    with pytest.raises(RefitError, match=r"torch.nn.Module .* or a mapping"):
        refit_weights(_dropin(exported)[0], [1, 2])
    assert engine.refits == []


def test_peft_names_read_as_diffusers_names():
    """A module with a fused LoRA: base_layer weights under their diffusers names, the adapter's
    own matrices left out."""
    pipe = tp.pipeline(tp.tiny_transformer(), tp.tiny_vae())
    plain = set(pipe.transformer.state_dict())
    pipe.load_lora_weights(_lora(pipe.transformer), adapter_name="a")
    pipe.fuse_lora()
    assert any(".base_layer." in k for k in pipe.transformer.state_dict())
    assert set(live_state_dict(pipe.transformer)) == plain
