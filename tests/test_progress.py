"""Progress display (qkrope._progress.Steps): numbered step lines in a log, tqdm bars on a
terminal, nothing when disabled; an export announces every one of its steps exactly once."""

from __future__ import annotations

import io
import re

import pytest

from qkrope._progress import Steps


def assert_numbered_once(err: str, prefix: str) -> None:
    """The ``prefix: [k/N]`` step lines of a log are k = 1..N, each once, of one N."""
    numbered = re.findall(rf"^{re.escape(prefix)}: \[(\d+)/(\d+)\] ", err, flags=re.M)
    assert numbered, err
    total = int(numbered[0][1])
    assert [int(k) for k, _ in numbered] == list(range(1, total + 1)), numbered
    assert {int(n) for _, n in numbered} == {total}, numbered


def test_plain_lines_off_a_terminal():
    out = io.StringIO()
    with Steps("qkrope x", 2, stream=out, tty=False) as steps:
        with steps.step("first"):
            pass
        with steps.step("second"), steps.counter("tensors") as bar:
            bar.set_total(3)
            bar.update()
        steps.note("finished")
    assert out.getvalue().splitlines() == ["qkrope x: [1/2] first", "qkrope x: [2/2] second",
                                           "qkrope x: finished"]
    assert "\r" not in out.getvalue() and steps.done == 2


def test_tqdm_bars_on_a_terminal():
    out = io.StringIO()
    with Steps("qkrope x", 2, stream=out, tty=True) as steps:
        with steps.step("tracing"):
            pass
        with steps.step("writing"), steps.counter("tensors", unit="tensor") as bar:
            bar.set_total(4)
            for _ in range(4):
                bar.update()
    text = out.getvalue()
    assert "\r" in text  # redrawn in place
    assert "qkrope x: [1/2] tracing" in text and "qkrope x: [2/2] writing" in text
    assert "  tensors" in text  # the nested counter (tqdm throttles its redraws to 10/s)
    assert "qkrope x: 2 steps done" in text


def test_disabled_prints_nothing():
    out = io.StringIO()
    with Steps("qkrope x", 1, stream=out, tty=True, enabled=False) as steps:
        with steps.step("a"), steps.counter("b") as bar:
            bar.update()
        steps.note("c")
    assert out.getvalue() == ""


def test_a_failing_step_is_not_counted():
    out = io.StringIO()
    steps = Steps("qkrope x", 2, stream=out, tty=False)
    try:
        with steps.step("boom"):
            raise RuntimeError("x")
    except RuntimeError:
        pass
    steps.close(ok=False)
    assert steps.done == 0


def test_export_announces_each_step_once(tmp_path, capsys):
    from qkrope.export.onnx_export import export_attention

    export_attention(tmp_path / "a.onnx", heads=2, head_dim=16, progress=True)
    err = capsys.readouterr().err
    assert_numbered_once(err, "qkrope export")
    assert re.search(r"^qkrope export: wrote .*a\.onnx in [\d.]+ s$", err, flags=re.M)


def test_transformer_export_announces_each_step_once(tmp_path, capsys):
    pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
    from qkrope.apps import tiny_pipeline as tp
    from qkrope.export.onnx_export import export_transformer

    tp.save_transformer(tp.tiny_transformer(), tmp_path / "t")
    export_transformer(tmp_path / "t.onnx", tmp_path / "t", progress=True)
    err = capsys.readouterr().err
    assert_numbered_once(err, "qkrope export")
    assert re.search(r"^qkrope export: done in [\d.]+ s: ", err, flags=re.M)
