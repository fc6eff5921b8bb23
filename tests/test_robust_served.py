"""Issue 34, class 8: triton-repo's hard link is a documented trade-off that the command states;
--copy copies instead; and where qkrope itself loads a served file (the loaders, `qkrope check`
on the repository's model) a file that no longer matches its record is refused: the repository
keeps a copy of the sidecar beside the served file."""

from __future__ import annotations

import os
import re
from pathlib import Path

import onnx
import pytest

from qkrope.cli import main
from qkrope.sidecars import ModelInfo, ModelInfoError

pytest.importorskip("google.protobuf", reason="triton-repo renders configs with protobuf")
pytest.importorskip("tritonclient.grpc", reason="triton-repo needs tritonclient's model_config_pb2")


@pytest.fixture
def exported(tmp_path):
    out = tmp_path / "src" / "attn.onnx"
    assert main(["export", "--model", "attention", "--out", str(out)]) == 0
    return out


def _repo(exported: Path, tmp_path: Path, capsys, *extra) -> tuple[Path, str]:
    repo = tmp_path / "repo"
    assert main(["triton-repo", "--backend", "onnxruntime", "--onnx", str(exported), "-o",
                 str(repo), "--name", "attn", *extra]) == 0
    return repo / "attn" / "1" / "model.onnx", capsys.readouterr().out


def _rewrite_in_place(path: Path) -> None:
    """onnx.save over the source: the same inode, new content (what a hard link shares)."""
    ino = os.stat(path).st_ino
    model = onnx.load(str(path))
    model.doc_string = "edited in place"
    onnx.save(model, str(path))
    assert os.stat(path).st_ino == ino


def test_the_hard_link_is_said_and_a_rewritten_source_is_refused_where_served(
        exported, tmp_path, capsys):
    served, out = _repo(exported, tmp_path, capsys)
    assert "hard-linked" in out and "--copy" in out and "in place" in out
    assert os.stat(served).st_ino == os.stat(exported).st_ino
    assert Path(str(served) + ".json").is_file()
    ModelInfo.load(served)  # the served file matches its record
    _rewrite_in_place(exported)
    with pytest.raises(ModelInfoError, match="does not describe this model"):
        ModelInfo.load(served)
    rc = main(["check", str(served), "--workdir", str(tmp_path / "w")])
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines()
             if not re.match(r"qkrope \w+: \[\d+/\d+\]", ln)]
    assert rc == 2 and "Traceback" not in err and len(lines) == 1 and str(served) in lines[0]


def test_copy_copies_and_the_served_model_survives_a_rewritten_source(exported, tmp_path,
                                                                      capsys):
    served, out = _repo(exported, tmp_path, capsys, "--copy")
    assert "copied" in out and "hard link shares" not in out
    assert os.stat(served).st_ino != os.stat(exported).st_ino
    _rewrite_in_place(exported)
    assert ModelInfo.load(served).write_id is not None  # still the model it was made from


def test_the_note_is_in_the_help_and_the_readme():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    assert "`--copy` copies instead" in readme
    from qkrope.runtime import triton

    assert "--copy" in triton.HARD_LINK_NOTE
