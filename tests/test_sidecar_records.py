"""The check on load at a cost that does not grow with the weights (qkrope.file_record): a pair
whose stat records match loads without hashing anything; a swapped, replaced or edited file is
refused (by its stat record and then its hash); an in-place edit whose mtime was put back passes
the stat check (documented) and is refused by the full hash (`qkrope check`, QKROPE_VERIFY=full);
a pair from two writers is refused by its write id; a copied folder is hashed once, accepted and
its records refreshed; `qkrope triton-repo` hard-links the engine on one filesystem and copies it
across filesystems (os.link raising EXDEV)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
from _tiny_model import move_weights_out, sidecar_dict, write_tiny_onnx

from qkrope import file_record
from qkrope.sidecars import (METADATA_PREFIX, WRITE_ID_SEPARATOR, EngineInfo, EngineInfoError,
                             ModelInfo, ModelInfoError, PluginRecord, config_tag,
                             engine_network_name,
                             engine_sidecar_path,
                             sidecar_path)

WID_A, WID_B = "a" * 16, "b" * 16


def _write_model(path: Path, write_id: str = WID_A, fill: float = 1.0) -> Path:
    """The tiny model with its weight as external data ``<name>.data``, the write id in its
    metadata_props, and its sidecar written by ModelInfo.save (the exporter's writer)."""
    import onnx

    write_tiny_onnx(path, sidecar=False)
    move_weights_out(path, path.name + ".data")
    model = onnx.load(str(path), load_external_data=False)
    model.metadata_props.add(key=METADATA_PREFIX + "write_id", value=write_id)
    onnx.save(model, str(path))
    data = path.parent / (path.name + ".data")
    import numpy as np

    data.write_bytes(np.full(16, fill, np.float32).tobytes())
    info = ModelInfo.from_dict(sidecar_dict())
    info.write_id = write_id
    info.save(path)
    return data


def _forbid_hashing(monkeypatch) -> None:
    """From now on any hash of a file fails the test (file_record.verify and FileRecord.of hash
    through sha256_file)."""
    def refuse(path):
        raise AssertionError(f"{path} was hashed")

    monkeypatch.setattr(file_record, "sha256_file", refuse)


def _replace_same_size(path: Path, content: bytes) -> None:
    """Another file of the same size moved over ``path`` (a new inode), as mv/cp+rename do."""
    assert len(content) == path.stat().st_size
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(content)
    os.replace(tmp, path)


def _edit_in_place_keep_mtime(path: Path, offset: int = 0) -> None:
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns, path.stat().st_ino) == (
        st.st_size, st.st_mtime_ns, st.st_ino)


def test_sidecar_records_every_file(tmp_path):
    onnx_path = tmp_path / "m.onnx"
    data = _write_model(onnx_path)
    side = json.loads(sidecar_path(onnx_path).read_text())
    assert side["write_id"] == WID_A and side["format_version"] == 2
    assert side["model_file"] == file_record.FileRecord.of(onnx_path).to_dict()
    assert side["model_file"]["sha256"] == side["model_sha256"]
    assert side["external_data"] == {data.name: file_record.FileRecord.of(data).to_dict()}


def test_a_matching_pair_loads_without_reading_the_files(tmp_path, monkeypatch):
    onnx_path = tmp_path / "m.onnx"
    _write_model(onnx_path)
    seen = []
    real_open = open

    def counting_open(file, mode="r", *a, **k):
        seen.append((str(file), mode))
        return real_open(file, mode, *a, **k)

    _forbid_hashing(monkeypatch)
    monkeypatch.setattr("builtins.open", counting_open)
    info = ModelInfo.load(onnx_path)
    assert info.verified == "stat"
    # the data file is never opened; the graph file only by the metadata walk (field by field,
    # the graph skipped by length)
    assert not [f for f, _m in seen if f.endswith(".data")], seen


def test_a_replaced_data_file_is_refused(tmp_path):
    onnx_path = tmp_path / "m.onnx"
    data = _write_model(onnx_path)
    _replace_same_size(data, b"\x00" * data.stat().st_size)
    with pytest.raises(ModelInfoError, match="does not describe"):
        ModelInfo.load(onnx_path)


def test_a_replaced_model_file_is_refused(tmp_path):
    """Another write's graph file (same size: only its write id differs) moved over the model."""
    a, b = tmp_path / "a" / "m.onnx", tmp_path / "b" / "m.onnx"
    a.parent.mkdir(), b.parent.mkdir()
    _write_model(a, WID_A)
    _write_model(b, WID_B)
    _replace_same_size(a, b.read_bytes())
    with pytest.raises(ModelInfoError, match="does not describe this model"):
        ModelInfo.load(a)


def test_an_in_place_edit_with_its_mtime_restored(tmp_path):
    """What the stat check cannot see (documented in qkrope.file_record and docs/spec.md): the
    load accepts it; the full hash (`qkrope check`, QKROPE_VERIFY=full) refuses it."""
    onnx_path = tmp_path / "m.onnx"
    data = _write_model(onnx_path)
    _edit_in_place_keep_mtime(data)
    assert ModelInfo.load(onnx_path).verified == "stat"
    with pytest.raises(ModelInfoError, match="does not describe"):
        ModelInfo.load(onnx_path, full=True)
    with pytest.MonkeyPatch.context() as m:
        m.setenv(file_record.VERIFY_ENV, "full")
        with pytest.raises(ModelInfoError, match="does not describe"):
            ModelInfo.load(onnx_path)


def test_an_in_place_edit_is_refused(tmp_path):
    onnx_path = tmp_path / "m.onnx"
    data = _write_model(onnx_path)
    st = data.stat()
    with open(data, "r+b") as f:
        f.write(b"\x7f")
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a later mtime
    with pytest.raises(ModelInfoError, match="does not describe"):
        ModelInfo.load(onnx_path)


def test_a_pair_from_two_writers_is_refused_even_when_the_stat_matches(tmp_path):
    """Another write's model written into this model's inode, size and mtime restored (what
    the stat record cannot tell apart): the write id in its metadata is not the sidecar's."""
    a, b = tmp_path / "a" / "m.onnx", tmp_path / "b" / "m.onnx"
    a.parent.mkdir(), b.parent.mkdir()
    _write_model(a, WID_A)
    _write_model(b, WID_B)
    st = a.stat()
    a.write_bytes(b.read_bytes())  # cp over: same inode, same size
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ModelInfoError, match="two different writes") as exc:
        ModelInfo.load(a)
    assert WID_A in str(exc.value) and WID_B in str(exc.value)


def test_a_copied_folder_is_hashed_once_then_fast(tmp_path, monkeypatch):
    """cp -r (new inodes, new mtimes) or rsync -a (new inodes): the stat records fail, the hash
    matches, the load accepts it and refreshes the records, so the next load reads nothing."""
    src = tmp_path / "src" / "m.onnx"
    src.parent.mkdir()
    _write_model(src)
    dst = tmp_path / "dst"
    shutil.copytree(src.parent, dst)
    first = ModelInfo.load(dst / "m.onnx")
    assert first.verified == "sha256"
    side = json.loads(sidecar_path(dst / "m.onnx").read_text())
    assert side["model_file"]["ino"] == (dst / "m.onnx").stat().st_ino

    _forbid_hashing(monkeypatch)
    assert ModelInfo.load(dst / "m.onnx").verified == "stat"
    assert ModelInfo.load(src).verified == "stat"  # the source's own records untouched


def test_an_older_sidecar_without_records_is_hashed(tmp_path):
    onnx_path = tmp_path / "m.onnx"
    _write_model(onnx_path)
    side = json.loads(sidecar_path(onnx_path).read_text())
    for key in ("model_file", "external_data", "write_id"):
        del side[key]
    sidecar_path(onnx_path).write_text(json.dumps(side))
    info = ModelInfo.load(onnx_path)
    assert info.verified == "sha256" and info.model_file is not None  # refreshed
    bad = dict(side, model_sha256="0" * 64)
    sidecar_path(onnx_path).write_text(json.dumps(bad))
    with pytest.raises(ModelInfoError, match="does not describe"):
        ModelInfo.load(onnx_path)


# --------------------------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------------------------

def _engine_info(write_id=WID_A) -> EngineInfo:
    t = {"name": "x", "dtype": "float32", "shape": [-1, 4]}
    return EngineInfo.from_dict({
        "format": "qkrope-engine", "format_version": 2, "tensorrt_version": "10.14.1",
        "onnx": "/m.onnx", "inputs": [t], "outputs": [dict(t, name="y")], "profiles": [],
        "plugin": None, "plugin_layers": 0, "version_compatible": False,
        "strongly_typed": False, "parser_flags": [], "config": {"dim": 4},
        "dynamic_axes": {}, "sample": {},
        "write_id": write_id})


def _write_engine(path: Path, content: bytes = b"PLAN" * 64, write_id=WID_A) -> EngineInfo:
    """An engine pair as ``qkrope build`` writes it: the sidecar records the network name the
    engine was built with (its facts tag and write id) and the engine's stat record."""
    path.write_bytes(content)
    info = _engine_info(write_id)
    info.network_name = engine_network_name(info)
    info.save(path)
    return info


def test_engine_loads_by_its_stat_record(tmp_path, monkeypatch):
    eng = tmp_path / "m.engine"
    _write_engine(eng)
    _forbid_hashing(monkeypatch)
    assert EngineInfo.load(eng).verified == "stat"


def test_engine_swapped_or_edited_is_refused(tmp_path):
    eng = tmp_path / "m.engine"
    _write_engine(eng)
    _replace_same_size(eng, b"PLAM" * 64)
    with pytest.raises(EngineInfoError, match="does not describe this engine"):
        EngineInfo.load(eng)
    _write_engine(eng)
    _edit_in_place_keep_mtime(eng, 5)
    assert EngineInfo.load(eng).verified == "stat"  # the documented gap
    with pytest.raises(EngineInfoError, match="does not describe this engine"):
        EngineInfo.load(eng, full=True)


def test_engine_name_carries_the_write_id(tmp_path):
    info = _engine_info(WID_A)
    tag = config_tag(info.config)
    info.check_engine_name(tag + WRITE_ID_SEPARATOR + WID_A, "m.engine")
    info.check_engine_name(tag, "m.engine")  # an engine built before write ids
    with pytest.raises(EngineInfoError, match="two different writes"):
        info.check_engine_name(tag + WRITE_ID_SEPARATOR + WID_B, "m.engine")


# --------------------------------------------------------------------------------------------
# qkrope triton-repo: a copy by default; --link: a hard link on one filesystem, a copy across
# --------------------------------------------------------------------------------------------

def _plugin_engine(tmp_path: Path) -> tuple[Path, Path]:
    import hashlib

    lib = tmp_path / "libqkrope_plugin.so"
    lib.write_bytes(b"\x7fELF fake plugin")
    eng = tmp_path / "attn.engine"
    eng.write_bytes(b"PLAN" * 64)
    info = _engine_info()
    info.plugin = PluginRecord(str(lib), hashlib.sha256(lib.read_bytes()).hexdigest(), False)
    info.network_name = engine_network_name(info)  # as qkrope build names it, plugin included
    info.save(eng)
    assert info.engine_file is not None
    return eng, lib


@pytest.mark.parametrize("link,cross_device", [(False, False), (True, False), (True, True)],
                         ids=["default", "link-same-fs", "link-exdev"])
def test_triton_repo_copies_or_links_the_engine(tmp_path, monkeypatch, capsys, link,
                                                 cross_device):
    from qkrope.cli import main

    eng, lib = _plugin_engine(tmp_path)
    if cross_device:
        def no_link(src, dst, *a, **k):
            raise OSError(errno.EXDEV, "Invalid cross-device link", str(src))

        monkeypatch.setattr(os, "link", no_link)
    repo = tmp_path / "repo"
    assert main(["triton-repo", "--engine", str(eng), "--plugin", str(lib), "-o",
                 str(repo), *(["--link"] if link else [])]) == 0
    out = capsys.readouterr().out
    plan = repo / "attn" / "1" / "model.plan"
    assert plan.read_bytes() == eng.read_bytes()
    if link and not cross_device:
        assert "the engine: hard-linked (--link" in out and os.path.samefile(plan, eng)
    else:
        assert ("the engine: copied" in out or "the engine: cloned" in out), out
        assert not os.path.samefile(plan, eng)
        assert ("--link asked for a hard link" in out) is link
    # the engine still loads by its stat record (the link left size, mtime, inode as they were)
    assert EngineInfo.load(eng).verified == "stat"


def test_triton_repo_other_link_errors_are_not_hidden(tmp_path, monkeypatch):
    from qkrope import _fileio as fileio
    from qkrope._fileio import OutputWriteError
    from qkrope.runtime import triton

    eng, lib = _plugin_engine(tmp_path)

    def full(src, dst, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(os, "link", full)
    with pytest.raises(OutputWriteError, match="No space left"):
        triton.write_repository(eng, tmp_path / "repo", plugin=lib, link=True)
    assert not (tmp_path / "repo" / "attn").exists()
    monkeypatch.setattr(shutil, "copyfile", full)  # the default copies: its errors show too
    monkeypatch.setattr(fileio, "FICLONE", -1)  # (no clone either: an invalid request)
    with pytest.raises(OutputWriteError, match="No space left"):
        triton.write_repository(eng, tmp_path / "repo", plugin=lib)
    assert not (tmp_path / "repo" / "attn").exists()


def test_cp_p_of_another_export_over_the_data_file_is_refused(tmp_path):
    """``cp -p other.data m.onnx.data``: written in place (same inode, same size) with the other
    file's mtime, which is not the recorded one: hashed, refused."""
    a, b = tmp_path / "a" / "m.onnx", tmp_path / "b" / "m.onnx"
    a.parent.mkdir(), b.parent.mkdir()
    data_a = _write_model(a, WID_A, fill=1.0)
    data_b = _write_model(b, WID_A, fill=2.0)
    ino = data_a.stat().st_ino
    shutil.copy2(data_b, data_a)
    assert data_a.stat().st_ino == ino and data_a.stat().st_size == data_b.stat().st_size
    with pytest.raises(ModelInfoError, match="does not describe this model's external data"):
        ModelInfo.load(a)


@pytest.mark.parametrize("link,cross_device", [(False, False), (True, False), (True, True)],
                         ids=["default", "link-same-fs", "link-exdev"])
def test_triton_onnx_repo_copies_or_links_the_model_and_data(tmp_path, monkeypatch, capsys,
                                                             link, cross_device):
    from qkrope.cli import main

    onnx_path = tmp_path / "m.onnx"
    data = _write_model(onnx_path)
    if cross_device:
        def no_link(src, dst, *a, **k):
            raise OSError(errno.EXDEV, "Invalid cross-device link", str(src))

        monkeypatch.setattr(os, "link", no_link)
    repo = tmp_path / "repo"
    assert main(["triton-repo", "--backend", "onnxruntime", "--onnx", str(onnx_path), "-o",
                 str(repo), *(["--link"] if link else [])]) == 0
    out = capsys.readouterr().out
    copied = repo / "m" / "1" / data.name
    assert copied.read_bytes() == data.read_bytes()
    shared = link and not cross_device
    assert os.path.samefile(copied, data) is shared
    assert os.path.samefile(repo / "m" / "1" / "model.onnx", onnx_path) is shared
    if shared:
        assert "the model and its data: hard-linked" in out, out
    else:
        assert ("the model and its data: copied" in out
                or "the model and its data: cloned" in out), out


def test_the_refresh_never_waits_for_a_writer(tmp_path):
    """A copied pair is accepted by its hash; while the folder's commit lock is held (a writer
    committing, or this process itself around the load) its records are not rewritten, and the
    load does not wait."""
    import fcntl

    src = tmp_path / "src" / "m.onnx"
    src.parent.mkdir()
    _write_model(src)
    dst = tmp_path / "dst"
    shutil.copytree(src.parent, dst)
    before = sidecar_path(dst / "m.onnx").read_text()
    fd = os.open(dst, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert ModelInfo.load(dst / "m.onnx").verified == "sha256"
        assert sidecar_path(dst / "m.onnx").read_text() == before
    finally:
        os.close(fd)
    ModelInfo.load(dst / "m.onnx")  # unlocked: refreshed
    assert sidecar_path(dst / "m.onnx").read_text() != before
