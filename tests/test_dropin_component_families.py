"""The drop-in component's behaviours on every family (issue 36 item 5): each family's drop-in
inherits them from runtime/component.py, so each must save itself and load back through the
class diffusers' pipeline loader resolves, honour ``.to()`` within what its export fixes and
refuse the rest, and refuse or honour diffusers' model hooks, all in one line.

tests/test_dropin_component.py runs these through whole pipelines of Qwen-Image, FLUX.1 and
FLUX.2; here every family's tiny model (tests/_families.py) is exported in fp32, loaded with
``load_transformer`` (ONNX Runtime, CPU) and called with its pipelines' own input form
(tests/_input_forms.py). A reloaded component runs the same file in the same runtime on the
same inputs, so its output must be the same bits.
"""

from __future__ import annotations

import filecmp
import json

import pytest

# Every family's drop-in saved, reloaded and moved:
# a heavy matrix, run in the slow step (`bash scripts/test.sh -m slow`)
pytestmark = pytest.mark.slow
import torch

diffusers = pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
pytest.importorskip("onnxruntime", reason="requires onnxruntime (pip install -e '.[test]')")

# the representatives; a clone family (smoke=True) runs the smoke test (tests/test_families.py)
from _families import FULL_PARAMS  # noqa: E402
from _input_forms import FORMS  # noqa: E402

import qkrope.runtime  # noqa: E402
from qkrope.runtime import load_transformer  # noqa: E402
from qkrope.runtime.component import COMPONENT_FILE, ComponentError, DropinComponent  # noqa: E402


@pytest.fixture(scope="module", params=FULL_PARAMS)
def family(request, tiny_root):
    """(builder, exported fp32 file, the pipelines' input form at batch 1) of one family: the
    session's export (the tests save the drop-in elsewhere and only read the export)."""
    builder = request.param
    out = builder.exported(tiny_root)
    base = FORMS[builder.family](builder.build(0), 1, torch.Generator().manual_seed(1))["base"]
    return builder, out, base


def _out(result) -> torch.Tensor:
    out = result[0] if isinstance(result, tuple) else result.sample
    if isinstance(out, list):  # a list of per-sample outputs (Z-Image)
        out = torch.stack(out)
    return out.detach()


def _one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text, text
    return text


def test_saves_itself_and_loads_back_as_the_pipeline_loader_does(family, tmp_path):
    builder, onnx_file, base = family
    t = load_transformer(onnx_file)
    assert isinstance(t, DropinComponent) and isinstance(t, diffusers.ModelMixin)
    with torch.no_grad():
        before = _out(t(**base))
    t.save_pretrained(tmp_path / "transformer")

    record = json.loads((tmp_path / "transformer" / COMPONENT_FILE).read_text())
    assert record["class"] == type(t).__name__ and record["model"] == onnx_file.name
    for name in record["files"]:  # the export's files, byte for byte
        assert filecmp.cmp(onnx_file.parent / name, tmp_path / "transformer" / name,
                           shallow=False)
    # model_index.json names ["qkrope.runtime", <class>]: diffusers resolves it there
    cls = getattr(qkrope.runtime, record["class"])
    assert cls is type(t)
    again = cls.from_pretrained(tmp_path / "transformer")
    assert type(again) is type(t) and again.config == t.config
    with torch.no_grad():
        assert torch.equal(_out(again(**base)), before), builder.family


def test_to_honours_the_device_and_the_export_dtype_and_refuses_the_rest(family):
    _, onnx_file, _ = family
    t = load_transformer(onnx_file)
    assert t.to("cpu") is t and t.to(torch.float32) is t and t.float() is t
    assert t.dtype == torch.float32 and t.device == torch.device("cpu")
    assert list(t.parameters()) == []
    for call in (lambda: t.to(torch.float16), lambda: t.bfloat16()):
        with pytest.raises(ComponentError, match="computes in torch.float32, fixed at export") as exc:
            call()
        _one_line(exc)
    assert t.dtype == torch.float32


def test_model_hooks_are_refused_in_one_line_or_change_nothing(family):
    _, onnx_file, base = family
    t = load_transformer(onnx_file)
    with torch.no_grad():
        before = _out(t(**base))
    refused = {
        "cache": lambda: t.enable_cache(diffusers.FirstBlockCacheConfig(threshold=0.2)),
        "layerwise casting": lambda: t.enable_layerwise_casting(),
        "group offload": lambda: t.enable_group_offload(onload_device=torch.device("cpu")),
        "attention processor": lambda: t.set_attn_processor(
            diffusers.models.attention_processor.AttnProcessor()),
    }
    for what, call in refused.items():
        with pytest.raises(ComponentError) as exc:
            call()
        assert _one_line(exc), what
    assert not t.is_cache_enabled
    assert t.attn_processors == {}
    t.fuse_qkv_projections()
    t.set_default_attn_processor()
    with torch.no_grad():
        assert torch.equal(_out(t(**base)), before)


def test_each_tensor_argument_left_out_is_one_line_with_the_fix(family):
    """Every tensor argument of the pipelines' call, given as None in turn: the call either
    runs (an optional input) or is refused in one line (an InputError, no traceback) that names
    the argument and says the fix (issue 34 class 7 on every family's drop-in)."""
    from qkrope.errors import QkropeError

    _, onnx_file, base = family
    t = load_transformer(onnx_file)
    tensors = [k for k, v in base.items() if isinstance(v, torch.Tensor)]
    assert tensors
    for name in tensors:
        try:
            t(**dict(base, **{name: None}))
        except QkropeError as exc:
            text = str(exc)
            assert "\n" not in text and name in text and "Fix:" in text, (name, text)
