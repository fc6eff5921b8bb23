"""``--layers`` / ``--blocks`` and the one-block-resident reference on every family whose record
lists its blocks (issue 35 item 1), over the tiny builders of ``tests/_families.py``:

- the streamed reference (:class:`qkrope.apps.check_blocks.StreamedTransformer`) is diffusers'
  own forward bit for bit, one block resident, and each block's outputs are what the stock
  model's block returns (forward hooks on the stock model), named by the record's
  ``BlockList.returns``;
- ``check --blocks`` of the whole export compares every block's outputs (the rows the record's
  block lists predict) and passes;
- ``export --layers 1`` keeps one block: its whole-model check and ``check --layers 1`` pass,
  and so does ``check --layers 1`` of the whole export.
"""

from __future__ import annotations

import pytest

# Every family's export and block checks:
# a heavy matrix, run in the slow step (`bash scripts/test.sh -m slow`)
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch", reason="requires torch (pip install -e '.[test]')")
pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
pytest.importorskip("onnxruntime", reason="requires onnxruntime (pip install -e '.[test]')")

# the representatives; a clone family (smoke=True) runs the smoke test (tests/test_families.py)
from _families import FULL_PARAMS  # noqa: E402
from _input_forms import FORMS  # noqa: E402

from qkrope.cli import main  # noqa: E402

BLOCKED = [p for p in FULL_PARAMS if p.values[0].record.blocks]


def _rows(text: str) -> list[str]:
    return [line.split()[2] for line in text.splitlines() if line.startswith("onnxrt")]


def _outputs(record) -> list[str]:
    """The model's own output rows: its graph's outputs (``sample``; ``latent_sample`` for a
    5-D latent)."""
    return [t.name for t in record.graph.outputs]


def _expected(record, config, layers=None) -> list[str]:
    """The block rows a check compares: each kept block's streams (BlockList.returns, image
    first), but the last block's text output where the model drops it (it is absent from the
    graph: the caller removes it when the graph has none)."""
    rows, kept = [], record.kept_blocks(config, layers)
    index = 0
    for blocks, count in zip(record.block_lists, kept):
        for _ in range(count):
            rows += [f"block{index}.{s}" for s in ("img", "txt", "joined") if s in blocks.returns]
            index += 1
    return rows


@pytest.fixture(scope="module", params=BLOCKED)
def family(request, tiny_root):
    """(builder, saved folder, whole fp32 export) of one family with blocks: the session's
    (the checks write into their --workdir, the --layers 1 export into the test's folder)."""
    builder = request.param
    return builder, builder.saved(tiny_root), builder.exported(tiny_root)


def test_streamed_reference_is_the_stock_forward_one_block_resident(family):
    from qkrope.apps.check_blocks import StreamedTransformer

    builder, folder, _ = family
    record = builder.record
    stock = builder.build(0).eval()
    kwargs = {**FORMS[builder.family](stock, 1, torch.Generator().manual_seed(1))["base"],
              "return_dict": False}
    captured, hooks = {}, []
    index = 0
    for blocks in record.block_lists:
        for block in stock.get_submodule(blocks.attr):
            def keep(module, args, output, i=index, returns=blocks.returns):
                values = output if isinstance(output, (tuple, list)) else (output,)
                captured[i] = dict(zip(returns, (v.detach().clone() for v in values)))
            hooks.append(block.register_forward_hook(keep))
            index += 1
    streamed = StreamedTransformer(folder, dtype=torch.float32, class_name=record.class_name)
    with torch.no_grad():
        want = stock(**kwargs)[0]
        got = streamed(**kwargs)[0]
    for h in hooks:
        h.remove()
    if isinstance(want, list):  # per-sample outputs (Z-Image)
        want, got = torch.stack(want), torch.stack(got)
    assert torch.equal(got, want)  # the same weights through the same forward: bit for bit
    assert sorted(streamed.block_outputs) == sorted(captured) == list(range(index))
    for i, streams in captured.items():
        assert streamed.block_outputs[i].keys() == streams.keys(), i
        for s, v in streams.items():
            assert torch.equal(streamed.block_outputs[i][s], v), (i, s)
    assert streamed.peak_block_elements == max(streamed.block_elements)  # one block at a time
    assert all(p.device.type == "meta" for _, b in streamed.blocks for p in b.parameters())


def test_check_blocks_compares_every_block(family, tmp_path, capsys):
    builder, folder, out = family
    config = builder.build(0).config
    assert main(["check", str(out), "--blocks", "--workdir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    rows = _rows(text)
    expected = _outputs(builder.record) + _expected(builder.record, config)
    last = expected[-1].split(".")[0] + ".txt"
    assert rows == [r for r in expected if r != last or r in rows], text
    assert "PASSED" in text


def test_layers_one(family, tmp_path, capsys):
    """``check --layers K`` of the whole export, ``export --layers K`` and both checks of it, K
    the fewest blocks an export can keep (1, or the first block the output layer reads where
    leading blocks feed only later ones: FamilyRecord.least_layers); an export of fewer is
    refused in one line."""
    from qkrope.sidecars import ModelInfo

    builder, folder, out = family
    config = builder.build(0).config
    k = builder.record.least_layers(config)
    first = _expected(builder.record, config, k)
    assert main(["check", str(out), "--layers", str(k), "--workdir", str(tmp_path / "a")]) == 0
    text = capsys.readouterr().out
    assert _rows(text) in (first, [r for r in first if not r.endswith(".txt")]), text
    one = tmp_path / "l1.onnx"
    if k > 1:
        assert main(["export", "--model", "transformer", "--diffusers", str(folder), "--dtype",
                     "fp32", "--layers", str(k - 1), "--out", str(one)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--layers {k} or more" in err[0] and not one.exists(), err
    assert main(["export", "--model", "transformer", "--diffusers", str(folder), "--dtype",
                 "fp32", "--layers", str(k), "--out", str(one)]) == 0
    capsys.readouterr()
    assert ModelInfo.load(one).config.num_layers_exported == k
    assert main(["check", str(one), "--workdir", str(tmp_path / "b")]) == 0
    assert _rows(capsys.readouterr().out) == _outputs(builder.record)
    assert main(["check", str(one), "--layers", str(k), "--workdir", str(tmp_path / "c")]) == 0
    text = capsys.readouterr().out
    assert _rows(text) in (first, [r for r in first if not r.endswith(".txt")]), text
