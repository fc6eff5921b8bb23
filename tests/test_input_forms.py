"""Every input form a family's diffusers forward accepts, fed to the stock model and to the
drop-in (issue 36 item 4; the forms: tests/_input_forms.py, one entry per family).

Each family's tiny model (tests/_families.py) is exported in fp32 and loaded with
``load_transformer`` (ONNX Runtime). For every form listed as the same call as the pipelines'
form, the stock model's output must be the same bits as for the pipelines' form (so diffusers
reads the form that way: the test data is checked first), and the drop-in's output must be the
same bits as its own for the pipelines' form (the same graph on the same values: any other
reading of the form, such as several images where diffusers sees one per batch item, changes
the caches and the bits, or is refused). The forms diffusers reads wrongly for some batch items
are refused by the drop-in in one line with the fix.
"""

from __future__ import annotations

import pytest

# Every family's input forms through the stock model and the drop-in:
# a heavy matrix, run in the slow step (`bash scripts/test.sh -m slow`)
pytestmark = pytest.mark.slow
import torch

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
pytest.importorskip("onnxruntime", reason="requires onnxruntime (pip install -e '.[test]')")

from _families import BUILDERS, FULL_PARAMS  # noqa: E402
from _input_forms import FORMS  # noqa: E402

from qkrope import families  # noqa: E402
from qkrope.errors import InputError  # noqa: E402

BATCH = 2


def test_every_family_lists_its_input_forms():
    assert set(FORMS) == set(families.names())


def _out(result) -> torch.Tensor:
    out = result[0] if isinstance(result, tuple) else result.sample
    if isinstance(out, list):  # a list of per-sample outputs (Z-Image)
        out = torch.stack(out)
    return out.detach()


@pytest.mark.parametrize("builder", FULL_PARAMS)  # clones: the smoke test (test_families)
def test_every_input_form_means_what_it_means_to_diffusers(builder, tiny_root):
    from qkrope.runtime import load_transformer

    model = builder.build(0)
    dropin = load_transformer(builder.exported(tiny_root))  # the session's export
    forms = FORMS[builder.family](model, BATCH, torch.Generator().manual_seed(1))
    assert forms["same"], f"{builder.family}: no forms listed"
    with torch.no_grad():
        stock_base = _out(model(**forms["base"]))
        ours_base = _out(dropin(**forms["base"]))
        assert ours_base.shape == stock_base.shape
        for name, kwargs in forms["same"]:
            stock = _out(model(**kwargs))
            assert torch.equal(stock, stock_base), \
                f"{builder.family}: diffusers reads {name!r} differently (test data)"
            ours = _out(dropin(**kwargs))
            assert torch.equal(ours, ours_base), \
                f"{builder.family}: the drop-in reads {name!r} otherwise than diffusers"
        for name, kwargs in forms["refused"]:
            model(**kwargs)  # diffusers takes it (reading item 0 for every item)
            with pytest.raises(InputError) as err:
                dropin(**kwargs)
            message = str(err.value)
            assert "\n" not in message and "Fix:" in message, (name, message)
