"""The base runner (qkrope.runtime.runner): every bad input rejected before anything executes
(through the ONNX Runtime runner, whose session counts executions), the messages' fixes, the
checks against an engine's profile bounds (fake engine I/O), run_positions."""

from __future__ import annotations

import pytest
import torch

from _runner_helpers import (C, HEAD_DIM, IMG_SHAPES, S_TXT, RecordingRunner, exported, fake_engine,  # noqa: F401
                             inputs, runner)

import fake_tensorrt as ft
from qkrope.runtime import RopeCacheError, RopeCacheOverflowError, build_qwen_rope_caches
from qkrope import model_io
from qkrope.runtime import io_specs
from qkrope.runtime import runner as rn


# --------------------------------------------------------------------------------------------
# Bad inputs: rejected before anything executes
# --------------------------------------------------------------------------------------------

def _bad_cases():
    hs, ehs, (img, txt) = inputs()
    cases = {}
    cos, sin = img[:, :8], img[:, 8:]
    tcos, tsin = txt[:, :8], txt[:, 8:]
    cases["diffusers 4-tuple"] = (
        dict(image_rotary_emb=(cos, sin, tcos, tsin)), RopeCacheError,
        r"image_rotary_emb must be cos_sin_cache tensors.*4 tensors.*to_cos_sin_caches")
    cases["complex pair"] = (
        dict(image_rotary_emb=(torch.polar(torch.ones(16, 8), torch.zeros(16, 8)),
                               torch.polar(torch.ones(5, 8), torch.zeros(5, 8)))),
        RopeCacheError, r"image_rotary_emb must be cos_sin_cache tensors.*to_cos_sin_caches")
    cases["nested (cos, sin) pairs"] = (
        dict(image_rotary_emb=((cos, sin), (tcos, tsin))), RopeCacheError,
        "image_rotary_emb must be cos_sin_cache tensors")
    cases["single tensor"] = (dict(image_rotary_emb=img), RopeCacheError,
                              "image_rotary_emb must be cos_sin_cache tensors")
    cases["cache dtype"] = (dict(image_rotary_emb=(img.half(), txt)), RopeCacheError,
                            "img cos_sin_cache must be float32")
    cases["rows overflow"] = (dict(image_rotary_emb=(img[:10], txt)), RopeCacheOverflowError,
                              "required=16, available=10, overflow=6")
    cases["txt rows overflow"] = (dict(image_rotary_emb=(img, txt[:2])), RopeCacheOverflowError,
                                  "txt cos_sin_cache has too few rows")
    cases["width > head_dim"] = (dict(image_rotary_emb=(torch.zeros(16, 18), txt)),
                                 RopeCacheError, "width .* must be even")
    cases["width != model's rotary_dim"] = (
        dict(image_rotary_emb=(img[:, :8].contiguous(), txt)), rn.RunnerInputError,
        r"img_cache \(model input 'img_cos_sin_cache'\) has shape \(16, 8\): dimension 1 is 8, "
        r"the model's is 16")
    cases["cache device"] = (dict(image_rotary_emb=(img.to("meta"), txt)), RopeCacheError,
                             "is on meta but the activations are on cpu")
    cases["cache non-contiguous"] = (
        dict(image_rotary_emb=(torch.zeros(16, 32)[:, ::2], txt)), RopeCacheError,
        "must be contiguous")
    cases["hidden size"] = (dict(hidden_states=torch.randn(2, 16, 64)), rn.RunnerInputError,
                            "hidden size is 64, the model's is 32")
    cases["encoder hidden size"] = (dict(encoder_hidden_states=torch.randn(2, 5, 16)),
                                    rn.RunnerInputError, "hidden size is 16, the model's is 32")
    cases["hidden dtype"] = (dict(hidden_states=hs.bfloat16()), rn.RunnerInputError,
                             r"has dtype bfloat16; the model expects float32.*\.to\(torch.float32\)")
    cases["hidden rank"] = (dict(hidden_states=hs[0]), rn.RunnerInputError, "must be 3-D")
    cases["hidden not a tensor"] = (dict(hidden_states=hs.numpy()), rn.RunnerInputError,
                                    "must be a torch.Tensor")
    cases["hidden non-contiguous"] = (dict(hidden_states=hs.transpose(0, 1).contiguous()
                                           .transpose(0, 1)), rn.RunnerInputError,
                                      "must be contiguous")
    cases["hidden device"] = (dict(hidden_states=hs.to("meta"), encoder_hidden_states=ehs.to("meta"),
                                   image_rotary_emb=(img.to("meta"), txt.to("meta"))),
                              rn.RunnerInputError, "the inputs are on meta; this runner takes cpu or cuda")
    cases["batch mismatch"] = (dict(encoder_hidden_states=torch.randn(1, 5, C)),
                               rn.RunnerInputError, "batch mismatch: hidden_states has batch 2")
    cases["mask shape"] = (dict(encoder_hidden_states_mask=torch.ones(2, 4, dtype=torch.bool)),
                           rn.RunnerInputError,
                           r"encoder_hidden_states_mask must be \[batch, txt_tokens\] = \(2, 5\)")
    cases["mask dtype"] = (dict(encoder_hidden_states_mask=torch.ones(2, 5)), rn.RunnerInputError,
                           "expects bool .*mask > 0")
    cases["mask device"] = (dict(encoder_hidden_states_mask=torch.ones(2, 5, dtype=torch.bool,
                                                                       device="meta")),
                            rn.RunnerInputError, "is on meta but hidden_states is on cpu")
    cases["timestep on an attention block"] = (dict(timestep=torch.ones(2)), rn.RunnerInputError,
                                               "no timestep input")
    cases["unknown extra input"] = (dict(extra_inputs={"bogus": torch.ones(1)}),
                                    rn.RunnerInputError, "unknown input")
    # extra_inputs must not replace an input the runner already validated (a short cache passed
    # this way used to reach ONNX Runtime and run)
    cases["extra_inputs replaces the image cache"] = (
        dict(extra_inputs={"img_cos_sin_cache": img[:4].contiguous()}), rn.RunnerInputError,
        r"extra_inputs names 'img_cos_sin_cache', which is the model's img_cache input.*"
        r"image_rotary_emb=")
    cases["extra_inputs replaces hidden_states"] = (
        dict(extra_inputs={"hidden_states": hs.clone()}), rn.RunnerInputError,
        "extra_inputs names 'hidden_states'.*hidden_states=")
    cases["extra_inputs replaces the default mask"] = (
        dict(extra_inputs={"encoder_hidden_states_mask": torch.ones(2, 5, dtype=torch.bool)}),
        rn.RunnerInputError, "encoder_hidden_states_mask=")
    return cases


BAD = _bad_cases()


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_rejected_before_execution(runner, case):
    overrides, exc_type, pattern = BAD[case]
    hs, ehs, caches = inputs()
    kwargs = dict(hidden_states=hs, encoder_hidden_states=ehs, image_rotary_emb=caches)
    kwargs.update(overrides)
    before = runner.session.calls
    with pytest.raises(exc_type, match=pattern) as info:
        runner(**kwargs)
    assert runner.session.calls == before, "the model ran despite a failed check"
    assert isinstance(info.value, RuntimeError)
    assert "Fix" in str(info.value)


def test_short_caches_are_refused_whatever_the_path(runner):
    """Cache rows >= the tokens of the cache's stream is checked once at the Python boundary:
    by validate_cos_sin_caches in Runner.prepare, the one way a cache reaches the model
    (extra_inputs may not replace a cache); check_inputs does not repeat it. Nothing runs."""
    hs, ehs, (img, txt) = inputs()
    roles = runner.io.roles
    good = {roles["hidden_states"]: hs, roles["encoder_hidden_states"]: ehs,
            roles["encoder_hidden_states_mask"]: torch.ones(2, S_TXT, dtype=torch.bool),
            roles["img_cache"]: img, roles["txt_cache"]: txt}
    rn.check_inputs(runner.io, good, device=torch.device("cpu"))
    before = runner.session.calls
    with pytest.raises(RopeCacheOverflowError, match=r"img cos_sin_cache has too few rows: "
                                                     r"required=16, available=10.*one row per "
                                                     r"img token"):
        runner(hs, ehs, (img[:10].contiguous(), txt))
    with pytest.raises(RopeCacheOverflowError, match=r"txt cos_sin_cache has too few rows: "
                                                     r"required=5, available=3"):
        runner(hs, ehs, (img, txt[:3].contiguous()))
    with pytest.raises(rn.RunnerInputError, match=r"extra_inputs names 'img_cos_sin_cache'"):
        runner(hs, ehs, (img, txt), extra_inputs={roles["img_cache"]: img[:10].contiguous()})
    assert runner.session.calls == before, "the model ran with a short cache"
    # more rows than tokens is fine (a cache built for the longest prompt)
    longer = build_qwen_rope_caches(IMG_SHAPES, S_TXT + 3, axes_dim=(2, 6, 8)).txt
    rn.check_inputs(runner.io, {**good, roles["txt_cache"]: longer}, device=torch.device("cpu"))
    runner(hs, ehs, (img, longer))


def test_check_roles_takes_no_timestep():
    import inspect

    assert list(inspect.signature(rn.check_roles).parameters) == [
        "hidden_states", "encoder_hidden_states", "mask"]


def test_errors_are_runtime_and_value_errors():
    assert issubclass(rn.RunnerInputError, RuntimeError)
    assert issubclass(rn.RunnerInputError, ValueError)


def test_messages_say_the_right_fix(runner):
    """2-D activations are a rank error (not a cache overflow), batch 0 on an ONNX model is not
    an engine-profile problem, float64 is cast to the model's dtype, sparse tensors are made
    dense."""
    hs, ehs, caches = inputs()
    with pytest.raises(rn.RunnerInputError, match="3-D") as info:
        runner(hs[0], ehs, caches)
    assert "rows" not in str(info.value) and "overflow" not in str(info.value)
    with pytest.raises(rn.RunnerInputError, match="3-D"):
        rn.check_inputs(runner.io, {runner.io.roles["hidden_states"]: hs[0]},
                        device=torch.device("cpu"))
    with pytest.raises(rn.RunnerInputError, match=r"batch.* 0.*at least 1") as info:
        runner(hs[:0], ehs[:0], caches)
    assert "qkrope build" not in str(info.value) and "engine" not in str(info.value)
    with pytest.raises(rn.RunnerInputError, match=r"cast .*model's dtype float32.*"
                                                  r"\.to\(torch\.float32\)") as info:
        runner(hs.double(), ehs.double(), caches)
    assert "export the model in float64" not in str(info.value)
    for args in ((hs.to_sparse(), ehs, caches), (hs, ehs, caches,
                                                 torch.ones(2, S_TXT, dtype=torch.bool).to_sparse())):
        with pytest.raises(rn.RunnerInputError, match=r"sparse.*\.to_dense\(\)") as info:
            runner(*args)
        assert ".contiguous()" not in str(info.value)


def test_engine_profile_range_still_says_rebuild():
    """The 'rebuild with qkrope build' advice stays where it is right: a TensorRT profile."""
    spec = model_io.spec_from_shape("x", "float32", ["batch", 4], bounds=([1, 4], [2, 4]))
    io = model_io.ModelIO([spec], [], 16, {}, profile_bounds=True)
    with pytest.raises(rn.RunnerInputError, match="qkrope build"):
        rn.check_inputs(io, {"x": torch.zeros(3, 4)}, device=torch.device("cpu"))
    with pytest.raises(rn.RunnerInputError, match="at least 1"):
        rn.check_inputs(io, {"x": torch.zeros(0, 4)}, device=torch.device("cpu"))


def test_run_positions_builds_caches_and_matches(runner, exported):
    hs, ehs, caches = inputs()
    with torch.no_grad():
        ref_img, ref_txt = exported[1](hs, ehs, caches)
    img, txt = runner.run_positions(hs, ehs, img_shapes=IMG_SHAPES)
    torch.testing.assert_close(img, ref_img, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(txt, ref_txt, atol=2e-5, rtol=1e-4)
    # caches with more rows than tokens are allowed (rows past the tokens are unused)
    img2, _ = runner(hs, ehs, inputs(extra_rows=3)[2])
    torch.testing.assert_close(img2, ref_img, atol=2e-5, rtol=1e-4)
    with pytest.raises(rn.RunnerInputError, match="give 12 image tokens but hidden_states has 16"):
        runner.run_positions(hs, ehs, img_shapes=[(1, 3, 4)])


# --------------------------------------------------------------------------------------------
# TensorRT engine I/O -> checks against the profile (fake engine; no TensorRT needed)
# --------------------------------------------------------------------------------------------

def test_engine_io_and_profile_bounds():
    trt, _ = ft.make_fake_trt()
    from qkrope.sidecars import EngineInfo, EngineTensor

    axes = {"hidden_states": ["batch", "img_tokens", None],
            "encoder_hidden_states": ["batch", "txt_tokens", None],
            "encoder_hidden_states_mask": ["batch", "txt_tokens"],
            "img_cos_sin_cache": ["img_cache_rows", None],
            "txt_cos_sin_cache": ["txt_cache_rows", None]}
    side = EngineInfo(
        tensorrt_version="10.14", onnx="/m.onnx",
        inputs=[EngineTensor(n, "float32", [-1] * len(a), a) for n, a in axes.items()],
        outputs=[], profiles=[], plugin=None, plugin_layers=2, version_compatible=False,
        strongly_typed=True, config={"head_dim": HEAD_DIM, "axes_dims_rope": [2, 6, 8]})
    io = io_specs.engine_model_io(fake_engine(), trt, side)
    assert io.head_dim == HEAD_DIM
    assert io.roles["img_cache"] == "img_cos_sin_cache"
    assert io.input("hidden_states").dims == ((1, 2), (1, 64), (C, C))
    assert io.input("hidden_states").axes == ("batch", "img_tokens", None)
    r = RecordingRunner(io)
    hs, ehs, caches = inputs()
    r(hs, ehs, caches)
    assert r.executed == 1
    r.run_positions(hs, ehs, img_shapes=IMG_SHAPES)
    assert r.executed == 2
    # beyond the profile: text tokens 9 > max 8, batch 3 > 2, cache rows 80 > 64
    with pytest.raises(rn.RunnerInputError, match=r"txt_tokens\) = 9 is outside the range 1..8.*"
                                                  r"--max-txt-tokens"):
        r(*inputs(s_txt=9))
    with pytest.raises(rn.RunnerInputError, match=r"dimension 0 \(batch\) = 3 is outside"):
        r(*inputs(batch=3))
    big = build_qwen_rope_caches([(1, 8, 10)], 5, axes_dim=(2, 6, 8))
    with pytest.raises(rn.RunnerInputError, match=r"img_cache_rows\) = 80 is outside the range"):
        r(hs, ehs, (big.img, caches[1]))
    assert r.executed == 2

