"""The ONNX Runtime runner (qkrope.runtime.runner_onnxrt): parity with the eager
QwenImageAttention, output buffer reuse, threads, bf16 bound zero-copy through IOBinding."""

from __future__ import annotations

import pytest
import torch

from _runner_helpers import (C, SpySession, _write_bf16_identity_model,  # noqa: F401
                             exported, inputs, runner)

import threading

from qkrope import model_io
from qkrope.runtime import runner as rn
from qkrope.runtime.backends import load


# --------------------------------------------------------------------------------------------
# Parity
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch,img_shapes,s_txt,masked", [
    (2, [(1, 4, 4)], 5, False),
    (1, [(1, 2, 3)], 7, True),
    (3, [(1, 4, 4), (1, 2, 2)], 4, True),
])
def test_ort_parity_with_eager(runner, exported, batch, img_shapes, s_txt, masked):
    module = exported[1]
    s_img = sum(f * h * w for f, h, w in img_shapes)
    hs, ehs, caches = inputs(batch, s_img, s_txt, img_shapes)
    mask = None
    if masked:
        mask = torch.ones(batch, s_txt, dtype=torch.bool)
        mask[0, -2:] = False
    with torch.no_grad():
        ref_img, ref_txt = module(hs, ehs, caches, mask)
    img, txt = runner(hs, ehs, caches, mask)
    assert img.shape == (batch, s_img, C) and txt.shape == (batch, s_txt, C)
    torch.testing.assert_close(img, ref_img, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(txt, ref_txt, atol=2e-5, rtol=1e-4)


def test_outputs_allocated_once_per_shape(exported):
    r = load(exported[0])
    hs, ehs, caches = inputs()
    a_img, _ = r(hs, ehs, caches)
    ptr = a_img.data_ptr()
    b_img, _ = r(hs * 2, ehs, caches)
    assert b_img.data_ptr() == ptr  # same buffer, overwritten
    c_img, _ = r(*inputs(batch=1)[:2], caches)
    assert c_img.data_ptr() != ptr and c_img.shape[0] == 1
    d_img, _ = r(hs, ehs, caches)
    assert d_img.data_ptr() == ptr  # the batch-2 buffer is still cached
    keep = load(exported[0], copy_outputs=True)
    e_img, _ = keep(hs, ehs, caches)
    f_img, _ = keep(hs, ehs, caches)
    assert e_img.data_ptr() != f_img.data_ptr()


def test_threads_get_their_own_buffers(runner, exported):
    results, errors = {}, []

    def work(seed):
        try:
            hs, ehs, caches = inputs(seed=seed)
            for _ in range(3):
                img, _ = runner(hs, ehs, caches)
            with torch.no_grad():
                ref, _ = exported[1](hs, ehs, caches)
            results[seed] = (img.clone(), ref)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for img, ref in results.values():
        torch.testing.assert_close(img, ref, atol=2e-5, rtol=1e-4)


# --------------------------------------------------------------------------------------------
# bf16 through IOBinding (numpy has no bfloat16): a graph ORT's CPU provider can run in bf16
# --------------------------------------------------------------------------------------------

def test_bf16_zero_copy_binding(tmp_path):
    r = load(_write_bf16_identity_model(tmp_path / "bf16.onnx"))
    hs, ehs, caches = inputs()
    hs, ehs = hs.bfloat16(), ehs.bfloat16()
    img, txt = r(hs, ehs, caches)
    assert img.dtype == torch.bfloat16
    assert torch.equal(img, hs) and torch.equal(txt, ehs)  # bit-exact: no conversion anywhere
    with pytest.raises(rn.RunnerInputError, match="has dtype float32; the model expects bfloat16"):
        r(hs.float(), ehs, caches)


def test_bf16_unresolvable_output_rejected_before_execution(tmp_path):
    """A bf16 output whose shape does not follow from the inputs' named axes cannot be read back:
    that is known before anything runs, so the session must not run."""
    r = load(_write_bf16_identity_model(tmp_path / "bf16.onnx"))
    spec = r.io.outputs[0]
    r.io.outputs[0] = model_io.TensorSpec(spec.name, spec.dtype, spec.dims,
                                    ("mystery_axis",) + spec.axes[1:])
    r.session = SpySession(r.session)
    hs, ehs, caches = inputs()
    with pytest.raises(rn.RunnerError, match="cannot bind the bfloat16 output img_out"):
        r(hs.bfloat16(), ehs.bfloat16(), caches)
    assert r.session.calls == 0, "ONNX Runtime ran before the unresolvable output was reported"

