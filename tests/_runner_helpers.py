"""What the runtime tests share: the tiny attention block exported once, seeded inputs, a spy
on ONNX Runtime's session, a bf16 identity model, and fake engines (tests/fake_tensorrt.py) with a
stand-in for the CUDA calls, so that the TensorRT runner's bookkeeping runs without a GPU."""

from __future__ import annotations

import contextlib
import json
import types
from pathlib import Path

import fake_tensorrt as ft
import pytest
import torch

from qkrope.runtime import build_qwen_rope_caches
from qkrope.runtime import loader_tensorrt, runner_tensorrt
from qkrope.runtime import runner as rn
from qkrope.sidecars import ModelInfo
from qkrope.runtime.backends import load

HEADS, HEAD_DIM = 2, 16

C = HEADS * HEAD_DIM

IMG_SHAPES = [(1, 4, 4)]

S_IMG, S_TXT = 16, 5


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from qkrope.export.onnx_export import build_attention, export_attention

    path = tmp_path_factory.mktemp("runner") / "attn.onnx"
    info, _ = export_attention(path, heads=HEADS, head_dim=HEAD_DIM, img_shapes=IMG_SHAPES,
                               txt_len=S_TXT, batch=2)
    return path, build_attention(ModelInfo.load(path))


class SpySession:
    """Delegates to the ORT session and counts executions."""

    def __init__(self, session):
        self._s = session
        self.calls = 0

    def run_with_iobinding(self, *a, **k):
        self.calls += 1
        return self._s.run_with_iobinding(*a, **k)

    def run(self, *a, **k):  # pragma: no cover - the runner uses IOBinding
        self.calls += 1
        return self._s.run(*a, **k)

    def __getattr__(self, name):
        return getattr(self._s, name)


@pytest.fixture(scope="module")
def runner(exported):
    r = load(exported[0])
    r.session = SpySession(r.session)
    return r


def inputs(batch=2, s_img=S_IMG, s_txt=S_TXT, img_shapes=IMG_SHAPES, seed=0, extra_rows=0,
           axes_dim=(2, 6, 8)):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(batch, s_img, C, generator=g)
    ehs = torch.randn(batch, s_txt, C, generator=g)
    caches = build_qwen_rope_caches(img_shapes, s_txt + extra_rows, axes_dim=axes_dim)
    return hs, ehs, (caches.img, caches.txt)


def _write_bf16_identity_model(path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper

    bf, f32, b = TensorProto.BFLOAT16, TensorProto.FLOAT, TensorProto.BOOL
    ins = [helper.make_tensor_value_info("hidden_states", bf, ["batch", "img_tokens", C]),
           helper.make_tensor_value_info("encoder_hidden_states", bf, ["batch", "txt_tokens", C]),
           helper.make_tensor_value_info("encoder_hidden_states_mask", b, ["batch", "txt_tokens"]),
           helper.make_tensor_value_info("img_cos_sin_cache", f32, ["img_cache_rows", HEAD_DIM]),
           helper.make_tensor_value_info("txt_cos_sin_cache", f32, ["txt_cache_rows", HEAD_DIM])]
    outs = [helper.make_tensor_value_info("img_out", bf, ["batch", "img_tokens", C]),
            helper.make_tensor_value_info("txt_out", bf, ["batch", "txt_tokens", C])]
    nodes = [helper.make_node("Identity", ["hidden_states"], ["img_out"]),
             helper.make_node("Identity", ["encoder_hidden_states"], ["txt_out"])]
    model = helper.make_model(helper.make_graph(nodes, "bf16_identity", ins, outs),
                              opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.save(model, str(path))
    Path(str(path) + ".json").write_text(json.dumps({
        "format": "qkrope-onnx", "format_version": 1, "model": "attention", "opset": 18,
        "ir_version": 10,
        "dtype": "bf16", "dynamic_axes": {}, "node_attributes": {},
        "sample": {"img_shapes": [list(IMG_SHAPES[0])], "txt_len": S_TXT, "batch": 2},
        "inputs": [{"name": i.name, "dtype": d, "shape": s} for i, d, s in zip(
            ins, ["bfloat16", "bfloat16", "bool", "float32", "float32"],
            [["batch", "img_tokens", C], ["batch", "txt_tokens", C], ["batch", "txt_tokens"],
             ["img_cache_rows", HEAD_DIM], ["txt_cache_rows", HEAD_DIM]])],
        "outputs": [{"name": "img_out", "dtype": "bfloat16", "shape": ["batch", "img_tokens", C]},
                    {"name": "txt_out", "dtype": "bfloat16", "shape": ["batch", "txt_tokens", C]}],
        "config": {"head_dim": HEAD_DIM, "axes_dims_rope": [2, 6, 8]}}))
    return path


def fake_engine(max_img=64, max_txt=8, max_batch=2) -> ft.ICudaEngine:
    """The ICudaEngine calls engine_model_io makes, for the tiny attention block."""
    d = [("hidden_states", "FLOAT", [-1, -1, C], [(1, 1, C), (2, 16, C), (max_batch, max_img, C)]),
         ("encoder_hidden_states", "FLOAT", [-1, -1, C],
          [(1, 1, C), (2, 5, C), (max_batch, max_txt, C)]),
         ("encoder_hidden_states_mask", "BOOL", [-1, -1], [(1, 1), (2, 5), (max_batch, max_txt)]),
         ("img_cos_sin_cache", "FLOAT", [-1, HEAD_DIM],
          [(1, HEAD_DIM), (16, HEAD_DIM), (max_img, HEAD_DIM)]),
         ("txt_cos_sin_cache", "FLOAT", [-1, HEAD_DIM],
          [(1, HEAD_DIM), (5, HEAD_DIM), (max_txt, HEAD_DIM)])]
    io = [(n, t, s, p, ft.TensorIOMode.INPUT) for n, t, s, p in d]
    io += [("img_out", "FLOAT", [-1, -1, C], None, ft.TensorIOMode.OUTPUT),
           ("txt_out", "FLOAT", [-1, -1, C], None, ft.TensorIOMode.OUTPUT)]
    return ft.ICudaEngine(io)


class RecordingRunner(rn.Runner):
    backend = "fake"

    def __init__(self, io):
        super().__init__(io)
        self.executed = 0

    def _check_device(self, device):
        pass

    def _execute(self, feeds, axes, device):
        self.executed += 1
        return [torch.zeros(1), torch.zeros(1)]


def _profile(batch, img, txt):
    """{input: (min, opt, max)} of a profile up to (batch, img, txt); batch = (lo, hi)."""
    b0, b1 = batch
    return {"hidden_states": ((b0, 1, C), (b1, img, C), (b1, img, C)),
            "encoder_hidden_states": ((b0, 1, C), (b1, txt, C), (b1, txt, C)),
            "encoder_hidden_states_mask": ((b0, 1), (b1, txt), (b1, txt)),
            "img_cos_sin_cache": ((1, HEAD_DIM), (img, HEAD_DIM), (img, HEAD_DIM)),
            "txt_cos_sin_cache": ((1, HEAD_DIM), (txt, HEAD_DIM), (txt, HEAD_DIM))}


def _multi_engine(profiles):
    io = [(n, t, s, None, ft.TensorIOMode.INPUT) for n, t, s in (
        ("hidden_states", "FLOAT", [-1, -1, C]), ("encoder_hidden_states", "FLOAT", [-1, -1, C]),
        ("encoder_hidden_states_mask", "BOOL", [-1, -1]),
        ("img_cos_sin_cache", "FLOAT", [-1, HEAD_DIM]),
        ("txt_cos_sin_cache", "FLOAT", [-1, HEAD_DIM]))]
    io += [("img_out", "FLOAT", [-1, -1, C], None, ft.TensorIOMode.OUTPUT),
           ("txt_out", "FLOAT", [-1, -1, C], None, ft.TensorIOMode.OUTPUT)]
    return ft.ICudaEngine(io, profiles=profiles, output_like={
        "img_out": "hidden_states", "txt_out": "encoder_hidden_states"})


def _engine_sidecar(labels=()):
    from qkrope.sidecars import EngineInfo, EngineTensor

    axes = {"hidden_states": ["batch", "img_tokens", None],
            "encoder_hidden_states": ["batch", "txt_tokens", None],
            "encoder_hidden_states_mask": ["batch", "txt_tokens"],
            "img_cos_sin_cache": ["img_cache_rows", None],
            "txt_cos_sin_cache": ["txt_cache_rows", None]}
    return EngineInfo(
        tensorrt_version="10.14", onnx="/m.onnx",
        inputs=[EngineTensor(n, "float32", [-1] * len(a), a) for n, a in axes.items()],
        outputs=[], profiles=[], plugin=None, plugin_layers=2, version_compatible=False,
        strongly_typed=True, config={"head_dim": HEAD_DIM, "axes_dims_rope": [2, 6, 8]},
        profile_labels=list(labels))


class FakeCuda:
    """Stands in for runner_tensorrt.TorchCuda: streams are plain objects, graphs record what they
    captured and count replays."""

    class Graph:
        def __init__(self):
            self.captured, self.replays = [], 0

    def __init__(self):
        self.graphs, self.capturing = [], None

    def new_stream(self, device):
        return types.SimpleNamespace(cuda_stream=1000 + len(self.graphs))

    def current_stream(self, device):
        return types.SimpleNamespace(cuda_stream=0)

    def handle(self, stream):
        return stream.cuda_stream

    def wait(self, a, b):
        pass

    def record(self, t, s):
        pass

    def stream_scope(self, s):
        return contextlib.nullcontext()

    def new_graph(self):
        g = FakeCuda.Graph()
        self.graphs.append(g)
        return g

    def capture(self, graph, stream):
        @contextlib.contextmanager
        def cm():
            self.capturing = graph
            yield
            self.capturing = None
        return cm()

    def replay(self, graph, stream):
        graph.replays += 1


def _fake_trt_runner(profiles, labels=(), cuda_graph=False):
    trt, _ = ft.make_fake_trt()
    engine = _multi_engine(profiles)
    cuda = FakeCuda()
    r = runner_tensorrt.TensorRTRunner(loader_tensorrt.LoadedEngine(engine, trt, _engine_sidecar(
        labels)), device=torch.device("cpu"), cuda=cuda, cuda_graph=cuda_graph)
    r._check_device = lambda device: None
    return r, engine, cuda


def _qwen_inputs(batch, grid, s_txt):
    return inputs(batch=batch, s_img=grid * grid, s_txt=s_txt, img_shapes=[(1, grid, grid)])

