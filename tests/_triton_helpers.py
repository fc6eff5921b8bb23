"""Shared by the Triton tests: the tiny exported transformer, config parsing, and a stand-in for
``triton_python_backend_utils`` (the Python backend's module, present only inside a server) with
its real names, keyword names and error codes."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

def server_harness():
    """scripts/triton_server.py (the tritonserver harness: install, stand-ins, Server) as a
    module, loaded once per session."""
    if "triton_server" not in sys.modules:
        root = Path(__file__).resolve().parent.parent
        spec = importlib.util.spec_from_file_location("triton_server",
                                                      root / "scripts" / "triton_server.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["triton_server"] = module
        spec.loader.exec_module(module)
    return sys.modules["triton_server"]


TYPE = {"bfloat16": "TYPE_BF16", "float32": "TYPE_FP32", "bool": "TYPE_BOOL"}


def dyn(shape):
    return [-1 if isinstance(d, str) else d for d in shape]


def parse(path: Path):
    return text_format.Parse(Path(path).read_text(encoding="utf-8"),
                             model_config_pb2.ModelConfig())


def io(cfg, kind):
    return [(t.name, model_config_pb2.DataType.Name(t.data_type), list(t.dims))
            for t in getattr(cfg, kind)]


@pytest.fixture(scope="module")
def tiny_transformer_onnx(tmp_path_factory):
    """`qkrope export --model transformer` of the tiny diffusers transformer."""
    from _tiny_model import export_tiny_transformer

    return export_tiny_transformer(tmp_path_factory.mktemp("tinytr"), "t", "tiny.onnx")[1]


def tiny_engine(onnx_path, tmp_path, profiles=()):
    """A stand-in engine for the exported model: dummy plan bytes, a realistic engine sidecar
    (the network's I/O from the ONNX sidecar, a fake plugin recorded by hash)."""
    import hashlib

    from qkrope.sidecars import EngineInfo, EngineTensor, ModelInfo, PluginRecord, engine_tensors

    info = ModelInfo.load(onnx_path)
    plugin = tmp_path / "libqkrope_plugin.so"
    plugin.write_bytes(b"\x7fELF fake plugin")
    net = lambda items: [EngineTensor(t.name, t.dtype, dyn(t.shape)) for t in items]  # noqa
    side = EngineInfo(
        tensorrt_version="10.14", onnx=str(onnx_path),
        inputs=engine_tensors(net(info.inputs), info),
        outputs=engine_tensors(net(info.outputs), info), profiles=list(profiles),
        plugin=PluginRecord(str(plugin), hashlib.sha256(plugin.read_bytes()).hexdigest()),
        plugin_layers=2, version_compatible=False, strongly_typed=True, config=info.config)
    eng = tmp_path / "tiny.engine"
    eng.write_bytes(b"not really a TensorRT plan" * 10)
    Path(str(eng) + ".json").write_text(json.dumps(side.to_dict()))
    return eng, plugin, info


class Tensor:
    """pb_utils.Tensor(name, numpy_array): .name(), .as_numpy()."""

    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


def stand_in_pb_utils():
    m = types.ModuleType("triton_python_backend_utils")
    m.Tensor = Tensor

    class InferenceRequest:
        def __init__(self, inputs):
            self.inputs = inputs

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self.output_tensors, self.error = output_tensors, error

    class TritonError(Exception):
        """TritonError(message, code=TritonError.INTERNAL): .message(), .code()."""
        UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, \
            CANCELLED = range(8)

        def __init__(self, message, code=INTERNAL):
            super().__init__(message)
            self._message, self._code = message, code

        def message(self):
            return self._message

        def code(self):
            return self._code

    m.InferenceRequest, m.InferenceResponse, m.TritonError = (InferenceRequest,
                                                              InferenceResponse, TritonError)
    m.get_input_tensor_by_name = lambda r, n: next((t for t in r.inputs if t.name() == n), None)
    m.get_output_tensor_by_name = lambda r, n: next(
        (t for t in r.output_tensors if t.name() == n), None)
    return m


def load_rope_model(rope_dir: Path, monkeypatch):
    """The rope model of a written repository, initialised as Triton does (the config as JSON),
    with the stand-in utils module; returns (model, utils)."""
    pb = stand_in_pb_utils()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    cfg = json_format.MessageToDict(parse(rope_dir / "config.pbtxt"),
                                    preserving_proto_field_name=True)
    spec = importlib.util.spec_from_file_location(f"rope_model_{id(rope_dir)}",
                                                  rope_dir / "1" / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = mod.TritonPythonModel()
    model.initialize({"model_config": json.dumps(cfg)})
    return model, pb


def rope_request(pb, shapes, txt_len, *, tokens=None, batch=1, channels=8):
    """A request for the rope model: img_shapes, a latent of ``tokens`` (default: what the
    shapes give) and a text mask of ``txt_len``."""
    shapes = np.asarray(shapes, np.int64)
    if tokens is None:
        tokens = int(sum(int(f) * int(h) * int(w) for f, h, w in shapes.reshape(-1, 3)))
    return pb.InferenceRequest([
        Tensor("img_shapes", shapes),
        Tensor("hidden_states", np.zeros((batch, tokens, channels), np.float32)),
        Tensor("encoder_hidden_states_mask", np.ones((batch, txt_len), bool))])


def serves_the_same_step(repo: Path, name: str, monkeypatch, sent: list, feeds: dict,
                         caches, exported: Path) -> None:
    """The rope model of ``repo``'s ``name`` ensemble answers ``sent`` (its request Tensors)
    with ``feeds``' caches bit for bit, and the repository's ONNX model fed them with the other
    feeds gives ONNX Runtime's output of ``exported`` on ``feeds`` bit for bit."""
    import onnxruntime as ort

    model, pb = load_rope_model(repo / f"{name}_rope", monkeypatch)
    resp = model.execute([pb.InferenceRequest(sent)])[0]
    assert resp.error is None, resp.error.message()
    served = {k: v for k, v in feeds.items() if k not in caches}
    for cache in caches:
        served[cache] = pb.get_output_tensor_by_name(resp, cache).as_numpy()
        assert served[cache].dtype == feeds[cache].dtype
        assert np.array_equal(served[cache], feeds[cache]), cache
    step = repo / f"{name}_onnx" / "1" / "model.onnx"
    run = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, f)[0]
           for p, f in ((step, served), (exported, feeds))]
    assert np.array_equal(run[0], run[1])


def ids_repository(onnx: Path, repo: Path, name: str, capsys):
    """``qkrope triton-repo`` (ONNX Runtime backend) of an export whose clients send
    ``txt_ids`` / ``img_ids``: said on stdout, and the ensemble's inputs are the export's less
    the caches, then the two ids. Returns ``(info, caches, ensemble inputs)``."""
    from qkrope import model_io
    from qkrope.cli import main
    from qkrope.sidecars import ModelInfo

    assert main(["triton-repo", "--backend", "onnxruntime", "--onnx", str(onnx), "-o",
                 str(repo), "--name", name]) == 0
    assert "clients send txt_ids and img_ids, not the caches" in capsys.readouterr().out
    info = ModelInfo.load(onnx)
    caches = {t.name for t in model_io.CACHE_INPUTS}
    inputs = io(parse(repo / name / "config.pbtxt"), "input")
    assert [n for n, _, _ in inputs] == [
        n for n in info.input_names if n not in caches] + ["txt_ids", "img_ids"]
    return info, caches, inputs
