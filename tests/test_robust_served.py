"""Issue 34, class 8 and issue 42, item 3: what triton-repo serves is what was given. By default
the engine (or the ONNX model) goes in as an independent copy (a clone where the filesystem has
one), so an in-place rewrite of the source leaves the served model as it was; ``--link`` hard-
links instead, a trade-off the command states; and where qkrope itself loads a served file (the
loaders, `qkrope check` on the repository's model) a file that no longer matches its record is
refused: the repository keeps a copy of the sidecar beside the served file."""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import pytest

from _oneline import error_lines  # noqa: E402

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


def test_by_default_the_served_model_survives_a_rewritten_source(exported, tmp_path, capsys):
    """The default: the repository's model is its own file; onnx.save over the source (same
    inode, new bytes) leaves it byte for byte as it was, still matching its record."""
    before = exported.read_bytes()
    served, out = _repo(exported, tmp_path, capsys)
    assert ("the model and its data: copied" in out or "the model and its data: cloned" in out), out
    assert "leaves the served model as it is" in out and "hard link shares" not in out
    # a command that serves it without Docker (the tests' way), said too
    assert "python scripts/triton_server.py serve" in out and "--onnx-stand-in" in out
    assert not os.path.samefile(served, exported)
    _rewrite_in_place(exported)
    assert exported.read_bytes() != before
    assert served.read_bytes() == before  # not the edited weights
    assert ModelInfo.load(served).write_id is not None  # still the model it was made from


def test_copy_names_the_default(exported, tmp_path, capsys):
    served, out = _repo(exported, tmp_path, capsys, "--copy")
    assert "--link hard-links instead" in out and not os.path.samefile(served, exported)


def test_link_is_said_and_a_rewritten_source_is_refused_where_served(exported, tmp_path, capsys):
    """--link, the explicit option: the command says the link and its trade-off; an in-place
    rewrite of the source changes the served file, which qkrope's loaders then refuse."""
    served, out = _repo(exported, tmp_path, capsys, "--link")
    assert "hard-linked (--link" in out and "in place" in out and "leave out --link" in out
    assert os.stat(served).st_ino == os.stat(exported).st_ino
    assert Path(str(served) + ".json").is_file()
    ModelInfo.load(served)  # the served file matches its record
    _rewrite_in_place(exported)
    assert served.read_bytes() == exported.read_bytes()  # the link serves the edit
    with pytest.raises(ModelInfoError, match="does not describe this model"):
        ModelInfo.load(served)
    rc = main(["check", str(served), "--workdir", str(tmp_path / "w")])
    err = capsys.readouterr().err
    lines = error_lines(err)
    assert rc == 2 and "Traceback" not in err and len(lines) == 1 and str(served) in lines[0]


def test_copy_and_link_together_are_refused(exported, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["triton-repo", "--backend", "onnxruntime", "--onnx", str(exported), "-o",
              str(tmp_path / "repo"), "--copy", "--link"])
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    assert not (tmp_path / "repo").exists()


def test_the_note_is_in_the_help_and_the_readme(capsys):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    assert "`--link` hard-links instead" in readme
    from qkrope.runtime import triton

    assert "leave out --link" in triton.HARD_LINK_NOTE
    with pytest.raises(SystemExit):
        main(["triton-repo", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--link hard-link the engine" in help_text and "copy-on-write clone" in help_text


def _engine(tmp_path: Path) -> Path:
    """An engine file (its bytes stand for a plan built without the plugin: the loaders check
    the file against its sidecar's records before any TensorRT call) with a sidecar written by
    EngineInfo.save (stat record and sha256)."""
    from qkrope.sidecars import EngineInfo, EngineTensor

    eng = tmp_path / "src" / "attn.engine"
    eng.parent.mkdir(parents=True)
    eng.write_bytes(b"a serialised plan, as far as the sidecar is concerned " * 8)
    info = EngineInfo(tensorrt_version="10.14", onnx="/m.onnx",
                      inputs=[EngineTensor("x", "float32", [-1, 8], ["tokens", None])],
                      outputs=[EngineTensor("y", "float32", [-1, 8], ["tokens", None])],
                      profiles=[], plugin=None, plugin_layers=0, version_compatible=False,
                      strongly_typed=True)
    info.save(eng)
    return eng


def _rewrite_engine_in_place(path: Path) -> None:
    """A rebuild written over the source (same inode, other bytes, later mtime)."""
    ino = os.stat(path).st_ino
    data = path.read_bytes()
    with open(path, "r+b") as f:
        f.write(b"another plan" + data[len(b"another plan"):])
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert os.stat(path).st_ino == ino


def test_a_served_engine_is_its_own_file_and_with_link_a_rewrite_is_refused(tmp_path, capsys):
    """The served-engine case: by default the repository's plan is its own file, and a rebuild
    written in place over the source leaves it as it was; with --link the plan shares the
    source's inode, the rewrite changes it, and the sidecar the repository kept refuses it where
    qkrope loads it (EngineInfo.load: the loaders and the runtime), in one line naming it."""
    from qkrope.sidecars import EngineInfo, EngineInfoError

    eng = _engine(tmp_path)
    before = eng.read_bytes()
    repo = tmp_path / "repo"
    assert main(["triton-repo", "--engine", str(eng), "-o", str(repo), "--name", "attn"]) == 0
    out = capsys.readouterr().out
    served = repo / "attn" / "1" / "model.plan"
    assert "the engine: copied" in out or "the engine: cloned" in out, out
    assert not os.path.samefile(served, eng)
    _rewrite_engine_in_place(eng)
    assert served.read_bytes() == before
    assert EngineInfo.load(served).engine_sha256 is not None  # served as built: accepted
    # --link: the served plan is the source's inode
    eng2 = _engine(tmp_path / "b")
    repo2 = tmp_path / "repo2"
    assert main(["triton-repo", "--engine", str(eng2), "-o", str(repo2), "--name", "attn",
                 "--link"]) == 0
    out = capsys.readouterr().out
    served2 = repo2 / "attn" / "1" / "model.plan"
    assert "the engine: hard-linked (--link" in out and "leave out --link" in out
    assert os.stat(served2).st_ino == os.stat(eng2).st_ino
    EngineInfo.load(served2)
    _rewrite_engine_in_place(eng2)
    with pytest.raises(EngineInfoError, match="does not describe this engine") as err:
        EngineInfo.load(served2)
    assert "\n" not in str(err.value) and "qkrope build" in str(err.value)
