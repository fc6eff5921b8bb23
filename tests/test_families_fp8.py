"""FP8 on every family (issue 30 item 6, issue 32 item 4), over the tiny builders of
tests/_families.py: a family gets these tests by adding its builder.

For each family, as a user does it:

1. calibration calls are recorded from the tiny model (``CalibrationRecorder``) in the family's
   pipelines' own input form (tests/_input_forms.py), two calls of different inputs;
2. ``qkrope quantize`` calibrates with the record's default exclusions (``fp8_excluded``);
3. ``qkrope export --quant fp8`` writes Q/DQ with the family's fused nodes kept, as many as the
   float export has;
4. ``qkrope check`` compares it with ModelOpt's fake-quant model at the family's default check
   sizes (qkrope.apps.check_fp8: weights bit for bit, every activation quantizer, end to end
   within the float bound derived there), and must pass;
5. an FP8 export of the first block alone (``--layers 1``, where the record has blocks) passes
   the same check, its later blocks passed through in the reference.
"""

from __future__ import annotations

import contextlib
import io

import pytest

# Every family quantised, exported and checked:
# a heavy matrix, run in the slow step (`bash scripts/test.sh -m slow`)
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch", reason="requires torch (pip install -e '.[test]')")
pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
pytest.importorskip("onnxruntime", reason="requires onnxruntime (pip install -e '.[test]')")
pytest.importorskip("modelopt.torch.quantization",
                    reason="requires nvidia-modelopt (pip install -e '.[test]' or '.[fp8]')")

# the representatives; a clone family (smoke=True) runs the smoke test (tests/test_families.py)
from _families import FULL_PARAMS, SMOKE_PARAMS  # noqa: E402
from _input_forms import FORMS  # noqa: E402

from qkrope.cli import main  # noqa: E402
from qkrope.sidecars import ModelInfo  # noqa: E402

CALLS = 2  # calibration calls recorded, each of its own random inputs
#: clones whose quantised graph differs from their representative's: HunyuanVideo's single-stream
#: blocks (HunyuanVideo-1.5 has none) split their joined sequence before the quantised output
#: Linears; FramePack puts its history tokens before the latent's, and the output layer reads the
#: latent's rows sliced after them (a slice torch.export once gave an unbacked length that
#: ModelOpt's quantizers guard on)
FP8_CLONES = {"hunyuan-video", "hunyuan-video-framepack"}
PARAMS = FULL_PARAMS + [p for p in SMOKE_PARAMS if p.id in FP8_CLONES]


def _run(argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue() + err.getvalue()


@pytest.fixture(scope="module", params=PARAMS)
def quantised(request, tmp_path_factory, tiny_root):
    """(builder, float export, the quantised folder) of one family: the saved model and its
    float export are the session's (only read here), the calibration and the quantised folder
    this module's."""
    from qkrope.export import quantize
    from qkrope.export.patch_diffusers import load_transformer

    builder = request.param
    root = tmp_path_factory.mktemp(f"fp8-{builder.variant}")
    folder = builder.saved(tiny_root)
    flt = builder.exported(tiny_root)
    model = load_transformer(str(folder))
    with quantize.CalibrationRecorder(model) as rec, torch.no_grad():
        for seed in range(CALLS):
            kwargs = FORMS[builder.family](model, 1, torch.Generator().manual_seed(seed))["base"]
            model(**kwargs)
    assert len(rec.batches) == CALLS
    rec.save(root / "calib.pt")
    qdir = root / "fp8"
    rc, text = _run(["quantize", "--diffusers", str(folder), "--calibration",
                     str(root / "calib.pt"), "--out", str(qdir), "--device", "cpu"])
    assert rc == 0, text
    return builder, flt, qdir


def test_fp8_export_keeps_the_nodes_and_the_exclusions(quantised, tmp_path):
    from qkrope.runtime.onnx_file import count_plugin_nodes

    builder, flt, qdir = quantised
    out = tmp_path / "fp8.onnx"
    rc, text = _run(["export", "--model", "transformer", "--diffusers", str(qdir), "--quant",
                     "fp8", "--dtype", "fp32", "--out", str(out)])
    assert rc == 0, text
    info = ModelInfo.load(out)
    assert info.config.family == builder.family
    record = info.config.quantization
    assert record["mode"] == "fp8"
    linears = record["quantized_linears"]
    excluded = builder.record.fp8_excluded
    assert linears, "no Linear was quantised"
    assert not [n for n in linears if n.split(".")[0] in excluded], excluded
    # every fused node of the float export is there (Q/DQ goes around the Linears only)
    assert len(list(count_plugin_nodes(out))) == len(list(count_plugin_nodes(flt)))
    rc, text = _run(["check", str(out)])
    assert rc == 0 and "PASSED" in text, text
    assert "0 elements differ from ModelOpt's fake-quantised weights" in text, text


def test_fp8_export_of_the_first_block_is_checked_with_the_rest_passed_through(quantised,
                                                                             tmp_path):
    builder, _, qdir = quantised
    if not builder.record.blocks:
        pytest.skip(f"{builder.family}'s record has no blocks (no --layers)")
    out = tmp_path / "fp8-l1.onnx"
    # the first block the output layer reads (1 but where leading blocks feed only later ones)
    least = builder.record.least_layers(builder.build(0).config)
    rc, text = _run(["export", "--model", "transformer", "--diffusers", str(qdir), "--quant",
                     "fp8", "--dtype", "fp32", "--layers", str(least), "--out", str(out)])
    assert rc == 0, text
    assert ModelInfo.load(out).config.num_layers_exported == least
    rc, text = _run(["check", str(out)])
    assert rc == 0 and "PASSED" in text, text
