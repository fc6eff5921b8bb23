"""Issue 34, class 1: a SIGKILL between the two renames of a commit (the sidecar moved, the model
not) leaves a pair the readers refuse; the next writer in that folder finishes the commit from
the dead writer's journal, so the old export or the new one is loadable, never neither."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qkrope import _fileio

KILL_AFTER_FIRST_RENAME = textwrap.dedent("""
    import os, signal, sys
    from qkrope import _fileio

    def killing_commit(self, order, remove, backups, done):
        os.replace(self.dir / order[0], self.folder / order[0])   # the first rename only
        os.kill(os.getpid(), signal.SIGKILL)

    _fileio.Staging._commit = killing_commit
""")


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def test_next_writer_finishes_a_commit_killed_between_its_renames(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "m.side").write_bytes(b"old side\0")
    (folder / "m.model").write_bytes(b"old model\0")
    code = KILL_AFTER_FIRST_RENAME + textwrap.dedent(f"""
        with _fileio.staged_outputs({str(folder)!r}, ["m.side", "m.model"]) as st:
            st.path("m.side").write_bytes(b"new side\\0")
            st.path("m.model").write_bytes(b"new model\\0")
            st.commit(["m.side", "m.model"])
    """)
    r = _run(code, tmp_path)
    assert r.returncode == -9, r.stderr
    # the half state the kill leaves: the new first file beside the old second one
    assert (folder / "m.side").read_bytes() == b"new side\0"
    assert (folder / "m.model").read_bytes() == b"old model\0"
    with _fileio.staged_outputs(folder, ["other"]):  # the next writer in that folder
        pass
    assert (folder / "m.side").read_bytes() == b"new side\0"
    assert (folder / "m.model").read_bytes() == b"new model\0"
    assert not [p for p in folder.iterdir() if p.name.startswith(_fileio.STAGING_PREFIX)]


def test_a_finished_commit_leaves_no_journal(tmp_path):
    with _fileio.staged_outputs(tmp_path, ["a"]) as st:
        st.path("a").write_bytes(b"x")
        st.commit(["a"])
        assert not (st.dir / _fileio.COMMIT_JOURNAL).exists()
    assert (tmp_path / "a").read_bytes() == b"x"


def test_a_target_replaced_by_something_else_meanwhile_is_not_overwritten(tmp_path):
    """Between the kill and the next writer, someone put a text file where the model goes: the
    dead commit is not finished over it (the kinds it committed are checked again)."""
    folder = tmp_path / "out"
    folder.mkdir()
    code = KILL_AFTER_FIRST_RENAME + textwrap.dedent(f"""
        kinds = {{"m.onnx.json": _fileio.MODEL_SIDECAR, "m.onnx": _fileio.ONNX_MODEL}}
        with _fileio.staged_outputs({str(folder)!r}, list(kinds), kinds=kinds) as st:
            st.path("m.onnx.json").write_text('{{"format": "qkrope-onnx"}}')
            st.path("m.onnx").write_bytes(b"\\x08\\x07\\x12model")
            st.commit(["m.onnx.json", "m.onnx"])
    """)
    assert _run(code, tmp_path).returncode == -9
    (folder / "m.onnx").write_text("notes, not a model\n")
    with _fileio.staged_outputs(folder, ["other"]):
        pass
    assert (folder / "m.onnx").read_text() == "notes, not a model\n"


@pytest.mark.slow
def test_export_killed_between_its_renames_is_loadable_after_the_next_writer(tmp_path):
    """The real pair: an old export at m.onnx, a new export killed after its sidecar's rename
    (the readers refuse that half state), then the next writer in the folder: the pair loads
    (ModelInfo.load checks the model's sha256 and write id against the sidecar)."""
    pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
    from qkrope.apps import tiny_pipeline as tp
    from qkrope.cli import main
    from qkrope.sidecars import ModelInfo

    model = tmp_path / "tiny"
    tp.tiny_transformer().save_pretrained(str(model))
    out = tmp_path / "out" / "m.onnx"
    args = ["export", "--model", "transformer", "--diffusers", str(model), "--layers", "1",
            "--out", str(out)]
    assert main(args) == 0
    old = ModelInfo.load(out).write_id
    code = KILL_AFTER_FIRST_RENAME + textwrap.dedent(f"""
        from qkrope.cli import main
        main({args!r})
    """)
    r = _run(code, tmp_path)
    assert r.returncode == -9, r.stderr[-2000:]
    with pytest.raises(Exception):  # the half state: the new sidecar beside the old model
        ModelInfo.load(out)
    with _fileio.staged_outputs(out.parent, ["next"]):  # the next writer in that folder
        pass
    info = ModelInfo.load(out, full=True)
    assert info.write_id != old  # the new export, whole
