"""Issue 42, item 4: every answer from a server is checked before a scheduler sees it, and the
served export is the one the client was given.

Against small local stand-ins of a Triton server (an HTTP one from the standard library and a
gRPC one on tritonclient's generated service, both on 127.0.0.1 only, serving the config
``qkrope triton-repo`` wrote for the tiny transformer): an HTML page in place of a config or an
answer, a cut-off body, an answer of another batch or layout, a NaN, another export's identity;
each is ONE RunnerError line naming the server and the model. (The real server: the identity
at connect is also exercised in tests/test_triton_client.py.)
"""

from __future__ import annotations

import json
import re
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch

from _triton_helpers import parse, tiny_transformer_onnx  # noqa: F401

pytest.importorskip("google.protobuf", reason="triton-repo renders configs with protobuf")
grpc = pytest.importorskip("grpc", reason="tritonclient[grpc] is a test dependency")
tc_grpc = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is a test dependency")

from google.protobuf import json_format  # noqa: E402

from qkrope.runtime import runner_triton as rt  # noqa: E402
from qkrope.runtime import triton  # noqa: E402
from qkrope.runtime.runner import RunnerError  # noqa: E402
from qkrope.runtime.triton_io import IDENTITY_PARAMETER, export_identity  # noqa: E402

#: what each stand-in model answers (its name is the mode)
MODES = ("good", "html_config", "html", "proxy502", "cut", "short_body", "batch", "layout",
         "nan", "other_export", "no_identity")
HTML = b"<!DOCTYPE html><html><head><title>Sign in</title></head><body>proxy</body></html>"


def _answer_shape(inputs: dict, out_channels: int) -> list:
    b, tokens = inputs["hidden_states"][:2]
    return [b, tokens, out_channels]


class _Standin:
    """The config of the tiny transformer's model step, served under every mode's name."""

    def __init__(self, config: dict):
        self.config = config
        out = config["output"][0]
        self.out_name, self.out_channels = out["name"], int(out["dims"][-1])

    def config_for(self, mode: str) -> dict:
        cfg = json.loads(json.dumps(self.config))
        cfg["name"] = mode
        if mode == "other_export":
            cfg["parameters"][IDENTITY_PARAMETER] = {"string_value": "0" * 64}
        if mode == "no_identity":
            del cfg["parameters"][IDENTITY_PARAMETER]
        return cfg

    def output(self, mode: str, shapes: dict) -> tuple[list, bytes]:
        shape = _answer_shape(shapes, self.out_channels)
        values = np.full(shape, 0.5, np.float32)
        if mode == "nan":
            values[0, 1, 2] = np.nan
        if mode == "batch":
            values = np.concatenate([values, values])
        if mode == "layout":  # the same bytes as [batch, channels, tokens]
            values = values.transpose(0, 2, 1).copy()
        data = values.tobytes()
        if mode == "cut":
            return list(values.shape), data[: len(data) // 2]
        return list(values.shape), data


def _http_handler(standin: _Standin):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _send(self, status, body, ctype="application/json", headers=(), length=None):
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body) if length is None else length))
            for k, v in headers:
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def _mode(self) -> str:
            return self.path.split("/")[3]

        def do_GET(self):
            mode = self._mode()
            if mode == "html_config":
                return self._send(200, HTML, "text/html; charset=utf-8")
            self._send(200, json.dumps(standin.config_for(mode)).encode())

        def do_POST(self):
            mode = self._mode()
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if mode == "html":
                return self._send(200, HTML, "text/html")
            if mode == "proxy502":
                return self._send(502, HTML, "text/html")
            n = int(self.headers["Inference-Header-Content-Length"])
            request = json.loads(body[:n])
            shapes = {i["name"]: i["shape"] for i in request["inputs"]}
            shape, data = standin.output(mode, shapes)
            size = len(data) * (2 if mode == "cut" else 1)  # "cut": announces the whole
            head = json.dumps({"model_name": mode, "outputs": [
                {"name": standin.out_name, "datatype": "FP32", "shape": shape,
                 "parameters": {"binary_data_size": size}}]}).encode()
            payload = head + data
            if mode == "short_body":  # the connection ends before the announced length
                self._send(200, payload[: len(payload) - 10], "application/octet-stream",
                           [("Inference-Header-Content-Length", str(len(head)))],
                           length=len(payload))
                self.close_connection = True
                return
            self._send(200, payload, "application/octet-stream",
                       [("Inference-Header-Content-Length", str(len(head)))])

    return Handler


def _grpc_servicer(standin: _Standin, config_pb):
    pb = tc_grpc.service_pb2

    class Servicer(tc_grpc.service_pb2_grpc.GRPCInferenceServiceServicer):
        def ModelConfig(self, request, context):
            cfg = type(config_pb)()
            json_format.ParseDict(standin.config_for(request.name), cfg)
            return pb.ModelConfigResponse(config=cfg)

        def ModelInfer(self, request, context):
            mode = request.model_name
            shapes = {i.name: list(i.shape) for i in request.inputs}
            shape, data = standin.output(mode, shapes)
            res = pb.ModelInferResponse(model_name=mode)
            res.outputs.add(name=standin.out_name, datatype="FP32", shape=shape)
            if mode != "short_body":  # "short_body": an output without its raw contents
                res.raw_output_contents.append(data)
            return res

    return Servicer()


@pytest.fixture(scope="module")
def standins(tiny_transformer_onnx, tmp_path_factory):
    """Both stand-ins on loopback ports, for the module (stopped after it)."""
    repo = tmp_path_factory.mktemp("trust") / "repo"
    triton.write_onnx_repository(tiny_transformer_onnx, repo, name="tiny")
    config_pb = parse(repo / "tiny_onnx" / "config.pbtxt")
    standin = _Standin(json_format.MessageToDict(config_pb, preserving_proto_field_name=True))
    http = ThreadingHTTPServer(("127.0.0.1", 0), _http_handler(standin))
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    tc_grpc.service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
        _grpc_servicer(standin, config_pb), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield {"http": f"127.0.0.1:{http.server_address[1]}", "grpc": f"127.0.0.1:{port}"}
    finally:
        server.stop(0)
        http.shutdown()
        http.server_close()


@pytest.fixture
def runners():
    made = []

    def make(*args, **kwargs):
        made.append(rt.TritonRunner(*args, timeout_s=20, **kwargs))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _call(runner, batch=2):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(batch, 24, 16, generator=g)
    text = torch.randn(batch, 5, 24, generator=g)
    mask = torch.ones(batch, 5, dtype=torch.bool)
    return runner.run_positions(hidden, text, img_shapes=[(1, 4, 6)], mask=mask,
                                timestep=torch.full((batch,), 0.25))


def _one_line(exc_info, url: str, model: str) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg and url in msg and f"'{model}'" in msg and "Fix:" in msg, msg
    return msg


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_good_answer_passes(standins, runners, protocol):
    out = _call(runners(standins[protocol], "good", protocol=protocol))
    assert out.shape == (2, 24, 16) and bool((out == 0.5).all())


@pytest.mark.parametrize("protocol,mode,says", [
    ("http", "batch", "this call expects float32 [2, 24,"),
    ("http", "layout", "this call expects float32 [2, 24,"),
    ("http", "nan", "1 NaN or infinite values (the first at [0, 1, 2]"),
    ("http", "cut", "announces 3072 bytes but the body holds 1536"),
    ("http", "short_body", "the answer was cut short"),
    ("http", "html", "came back as an HTML page (text/html"),
    ("http", "proxy502", "HTTP 502: <!DOCTYPE html>"),
    ("grpc", "batch", "this call expects float32 [2, 24,"),
    ("grpc", "layout", "this call expects float32 [2, 24,"),
    ("grpc", "nan", "1 NaN or infinite values (the first at [0, 1, 2]"),
    ("grpc", "cut", "returned 1536 bytes for sample FP32 [2, 24, 16] (3072 expected)"),
    ("grpc", "short_body", "an answer of 1 outputs with 0 raw contents"),
])
def test_a_bad_answer_is_one_line_before_the_scheduler_sees_it(standins, runners, protocol,
                                                               mode, says):
    runner = runners(standins[protocol], mode, protocol=protocol)
    with pytest.raises(RunnerError) as err:
        _call(runner)
    msg = _one_line(err, standins[protocol], mode)
    assert says in msg, msg


def test_an_html_page_in_place_of_the_config_is_one_line(standins, runners):
    with pytest.raises(RunnerError) as err:
        runners(standins["http"], "html_config", protocol="http")
    msg = _one_line(err, standins["http"], "html_config")
    assert "the model's config came back as an HTML page" in msg and "proxy" in msg, msg


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_served_export_is_the_one_given(standins, runners, protocol,
                                            tiny_transformer_onnx):
    """sidecar= names the export the client expects: the identity the served config records
    is compared once, at connect; another export's, or none, is one line."""
    url = standins[protocol]
    runner = runners(url, "good", protocol=protocol, sidecar=str(tiny_transformer_onnx))
    assert runner.served_export == export_identity(
        __import__("qkrope.sidecars", fromlist=["ModelInfo"]).ModelInfo.load(tiny_transformer_onnx))
    with pytest.raises(RunnerError) as err:
        runners(url, "other_export", protocol=protocol, sidecar=str(tiny_transformer_onnx))
    msg = _one_line(err, url, "other_export")
    assert f"serves another export than {tiny_transformer_onnx}" in msg, msg
    with pytest.raises(RunnerError) as err:
        runners(url, "no_identity", protocol=protocol, sidecar=str(tiny_transformer_onnx))
    msg = _one_line(err, url, "no_identity")
    assert "records no export identity" in msg and "triton-repo" in msg, msg
    # without sidecar= the served config's own record is taken (nothing to compare)
    runners(url, "other_export", protocol=protocol)


def test_the_repository_records_the_export_identity(tiny_transformer_onnx, tmp_path):
    from qkrope.sidecars import ModelInfo

    triton.write_onnx_repository(tiny_transformer_onnx, tmp_path / "repo", name="m")
    cfg = parse(tmp_path / "repo" / "m_onnx" / "config.pbtxt")
    want = export_identity(ModelInfo.load(tiny_transformer_onnx))
    assert want and cfg.parameters[IDENTITY_PARAMETER].string_value == want
    # the identity follows the files' content: a rewritten export is another one
    info = ModelInfo.load(tiny_transformer_onnx)
    info.write_id = "f" * 16
    assert export_identity(info) != want


# --------------------------------------------------------------------------------------------
# The rope model refuses what the local drop-in refuses, with the same line (one check)
# --------------------------------------------------------------------------------------------

def _rope_error(model, pb, inputs: dict) -> str:
    from _triton_helpers import Tensor

    resp, = model.execute([pb.InferenceRequest([Tensor(n, a) for n, a in inputs.items()])])
    assert resp.error is not None and resp.error.code() == pb.TritonError.INVALID_ARG
    msg = resp.error.message()
    assert "\n" not in msg
    return msg


def _local_error(call) -> str:
    from qkrope.errors import QkropeError

    with pytest.raises(QkropeError) as err:
        call()
    assert "\n" not in str(err.value)
    return str(err.value)


def test_a_mask_of_another_rank_is_refused_alike_on_both_paths(tiny_transformer_onnx, tmp_path,
                                                               monkeypatch):
    """A [1, L, 1] mask (and a mask of another batch): the local runner and the served rope
    model (the grid scheme, Qwen-Image) refuse it with the same line."""
    from _triton_helpers import load_rope_model

    from qkrope.runtime import load

    triton.write_onnx_repository(tiny_transformer_onnx, tmp_path / "repo", name="tiny")
    model, pb = load_rope_model(tmp_path / "repo" / "tiny_rope", monkeypatch)
    local = load(tiny_transformer_onnx)
    hidden, text = torch.zeros(1, 24, 16), torch.zeros(1, 5, 24)
    for mask in (torch.ones(1, 5, 1, dtype=torch.bool), torch.ones(2, 5, dtype=torch.bool)):
        here = _local_error(lambda: local.run_positions(hidden, text, img_shapes=[(1, 4, 6)],
                                                        mask=mask, timestep=torch.zeros(1)))
        served = _rope_error(model, pb, {"img_shapes": np.array([[1, 4, 6]], np.int64),
                                         "hidden_states": hidden.numpy(),
                                         "encoder_hidden_states_mask": mask.numpy()})
        assert served == here and "encoder_hidden_states_mask must be [batch, txt_tokens]" in \
            here, (served, here)


@pytest.fixture(scope="module")
def z_image(tmp_path_factory):
    """The tiny Z-Image export (tables axes_lens (256, 32, 32)) and its repository."""
    pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
    from qkrope.export.api import export_transformer
    from qkrope.families.z_image import tiny as z_tiny

    root = tmp_path_factory.mktemp("trust-z")
    z_tiny.z_image_transformer(0).save_pretrained(str(root / "z"))
    out = root / "z.onnx"
    export_transformer(root / "z", out, dtype="fp32", progress=False)
    triton.write_onnx_repository(out, root / "repo", name="z")
    return out, root / "repo"


def test_positions_past_the_tables_are_refused_alike_on_both_paths(z_image, monkeypatch):
    """A Z-Image sample whose positions run past its RoPE tables (a latent 66 rows high: 33
    height positions, the tiny tables hold 32): the local drop-in refuses it before running,
    the served rope model refuses the ids of that sample with the same line (the table
    scheme's check_lengths, with the lengths the repository recorded); ids within the tables
    are served."""
    from _triton_helpers import load_rope_model

    from qkrope.families.z_image.dropin import padded, sample_ids
    from qkrope.runtime import load_transformer

    out, repo = z_image
    model, pb = load_rope_model(repo / "z_rope", monkeypatch)
    assert model.setting.table_lengths == (256, 32, 32)
    dropin = load_transformer(out)
    latent, caption = torch.zeros(16, 1, 66, 4), torch.zeros(7, 16)
    here = _local_error(lambda: dropin(x=[latent], t=torch.zeros(1), cap_feats=[caption],
                                       return_dict=False))
    txt_ids, img_ids = sample_ids([(1, 33, 2)], padded(7))

    def request(img_ids):
        return {"txt_ids": txt_ids, "img_ids": img_ids,
                "hidden_states": np.zeros((1, len(img_ids), 64), np.float32),
                "encoder_hidden_states_mask": np.ones((1, len(txt_ids)), bool)}

    served = _rope_error(model, pb, request(img_ids))
    assert "needs 33 positions on axis 1, more than the model's RoPE tables hold" in served
    assert here.endswith(served), (here, served)
    ok, = model.execute([pb.InferenceRequest([__import__("_triton_helpers").Tensor(n, a) for n, a
                                              in request(img_ids[img_ids[:, 1] < 32]).items()])])
    assert ok.error is None, ok.error.message()


def test_a_z_image_mask_of_another_rank_is_refused_alike(z_image, monkeypatch):
    """The table scheme's rope model took a [1, L, 1] mask before (it read axis 1 only)."""
    from _triton_helpers import load_rope_model

    from qkrope.families.z_image.dropin import padded, sample_ids
    from qkrope.runtime import load
    from qkrope.runtime.caches import RopeCaches

    out, repo = z_image
    model, pb = load_rope_model(repo / "z_rope", monkeypatch)
    txt_ids, img_ids = sample_ids([(1, 2, 2)], padded(7))
    mask = np.ones((1, len(txt_ids), 1), bool)
    served = _rope_error(model, pb, {"txt_ids": txt_ids, "img_ids": img_ids,
                                     "hidden_states": np.zeros((1, 4, 64), np.float32),
                                     "encoder_hidden_states_mask": mask})
    runner = load(out)
    caches = RopeCaches(torch.zeros(4, 16), torch.zeros(len(txt_ids), 16))
    here = _local_error(lambda: runner(torch.zeros(1, 4, 64), torch.zeros(1, len(txt_ids), 16),
                                       caches, torch.from_numpy(mask), torch.zeros(1)))
    assert served == here, (served, here)


# --------------------------------------------------------------------------------------------
# triton-repo writes what it checked, and nothing but its own files goes with a model directory
# --------------------------------------------------------------------------------------------

def _engine(tiny_transformer_onnx, tmp_path, **facts):
    """The tiny stand-in engine with its sidecar's ``facts`` changed (version_compatible, ...)."""
    from _triton_helpers import tiny_engine

    eng, plugin, _ = tiny_engine(tiny_transformer_onnx, tmp_path)
    side = tmp_path / "tiny.engine.json"
    data = json.loads(side.read_text())
    data.update(facts)
    side.write_text(json.dumps(data))
    return eng, plugin


def test_triton_repo_of_a_version_compatible_engine_needs_allow_host_code(
        tiny_transformer_onnx, tmp_path, capsys):
    """The repository of a version-compatible engine is served with version-compatible=true
    (the server runs the plugin code the engine carries): the caller's explicit
    --allow-host-code, as for check/refit/generate; without it one line, nothing written."""
    from _oneline import error_line

    from qkrope.cli import main as cli_main
    from qkrope.runtime.loader_tensorrt import HostCodeNotAllowedError

    eng, plugin = _engine(tiny_transformer_onnx, tmp_path, version_compatible=True)
    repo = tmp_path / "repo"
    with pytest.raises(HostCodeNotAllowedError):
        triton.write_repository(eng, repo, plugin=plugin, name="m")
    assert not repo.exists()
    args = ["triton-repo", "--engine", str(eng), "--plugin", str(plugin), "-o", str(repo),
            "--name", "m"]
    assert cli_main(args) != 0
    msg = error_line(capsys)
    assert "version-compatible" in msg and "--allow-host-code" in msg, msg
    assert not repo.exists()
    assert cli_main(args + ["--allow-host-code"]) == 0
    out = capsys.readouterr().out
    assert "version-compatible=true" in out
    assert (repo / "m_trt" / "1" / "model.plan").read_bytes() == eng.read_bytes()


def test_force_never_removes_the_users_files_in_a_model_directory(tiny_transformer_onnx,
                                                                  tmp_path, capsys):
    """--force replaces a model directory only while it holds nothing but qkrope's own files
    (and the __pycache__ the Python backend writes): a user's notes, another model version or a
    file beside the ensemble's config are named in one line, and nothing is written."""
    from _oneline import error_line

    from qkrope.cli import main as cli_main

    eng, plugin = _engine(tiny_transformer_onnx, tmp_path)
    repo = tmp_path / "repo"
    args = ["triton-repo", "--engine", str(eng), "--plugin", str(plugin), "-o", str(repo),
            "--name", "m", "--force"]
    assert cli_main(args) == 0
    cache = repo / "m_rope" / "1" / "__pycache__"  # what the Python backend leaves
    cache.mkdir()
    (cache / "model.cpython-312.pyc").write_bytes(b"pyc")
    assert cli_main(args) == 0  # only qkrope's files there: replaced
    # the ONNX repository's files are qkrope's too (its record names the data files)
    onnx_args = ["triton-repo", "--backend", "onnxruntime", "--onnx", str(tiny_transformer_onnx),
                 "-o", str(tmp_path / "orepo"), "--name", "o", "--force"]
    assert cli_main(onnx_args) == 0 and cli_main(onnx_args) == 0
    capsys.readouterr()

    mine = {repo / "m_trt" / "NOTES.md": b"my notes", repo / "m_trt" / "2" / "model.plan":
            b"my other version", repo / "m" / "README": b"mine"}
    (repo / "m_trt" / "2").mkdir()
    for path, data in mine.items():
        path.write_bytes(data)
    served = (repo / "m_trt" / "config.pbtxt").read_bytes()
    eng.write_bytes(b"another plan" * 10)  # a new engine to serve: nothing of it goes in
    side = json.loads((tmp_path / "tiny.engine.json").read_text())
    side.pop("engine_sha256", None), side.pop("engine_file", None)
    (tmp_path / "tiny.engine.json").write_text(json.dumps(side))
    assert cli_main(args) != 0
    msg = error_line(capsys)
    assert "NOTES.md" in msg and "2/" in msg and "qkrope did not write" in msg, msg
    assert "move them out" in msg and "--output" in msg, msg
    for path, data in mine.items():
        assert path.read_bytes() == data
    assert (repo / "m_trt" / "config.pbtxt").read_bytes() == served
    assert (repo / "m_trt" / "1" / "model.plan").read_bytes() != eng.read_bytes()
    with pytest.raises(triton.TritonRepoError, match="README"):  # the Python API alike
        (repo / "m_trt" / "NOTES.md").unlink()
        import shutil
        shutil.rmtree(repo / "m_trt" / "2")
        triton.write_repository(eng, repo, plugin=plugin, name="m", force=True)
    assert (repo / "m" / "README").read_bytes() == b"mine"


@pytest.mark.parametrize("rewritten", ["engine", "plugin", "onnx"])
def test_a_source_rewritten_while_it_is_copied_is_not_served(tiny_transformer_onnx, tmp_path,
                                                            monkeypatch, capsys, rewritten):
    """The engine (its plugin, the ONNX model) is checked against its sidecar, then copied: a
    rewrite in between (here: right before the copy) is caught by hashing the copy, one line,
    nothing committed."""
    from _oneline import error_line

    from qkrope.cli import main as cli_main

    eng, plugin = _engine(tiny_transformer_onnx, tmp_path)
    onnx_copy = tmp_path / "o" / "tiny.onnx"
    onnx_copy.parent.mkdir()
    onnx_copy.write_bytes(tiny_transformer_onnx.read_bytes())
    (tmp_path / "o" / "tiny.onnx.json").write_bytes(
        (tiny_transformer_onnx.parent / "tiny.onnx.json").read_bytes())
    victim = {"engine": eng, "plugin": plugin, "onnx": onnx_copy}[rewritten]
    real = triton.link_or_copy

    def rewrite_first(src, dst, **kw):
        if Path(src) == victim:
            with open(victim, "r+b") as f:  # in place: same size, another byte
                f.seek(3)
                f.write(b"X")
        return real(src, dst, **kw)

    monkeypatch.setattr(triton, "link_or_copy", rewrite_first)
    repo = tmp_path / "repo"
    if rewritten == "onnx":
        args = ["triton-repo", "--backend", "onnxruntime", "--onnx", str(onnx_copy)]
    else:
        args = ["triton-repo", "--engine", str(eng), "--plugin", str(plugin)]
    assert cli_main(args + ["-o", str(repo), "--name", "m"]) != 0
    msg = error_line(capsys)
    assert f"{victim} changed while it was copied" in msg and "nothing was written" in msg, msg
    assert not repo.exists() or not any(repo.iterdir())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # staging removed


def test_bad_shapes_get_the_same_line_on_both_paths(tiny_transformer_onnx, tmp_path,
                                                    monkeypatch):
    """The rank and batch of the latent and the mask: one check (schemes.check_token_shapes)
    with the same inputs on both paths (the served rope model sees the latent and the mask):
    a mask of another batch than the latent's, a 1-D mask, a 5-D latent of an image family, a
    float mask (schemes.check_mask_dtype, against the mask input's declared type)."""
    from _triton_helpers import load_rope_model

    from qkrope.runtime import load

    triton.write_onnx_repository(tiny_transformer_onnx, tmp_path / "repo", name="tiny")
    model, pb = load_rope_model(tmp_path / "repo" / "tiny_rope", monkeypatch)
    local = load(tiny_transformer_onnx)
    cases = [  # (hidden_states, encoder_hidden_states, mask, what the line says)
        (torch.zeros(2, 24, 16), torch.zeros(1, 5, 24), torch.ones(1, 5, dtype=torch.bool),
         r"must be \[batch, txt_tokens\] = \(2, 5\)"),
        (torch.zeros(1, 24, 16), torch.zeros(1, 5, 24), torch.ones(5, dtype=torch.bool),
         r"must be \[batch, txt_tokens\] \(2-D, batch 1.*got shape \(5,\)"),
        (torch.zeros(1, 16, 1, 4, 6), torch.zeros(1, 5, 24), torch.ones(1, 5, dtype=torch.bool),
         r"hidden_states must be 3-D"),
        (torch.zeros(1, 24, 16), torch.zeros(1, 5, 24), torch.ones(1, 5),
         r"has dtype float32; the model expects bool"),
    ]
    for hidden, text, mask, pattern in cases:
        here = _local_error(lambda: local.run_positions(hidden, text, img_shapes=[(1, 4, 6)],
                                                        mask=mask, timestep=torch.zeros(1)))
        served = _rope_error(model, pb, {"img_shapes": np.array([[1, 4, 6]], np.int64),
                                         "hidden_states": hidden.numpy(),
                                         "encoder_hidden_states_mask": mask.numpy()})
        assert served == here and re.search(pattern, here), (served, here)
