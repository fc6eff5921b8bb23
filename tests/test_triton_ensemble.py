"""The whole transformer in Triton: ensemble = Python-backend RoPE model -> TensorRT / ONNX Runtime
model. The configs are checked for wiring; the rope model runs here with a stand-in for
``triton_python_backend_utils`` (tests/test_triton_server.py runs it in a real server)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from _triton_helpers import (TYPE, io, load_rope_model, parse, rope_request,  # noqa: F401
                             tiny_engine, tiny_transformer_onnx)
from qkrope.cli import main as cli_main
from qkrope.runtime import triton
from qkrope.runtime.caches import build_qwen_rope_caches
from qkrope.sidecars import ModelInfo


def _check_ensemble(repo: Path, name: str, main_name: str, main_io):
    cfgs = {p.name: parse(p / "config.pbtxt") for p in repo.iterdir()}
    assert set(cfgs) == {name, main_name, f"{name}_rope"}
    main, rope, ens = cfgs[main_name], cfgs[f"{name}_rope"], cfgs[name]
    assert (io(main, "input"), io(main, "output")) == main_io
    assert ens.platform == "ensemble" and ens.max_batch_size == 0
    assert rope.backend == "python" and rope.max_batch_size == 0
    assert (repo / f"{name}_rope" / "1" / "model.py").read_text() == \
        triton.ROPE_MODEL_TEMPLATE.read_text()
    for f in triton.rope_scheme_files():  # the position schemes, numpy only, beside it
        assert (repo / f"{name}_rope" / "1" / "schemes" / f.name).read_bytes() == f.read_bytes()
    client = {n for n, _, _ in io(ens, "input")}
    assert client == {n for n, _, _ in main_io[0]} - set(triton.CACHE_INPUTS) | {"img_shapes"}
    # wiring: every step's model exists and each input map names the model's real input and a
    # tensor that exists upstream (a client input or an earlier step's output)
    avail = {n: (dt, d) for n, dt, d in io(ens, "input")}
    for step in ens.ensemble_scheduling.step:
        model = cfgs[step.model_name]
        ins = {n: (dt, d) for n, dt, d in io(model, "input")}
        assert set(step.input_map) == set(ins)
        for key, value in step.input_map.items():
            assert value in avail and avail[value][0] == ins[key][0]
        outs = {n: (dt, d) for n, dt, d in io(model, "output")}
        for key, value in step.output_map.items():
            avail[value] = outs[key]
    assert [o[0] for o in io(ens, "output")] == ["sample"]
    assert all(o in avail for o, _, _ in io(ens, "output"))
    # the rope model sees the latent (its token count) as well as img_shapes
    rope_step = next(s for s in ens.ensemble_scheduling.step if s.model_name.endswith("_rope"))
    assert set(rope_step.input_map) == {"img_shapes", "hidden_states",
                                        "encoder_hidden_states_mask"}
    return cfgs


def _onnx_io(onnx_path):
    info = ModelInfo.load(onnx_path)
    return tuple([(t.name, TYPE.get(t.dtype, triton.triton_dtype(t.dtype)),
                   [d if isinstance(d, int) else -1 for d in t.shape]) for t in items]
                 for items in (info.inputs, info.outputs))


def _params(cfg) -> dict:
    return {k: v.string_value for k, v in cfg.parameters.items()}


def test_onnxruntime_ensemble_for_the_transformer(tiny_transformer_onnx, tmp_path, capsys):
    repo = tmp_path / "repo"
    assert cli_main(["triton-repo", "--backend", "onnxruntime", "--onnx",
                     str(tiny_transformer_onnx), "-o", str(repo)]) == 0
    cfgs = _check_ensemble(repo, "tiny", "tiny_onnx", _onnx_io(tiny_transformer_onnx))
    assert cfgs["tiny_onnx"].backend == "onnxruntime"
    files = sorted(p.name for p in (repo / "tiny_onnx" / "1").iterdir())
    data = Path(str(tiny_transformer_onnx) + ".data")
    assert files == ["model.onnx", "model.onnx.json"] + (["tiny.onnx.data"] if data.exists()
                                                     else [])
    assert "numpy < 2" in capsys.readouterr().out  # the Python env note
    # limits of an ONNX model: qkrope build's default profile
    from qkrope.runtime.profiles import DEFAULT_MAX_IMG_TOKENS, DEFAULT_MAX_TXT_TOKENS

    p = _params(cfgs["tiny_rope"])
    assert (p["max_img_tokens"], p["max_txt_tokens"]) == (str(DEFAULT_MAX_IMG_TOKENS),
                                                          str(DEFAULT_MAX_TXT_TOKENS))
    assert int(p["cache_bytes"]) == triton.ROPE_CACHE_BYTES
    # an engine is refused for --backend onnxruntime
    eng = tmp_path / "x.engine"
    eng.write_bytes(b"plan")
    assert cli_main(["triton-repo", "--backend", "onnxruntime", "--onnx", str(eng), "-o",
                     str(tmp_path / "r2")]) == 2
    assert not (tmp_path / "r2").exists()


def test_tensorrt_ensemble_for_the_transformer(tiny_transformer_onnx, tmp_path):
    eng, plugin, _ = tiny_engine(tiny_transformer_onnx, tmp_path)
    repo = tmp_path / "repo"
    res = triton.write_repository(eng, repo, plugin=plugin)
    cfgs = _check_ensemble(repo, "tiny", "tiny_trt", _onnx_io(tiny_transformer_onnx))
    assert cfgs["tiny_trt"].platform == "tensorrt_plan"
    assert (repo / "tiny_trt" / triton.PLUGIN_FILE_NAME).is_file()
    assert res.model_dir == repo / "tiny" and "plugins=" in res.command


def _profile(info, img_rows, txt_rows):
    """One optimisation profile over the ONNX inputs, max = the given rows/tokens."""
    sizes = {"batch": 2, "img_tokens": img_rows, "txt_tokens": txt_rows,
             "img_cache_rows": img_rows, "txt_cache_rows": txt_rows}
    prof = {}
    for t in info.inputs:
        hi = [sizes.get(d, 1) if isinstance(d, str) else d for d in t.shape]
        prof[t.name] = {"min": [1 if isinstance(d, str) else d for d in t.shape],
                        "opt": hi, "max": hi}
    return prof


def test_the_rope_limits_come_from_the_engine_profiles(tiny_transformer_onnx, tmp_path):
    info = ModelInfo.load(tiny_transformer_onnx)
    eng, plugin, _ = tiny_engine(tiny_transformer_onnx, tmp_path,
                                  [_profile(info, 256, 32), _profile(info, 1024, 64)])
    repo = tmp_path / "repo"
    triton.write_repository(eng, repo, plugin=plugin)
    assert _params(parse(repo / "tiny_rope" / "config.pbtxt"))["max_img_tokens"] == "1024"
    assert _params(parse(repo / "tiny_rope" / "config.pbtxt"))["max_txt_tokens"] == "64"
    triton.write_repository(eng, repo, plugin=plugin, force=True, max_img_tokens=512)
    assert _params(parse(repo / "tiny_rope" / "config.pbtxt"))["max_img_tokens"] == "512"
    with pytest.raises(triton.TritonRepoError, match=r"--max-txt-tokens 65: must be in 1\.\.64"):
        triton.write_repository(eng, tmp_path / "r2", plugin=plugin, max_txt_tokens=65)


@pytest.fixture
def rope_model(tiny_transformer_onnx, tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    triton.write_onnx_repository(tiny_transformer_onnx, repo, max_img_tokens=300,
                                 max_txt_tokens=40)
    model, pb = load_rope_model(repo / "tiny_rope", monkeypatch)
    axes = tuple(ModelInfo.load(tiny_transformer_onnx).config.diffusers_config
                 ["axes_dims_rope"])
    return model, pb, axes


def test_the_rope_model_builds_the_library_caches(rope_model):
    model, pb, axes = rope_model
    for shapes, txt in (([[1, 4, 6]], 7), ([[1, 3, 3], [1, 2, 4]], 5), ([[1, 4, 6]], 7)):
        resp, = model.execute([rope_request(pb, shapes, txt)])
        assert resp.error is None
        ref = build_qwen_rope_caches(shapes, txt, axes_dim=axes)
        img = pb.get_output_tensor_by_name(resp, "img_cos_sin_cache").as_numpy()
        txt_c = pb.get_output_tensor_by_name(resp, "txt_cos_sin_cache").as_numpy()
        assert img.dtype == np.float32 and txt_c.dtype == np.float32
        assert np.array_equal(img, ref.img.numpy()) and np.array_equal(txt_c, ref.txt.numpy())
        assert img.shape[1] == sum(axes)


BAD_REQUESTS = {
    # name: (img_shapes, txt_len, latent tokens or None, what the message names)
    "not [images, 3]": (np.zeros((2,), np.int64), 3, 1, "must be [images, 3]"),
    "no images": (np.zeros((0, 3), np.int64), 3, 1, "must be [images, 3]"),
    "negative": ([[1, -4, 4]], 3, 16, "positive"),
    "zero": ([[1, 0, 4]], 3, 1, "positive"),
    "huge": ([[1, 2**40, 2**40]], 3, 1, f"give {2**80} image tokens, more than the 300"),
    "many huge": (np.full((300, 3), 2**62), 3, 1, "... (300 images)] give"),
    "beyond the profile": ([[1, 20, 20]], 3, 400, "400 image tokens, more than the 300"),
    "too many images": (np.ones((301, 3), np.int64), 3, 301, "301 images"),
    "text beyond the profile": ([[1, 4, 4]], 41, None, "41 text tokens, more than the 40"),
    "latent has other tokens": ([[1, 8, 8]], 3, 16, "give 64 image tokens but hidden_states "
                                                    "has shape [1, 16, 8]"),
    "positions past the table": ([[1, 1, 9000]], 3, None, "image cache overflow"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_a_bad_request_is_invalid_arg_with_the_reason(rope_model, case):
    model, pb, _ = rope_model
    if case == "positions past the table":
        model.max_img = 10**6  # the limit alone would refuse it first
    shapes, txt, tokens, reason = BAD_REQUESTS[case]
    good = rope_request(pb, [[1, 2, 2]], 3)
    bad, ok = model.execute([rope_request(pb, shapes, txt, tokens=tokens), good])
    assert bad.error is not None and reason in bad.error.message(), bad.error.message()
    assert bad.error.code() == pb.TritonError.INVALID_ARG
    assert ok.error is None  # one bad request does not fail the others


def test_an_internal_failure_stays_internal(rope_model, monkeypatch):
    model, pb, _ = rope_model
    monkeypatch.setattr(model.scheme, "build", lambda *a, **k: 1 / 0)
    resp, = model.execute([rope_request(pb, [[1, 2, 3]], 3)])
    assert resp.error.code() == pb.TritonError.INTERNAL
    assert "ZeroDivisionError" in resp.error.message()


def test_the_rope_model_keeps_at_most_its_byte_budget(rope_model):
    """Many distinct client shapes: the kept caches never exceed the budget; reuse works."""
    model, pb, axes = rope_model
    model.cache.limit = 40_000  # a few entries' worth
    row = sum(axes) * 4
    for h in range(1, 40):
        resp, = model.execute([rope_request(pb, [[1, h, 7]], 9)])
        assert resp.error is None
        assert model.cache.nbytes <= model.cache.limit
        assert model.cache.nbytes == sum(sum(a.nbytes for a in v)
                                         for v in model.cache._items.values())
    assert 0 < len(model.cache) < 39
    assert model.cache.nbytes >= model.cache.limit - (39 * 7 + 9) * row  # evicts only as needed
    # an entry larger than the budget is served, not kept
    before = dict(model.cache._items)
    resp, = model.execute([rope_request(pb, [[1, 17, 17]], 40)])
    assert resp.error is None and dict(model.cache._items) == before


def test_a_non_ascii_ensemble_name_is_refused(tiny_transformer_onnx, tmp_path, capsys):
    """Triton 2.51's Python backend fails to load a model from a non-ASCII directory (seen in
    tests/test_triton_server.py's server): refused up front, nothing written."""
    rc = cli_main(["triton-repo", "--backend", "onnxruntime", "--onnx", str(tiny_transformer_onnx),
                   "-o", str(tmp_path / "repo"), "--name", "tiny-\u00e9"])
    err = capsys.readouterr().err
    assert rc == 2 and "non-ASCII" in err and "--name" in err and err.count("\n") == 1
    assert not (tmp_path / "repo").exists()


def test_a_bf16_latent_is_measured_through_dlpack(rope_model):
    """A bf16 engine's hidden_states: the Python backend's as_numpy refuses BF16, so the rope
    model reads the shape from the tensor's DLPack capsule (a real one here, from torch)."""
    import torch
    from torch.utils.dlpack import to_dlpack

    from _triton_helpers import Tensor

    model, pb, axes = rope_model

    class BF16Tensor(Tensor):
        def __init__(self, name, t):
            super().__init__(name, np.zeros(0))
            self._t = t

        def as_numpy(self):
            raise RuntimeError("Tensor dtype is BF16 and cannot be converted to NumPy. Use "
                               "to_dlpack() and from_dlpack() instead.")

        def to_dlpack(self):
            return to_dlpack(self._t)

    for tokens, ok in ((24, True), (20, False)):
        req = rope_request(pb, [[1, 4, 6]], 5, batch=2)  # the mask of the latent's batch
        req.inputs[1] = BF16Tensor("hidden_states", torch.zeros(2, tokens, 16, dtype=torch.bfloat16))
        resp, = model.execute([req])
        assert (resp.error is None) == ok, resp.error and resp.error.message()
        if not ok:
            assert "hidden_states has shape [2, 20, 16]" in resp.error.message()
            assert resp.error.code() == pb.TritonError.INVALID_ARG


def test_the_ensemble_is_unbatched_and_places_its_models(tiny_transformer_onnx, tmp_path):
    with pytest.raises(triton.TritonRepoError, match="needs --max-batch-size 0"):
        triton.write_onnx_repository(tiny_transformer_onnx, tmp_path / "r",
                                     serving=triton.Serving(max_batch_size=2))
    repo = tmp_path / "repo"
    assert cli_main(["triton-repo", "--backend", "onnxruntime", "--onnx",
                     str(tiny_transformer_onnx), "-o", str(repo), "--instances", "3",
                     "--gpus", "0,1"]) == 0
    main, = parse(repo / "tiny_onnx" / "config.pbtxt").instance_group
    rope, = parse(repo / "tiny_rope" / "config.pbtxt").instance_group
    assert (main.count, list(main.gpus), main.kind) == (3, [0, 1], main.KIND_GPU)
    assert (rope.count, list(rope.gpus), rope.kind) == (3, [], rope.KIND_CPU)
    assert not parse(repo / "tiny" / "config.pbtxt").instance_group  # an ensemble has none
