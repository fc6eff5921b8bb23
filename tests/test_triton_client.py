"""qkrope's Triton client (qkrope.runtime.runner_triton) against a real Triton Inference Server
(2.51 from the nvidia-pytriton wheel, started by scripts/triton_server.py on loopback ports;
skipped with the reason where it cannot start).

The server has no onnxruntime backend, so the repository's model step ``tiny_onnx`` is served by
the Python-backend STAND-IN (tests/triton_standin/model.py: ONNX Runtime on the repository's own
model.onnx, one thread), as in tests/test_triton_server.py. The reference is a local ONNX Runtime
session with the same settings, so the served results must be equal bit for bit. Beside it the
test repository holds models of its own: ``echo_bf16`` (returns its BF16 input through DLPack,
never as numbers), ``broken`` (the model step's I/O and record, answering every request with a
two-line error) and ``norecord`` (the model step without the client's I/O record), and a tiny
FLUX.1 dev export's repository (``flux``). Every test sends a bounded number of requests.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from _triton_helpers import server_harness, parse, tiny_engine, tiny_transformer_onnx  # noqa: F401
from qkrope.runtime import triton
from qkrope.runtime import runner_triton as rt
from qkrope.runtime.runner import RunnerError
from qkrope.runtime.triton_io import IO_PARAMETER, model_io_of

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is a test dependency "
                                                "(pip install -e '.[test]')")
pytestmark = pytest.mark.slow


harness = server_harness()

ECHO_CONFIG = """name: "echo_bf16"
backend: "python"
input [ { name: "x" data_type: TYPE_BF16 dims: [ -1 ] } ]
output [ { name: "y" data_type: TYPE_BF16 dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
ECHO_MODEL = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor.from_dlpack(
            "y", pb_utils.get_input_tensor_by_name(r, "x").to_dlpack())]) for r in requests]
'''
BROKEN_MODEL = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
            "the model step failed\\n   on its second line", pb_utils.TritonError.INVALID_ARG))
                for _ in requests]
'''


def _copy_model(repo: Path, src: str, name: str, *, model_py: str | None = None,
                drop_record: bool = False) -> None:
    shutil.copytree(repo / src, repo / name)
    cfg = parse(repo / name / "config.pbtxt")
    cfg.name = name
    if drop_record:
        del cfg.parameters[IO_PARAMETER]
    (repo / name / "config.pbtxt").write_text(triton.to_text(cfg), encoding="utf-8")
    if model_py is not None:
        (repo / name / "1" / "model.py").write_text(model_py, encoding="utf-8")


@pytest.fixture(scope="module")
def served(tiny_transformer_onnx, tmp_path_factory):
    import onnxruntime

    try:
        install = harness.prepare()
        ort_path = harness.onnxruntime_for_stand_in(onnxruntime.__version__)
    except harness.SetupError as exc:
        pytest.skip(f"no Triton server here: {exc}")
    root = tmp_path_factory.mktemp("triton_client")
    repo = root / "repo"
    triton.write_onnx_repository(tiny_transformer_onnx, repo, name="tiny")
    harness.use_onnx_stand_in(repo, "tiny_onnx", ort_path)
    flux_onnx = _flux_export(root)
    triton.write_onnx_repository(flux_onnx, repo, name="flux")
    harness.use_onnx_stand_in(repo, "flux_onnx", ort_path)
    _copy_model(repo, "tiny_onnx", "broken", model_py=BROKEN_MODEL)
    _copy_model(repo, "tiny_onnx", "norecord", drop_record=True)
    (repo / "echo_bf16" / "1").mkdir(parents=True)
    (repo / "echo_bf16" / "config.pbtxt").write_text(ECHO_CONFIG, encoding="utf-8")
    (repo / "echo_bf16" / "1" / "model.py").write_text(ECHO_MODEL, encoding="utf-8")
    with harness.Server(install, repo, log=repo.parent / "server.log") as srv:
        srv.flux_onnx = flux_onnx
        yield srv


def _flux_export(root: Path) -> Path:
    import _flux_models as fm

    return fm.exported("flux1-dev", root)


def _url(srv, protocol):
    return srv.grpc_url if protocol == "grpc" else srv.http_url


@pytest.fixture
def runners():
    """Runners a test makes, closed after it (an open HTTP keep-alive connection would hold up
    the server's shutdown)."""
    made = []

    def make(*args, **kwargs):
        made.append(rt.TritonRunner(*args, **kwargs))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _local(onnx_path):
    """The reference: ONNX Runtime on the CPU with one thread, as the stand-in runs."""
    import onnxruntime as ort

    from qkrope.runtime import load

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return load(onnx_path, sess_options=options)


def _call_inputs(tokens_hw, txt, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    f, h, w = tokens_hw
    hidden = torch.randn(batch, f * h * w, 16, generator=g)
    text = torch.randn(batch, txt, 24, generator=g)
    mask = torch.ones(batch, txt, dtype=torch.bool)
    mask[-1, txt // 2:] = False  # a padded prompt
    return hidden, text, mask, torch.full((batch,), 0.25)


PROTOCOLS = ["grpc", "http"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_runner_matches_local_onnx_runtime_bit_for_bit(served, runners, protocol,
                                                          tiny_transformer_onnx):
    """Named by the ensemble ("tiny") or by its model step: the same model is called, and the
    served results equal the local session's (4 requests)."""
    local = _local(tiny_transformer_onnx)
    for model in ("tiny", "tiny_onnx"):
        runner = runners(_url(served, protocol), model, protocol=protocol)
        assert runner.model == "tiny_onnx" and runner.backend == "triton"
        for shape, txt in (((1, 8, 8), 16), ((1, 4, 6), 5)):
            hidden, text, mask, t = _call_inputs(shape, txt)
            got = runner.run_positions(hidden, text, img_shapes=[shape], mask=mask, timestep=t)
            want = local.run_positions(hidden, text, img_shapes=[shape], mask=mask, timestep=t)
            assert got.dtype == want.dtype and torch.equal(got, want), (model, shape)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_drop_in_runs_a_pipeline_as_the_local_one_does(served, protocol,
                                                           tiny_transformer_onnx):
    """pipe.transformer = triton_transformer(...): a tiny Qwen-Image pipeline with true CFG
    (two predictions alive per step) gives the latents of the local drop-in, bit for bit
    (2 steps x 2 requests)."""
    import onnxruntime as ort

    from qkrope.apps import tiny_pipeline as tp
    from qkrope.runtime import load_transformer, triton_transformer

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    remote = triton_transformer(_url(served, protocol), "tiny", protocol=protocol)
    local = load_transformer(tiny_transformer_onnx, sess_options=options)
    assert dict(remote.config) == dict(local.config) and remote.dtype == local.dtype
    pe, pm = tp.prompt_embeds(1, 7, seed=1)
    ne, nm = tp.prompt_embeds(1, 5, seed=2)
    latents = []
    for transformer in (local, remote):
        pipe = tp.pipeline(transformer, tp.tiny_vae())
        latents.append(pipe(prompt_embeds=pe, prompt_embeds_mask=pm, negative_prompt_embeds=ne,
                            negative_prompt_embeds_mask=nm, true_cfg_scale=2.0, height=32,
                            width=32, num_inference_steps=2, output_type="latent",
                            generator=torch.Generator().manual_seed(0)).images)
    remote._runner.close()
    assert latents[0].shape == latents[1].shape and torch.equal(latents[0], latents[1])


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_flux_drop_in_matches_the_local_one(served, protocol):
    """A FLUX.1 dev export served the same way: the drop-in (FluxTransformer, by the record's
    family) sends pooled_projections and guidance too; bit for bit the local drop-in's (one
    request; the export is the session's, made once by tests/_flux_models.py)."""
    import onnxruntime as ort

    import _flux_models as fm
    from qkrope.runtime import load_transformer, triton_transformer
    from qkrope.families.flux.dropin import FluxTransformer

    family = fm.VARIANTS["flux1-dev"][0]
    txt_ids, img_ids = fm.ids(family, [(1, 4, 4)], 5)
    g = torch.Generator().manual_seed(3)
    kw = dict(hidden_states=torch.randn(2, 16, 4, generator=g),
              encoder_hidden_states=torch.randn(2, 5, 32, generator=g),
              pooled_projections=torch.randn(2, 32, generator=g), timestep=torch.tensor(0.5),
              guidance=torch.tensor([3.5, 2.0]), img_ids=img_ids, txt_ids=txt_ids,
              return_dict=False)
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    local = load_transformer(served.flux_onnx, sess_options=options)
    remote = triton_transformer(_url(served, protocol), "flux", protocol=protocol)
    try:
        assert isinstance(remote, FluxTransformer) and remote.config == local.config
        got, = remote(**kw)
        want, = local(**kw)
    finally:
        remote._runner.close()
    assert got.shape == (2, 16, 4) and torch.equal(got, want)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bfloat16_goes_and_comes_back_bit_for_bit(served, protocol):
    """Every one of the 65536 bfloat16 bit patterns (NaNs, infinities, subnormals included)
    through a served model that returns its BF16 input untouched (one request)."""
    x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    cls = rt._Grpc if protocol == "grpc" else rt._Http
    transport = cls(_url(served, protocol), 60, {})
    try:
        got = transport.infer("echo_bf16", "", [("x", *rt.to_wire(x))], ["y"])
    finally:
        transport.close()
    datatype, shape, data = got["y"]
    assert (datatype, shape, len(data)) == ("BF16", [2**16], 2**17)
    y = rt.from_wire(data, datatype, shape, name="y", device=torch.device("cpu"))
    assert y.dtype == torch.bfloat16
    assert torch.equal(y.view(torch.int16), x.view(torch.int16))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_servers_refusal_is_one_line(served, runners, protocol):
    runner = runners(_url(served, protocol), "broken", protocol=protocol)
    hidden, text, mask, t = _call_inputs((1, 2, 2), 3)
    with pytest.raises(RunnerError) as err:
        runner.run_positions(hidden, text, img_shapes=[(1, 2, 2)], mask=mask, timestep=t)
    msg = str(err.value)
    assert "\n" not in msg
    assert "'broken'" in msg and "the model step failed on its second line" in msg, msg
    assert f"({protocol})" in msg and "Fix:" in msg


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_set_up_errors_are_one_line_with_the_fix(served, runners, protocol,
                                                 tiny_transformer_onnx):
    url = _url(served, protocol)
    with pytest.raises(RunnerError) as err:
        runners(url, "no_such_model", protocol=protocol)
    msg = str(err.value)
    assert "\n" not in msg and "'no_such_model'" in msg and "tiny_onnx" in msg, msg
    with pytest.raises(RunnerError) as err:  # no record: the fix names sidecar=
        runners(url, "norecord", protocol=protocol)
    assert "\n" not in str(err.value) and "sidecar=" in str(err.value)
    # ... which works: the export's sidecar describes the served model
    runner = runners(url, "norecord", protocol=protocol, sidecar=str(tiny_transformer_onnx))
    hidden, text, mask, t = _call_inputs((1, 2, 2), 3)
    got = runner.run_positions(hidden, text, img_shapes=[(1, 2, 2)], mask=mask, timestep=t)
    want = _local(tiny_transformer_onnx).run_positions(hidden, text, img_shapes=[(1, 2, 2)],
                                                  mask=mask, timestep=t)
    assert torch.equal(got, want)
    # the export given is the one served: the identity triton-repo recorded matches, at connect
    runner = runners(url, "tiny", protocol=protocol, sidecar=str(tiny_transformer_onnx))
    assert runner.served_export is not None and runner.model == "tiny_onnx"
    with pytest.raises(RunnerError) as err:  # a sidecar of another model is refused
        runners(url, "echo_bf16", protocol=protocol, sidecar=str(tiny_transformer_onnx))
    assert "\n" not in str(err.value) and "serves inputs ['x']" in str(err.value)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_server_that_is_not_there_is_one_line(protocol):
    url = f"127.0.0.1:{harness.free_port()}"  # nothing listens there
    with pytest.raises(RunnerError) as err:
        rt.TritonRunner(url, "tiny", protocol=protocol, timeout_s=5)
    msg = str(err.value)
    assert "\n" not in msg and url in msg and "start the server" in msg, msg


def test_the_wire_form_round_trips_every_dtype_the_models_use():
    """to_wire / from_wire without a server: the bytes are the tensor's memory (bf16 as its
    two bytes), and come back equal, bit for bit, in the same dtype and shape; a byte count
    that does not fit the shape is one line."""
    cpu = torch.device("cpu")
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    for sent in (torch.randn(2, 3), torch.randn(3, 2).t(),  # a strided view goes contiguous
                 torch.tensor([[True, False]]), torch.arange(6).reshape(3, 2),
                 torch.randn(4, 5).to(torch.bfloat16), torch.randn(3).half(), torch.empty(0, 4)):
        datatype, shape, data = rt.to_wire(sent)
        assert len(data) == sent.numel() * sent.element_size()
        back = rt.from_wire(data, datatype, shape, name="x", device=cpu)
        assert back.dtype == sent.dtype and back.shape == sent.shape
        if sent.is_floating_point():  # the bits, NaN payloads and -0.0 included
            kind = bits[sent.element_size()]
            assert torch.equal(back.view(kind), sent.contiguous().view(kind))
        else:
            assert torch.equal(back, sent)
    with pytest.raises(RunnerError, match=r"returned 7 bytes for y FP32 \[2\] \(8 expected\)"):
        rt.from_wire(b"\0" * 7, "FP32", [2], name="y", device=cpu)


def test_bad_arguments_are_refused_before_any_connection():
    for kwargs, says in ((dict(protocol="rest"), "protocol must be one of"),
                         (dict(timeout_s=0), "timeout_s must be"),
                         (dict(url=""), "url must be"), (dict(model=""), "model must be")):
        args = {"url": "127.0.0.1:1", "model": "m", **kwargs}
        with pytest.raises(RunnerError, match=says):
            rt.TritonRunner(args.pop("url"), args.pop("model"), **args)


def test_every_written_main_model_carries_the_io_record(tiny_transformer_onnx, tmp_path):
    """The record in the TensorRT and ONNX Runtime repositories describes the export: the
    same inputs, outputs, roles and config as the local runner reads from its sidecar."""
    from qkrope.runtime.io_specs import onnx_model_io

    want = onnx_model_io(tiny_transformer_onnx)
    eng, plugin, _ = tiny_engine(tiny_transformer_onnx, tmp_path)
    triton.write_repository(eng, tmp_path / "repo", plugin=plugin, name="t")
    triton.write_onnx_repository(tiny_transformer_onnx, tmp_path / "repo", name="o")
    for main in ("t_trt", "o_onnx"):
        cfg = parse(tmp_path / "repo" / main / "config.pbtxt")
        io = model_io_of(cfg.parameters[IO_PARAMETER].string_value, source=main)
        assert io.roles == want.roles and io.head_dim == want.head_dim
        assert [(s.name, s.dtype, s.axes) for s in io.inputs + io.outputs] == \
            [(s.name, s.dtype, s.axes) for s in want.inputs + want.outputs]
        assert io.config.diffusers_config == want.config.diffusers_config
        assert io.config.parameters is None  # the refit's key list stays in the sidecar


def test_a_bf16_onnx_model_is_put_on_a_gpu(tiny_transformer_onnx, tmp_path):
    """ONNX Runtime's CPU provider cannot run a bfloat16 model: its instance kind is KIND_GPU,
    never KIND_AUTO (which falls back to the CPU where Triton finds no GPU); a float32 model
    keeps KIND_AUTO."""
    from qkrope.apps import tiny_pipeline as tp
    from qkrope.cli import main as cli_main

    tp.save_transformer(tp.tiny_transformer(), tmp_path / "t")
    bf16 = tmp_path / "tiny_bf16.onnx"
    assert cli_main(["export", "--model", "transformer", "--diffusers", str(tmp_path / "t"),
                     "--dtype", "bf16", "--out", str(bf16)]) == 0
    for model, kind in ((bf16, "KIND_GPU"), (tiny_transformer_onnx, "KIND_AUTO")):
        repo = tmp_path / f"repo_{kind}"
        triton.write_onnx_repository(model, repo, name="m")
        groups = parse(repo / "m_onnx" / "config.pbtxt").instance_group
        assert [g.Kind.Name(g.kind) for g in groups] == [kind], model
