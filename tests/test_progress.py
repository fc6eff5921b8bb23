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


def test_heartbeat_lines_while_a_long_step_runs():
    import time

    out = io.StringIO()
    with Steps("qkrope x", 1, stream=out, tty=False, heartbeat=0.05) as steps:
        with steps.step("optimising"):
            time.sleep(0.3)
    lines = out.getvalue().splitlines()
    assert lines[0] == "qkrope x: [1/1] optimising"
    beat = r"qkrope x:   \[1/1\] still running, \d+ s"
    beats = [ln for ln in lines[1:] if re.fullmatch(beat, ln)]
    assert beats and len(beats) == len(lines) - 1, lines
    assert_numbered_once(out.getvalue(), "qkrope x")  # the heartbeats are no numbered steps
    time.sleep(0.15)  # stopped with its step: nothing more is printed
    assert out.getvalue().splitlines() == lines


def test_byte_counter_prints_a_line_per_gib_off_a_terminal():
    out = io.StringIO()
    gib = 2**30
    with Steps("qkrope x", 1, stream=out, tty=False, heartbeat=0, clock=lambda: 0.0) as steps:
        with steps.step("writing"), steps.counter("written", total=3 * gib, unit="B",
                                                  every=gib) as bar:
            for _ in range(6):
                bar.update(gib // 2)
    lines = out.getvalue().splitlines()
    assert lines[1:4] == [f"qkrope x:   written: {k}.00 GiB of 3.00 GiB "
                          f"({round(100 * k / 3)}%), 0 s" for k in (1, 2, 3)]
    assert lines[4] == "qkrope x:   written: 3.00 GiB in 0 s" and len(lines) == 5


def test_duration():
    from qkrope._progress import duration

    assert [duration(s) for s in (0.4, 59, 65, 3725)] == ["0 s", "59 s", "1 min 05 s",
                                                          "1 h 02 min"]


@pytest.mark.parametrize("external", [False, True])
def test_export_hashes_while_writing(tmp_path, monkeypatch, external):
    """The sidecar's sha256 of every file it records is the file's, and the files the export
    wrote (the single file, or the external data) are not read back to hash them. Every
    initializer is a lazy tensor here (KEEP_BYTES 0), each read from the weights once while it
    is written (hashing reads no tensor twice)."""
    import hashlib
    import json

    from qkrope import file_record
    from qkrope.export import onnx_export, save, streaming

    hashed: list[str] = []
    real = file_record.sha256_file
    monkeypatch.setattr(file_record, "sha256_file", lambda p: hashed.append(str(p)) or real(p))
    monkeypatch.setattr(streaming, "KEEP_BYTES", 0)
    if external:
        monkeypatch.setattr(save, "EXTERNAL_DATA_THRESHOLD", 0)
    import onnx_ir

    reads, saving = {}, []  # reads while onnx_ir.save writes (the optimiser reads some before)

    class Counting(streaming.TensorSource):
        def tensor(self, key):
            if saving:
                reads[key] = reads.get(key, 0) + 1
            return super().tensor(key)

    real_save = onnx_ir.save

    def save(*args, **kwargs):
        saving.append(1)
        try:
            return real_save(*args, **kwargs)
        finally:
            saving.clear()

    monkeypatch.setattr(streaming, "TensorSource", Counting)
    monkeypatch.setattr(onnx_ir, "save", save)
    out = tmp_path / "a.onnx"
    onnx_export.export_attention(out, heads=2, head_dim=16, progress=False)
    side = json.loads((tmp_path / "a.onnx.json").read_text())
    files = {"a.onnx": side["model_sha256"],
             **{loc: rec["sha256"] for loc, rec in side["external_data"].items()}}
    assert ("a.onnx.data" in files) == external
    for name, sha in files.items():
        assert sha == hashlib.sha256((tmp_path / name).read_bytes()).hexdigest(), name
    big = "a.onnx.data" if external else "a.onnx"
    assert not [p for p in hashed if p.endswith(big)], hashed
    assert reads and set(reads.values()) == {1}, reads
