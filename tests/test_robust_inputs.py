"""Issue 34: what a command reads is an input, whatever its name (class 1); what is read is what
was checked (class 2: a shard re-saved between its header and its data is refused, nothing
written); hostile shards answer in one line (class 7: a symbolic link loop, a header whose byte
range disagrees with its shape and dtype)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

from _oneline import error_line  # noqa: E402

from qkrope import diffusers_weights as dw  # noqa: E402
from qkrope._fileio import OutputIsInputError  # noqa: E402
from qkrope.apps import tiny_pipeline as tp  # noqa: E402
from qkrope.cli import main  # noqa: E402

INDEX = "diffusion_pytorch_model.safetensors.index.json"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny Qwen-Image transformer in several shards with their index."""
    d = tmp_path_factory.mktemp("robust") / "tiny"
    tp.tiny_transformer().save_pretrained(str(d), max_shard_size="200KB")
    return d


@pytest.fixture
def folder(saved, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(saved, d)
    return d


def _shards(d: Path) -> list[str]:
    return sorted(set(json.loads((d / INDEX).read_text())["weight_map"].values()))


def _rename_shard(d: Path, old: str, new: str) -> None:
    """The index names the shard ``old`` ``new`` (any name a save could give it)."""
    os.rename(d / old, d / new)
    index = json.loads((d / INDEX).read_text())
    index["weight_map"] = {k: (new if v == old else v) for k, v in index["weight_map"].items()}
    (d / INDEX).write_text(json.dumps(index))


def _one_line_error(capsys) -> str:
    """stderr without the progress lines ("qkrope export: [1/6] ...") and the dtype line
    ("qkrope export: dtype fp32: ... the checkpoint's dtype") is one line, no traceback."""
    return error_line(capsys)


# ---------------------------------------------------------------------------------------------
# Class 1: an output is never an input, whatever names it
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("written", ["m.onnx", "m.onnx.data", "m.onnx.json"])
def test_export_refuses_an_output_that_is_a_shard_the_index_names(folder, capsys, written):
    """The index names a shard m.onnx (or the export's data file / sidecar name): exporting to
    DIR/m.onnx would overwrite that input. Refused before any work, the shard untouched."""
    first = _shards(folder)[0]
    _rename_shard(folder, first, written)
    before = (folder / written).read_bytes()
    rc = main(["export", "--model", "transformer", "--diffusers", str(folder), "--layers", "1",
               "--out", str(folder / "m.onnx")])
    assert rc == 2
    err = _one_line_error(capsys)
    assert written in err and "--out" in err
    assert (folder / written).read_bytes() == before


def test_every_file_the_index_names_is_an_input(folder):
    """runtime.state_dict.model_folder_files (the inputs of export, quantize and refit): every
    shard the index lists, whatever its suffix, and the ModelOpt state (*.pth)."""
    from qkrope.runtime.state_dict import model_folder_files

    first = _shards(folder)[0]
    _rename_shard(folder, first, "weights.plan")
    (folder / "modelopt_state.pth").write_bytes(b"x")
    files = {Path(p).name for p in model_folder_files(folder)}
    assert {"weights.plan", "modelopt_state.pth", INDEX, "config.json"} <= files


def test_refit_refuses_an_engine_output_that_is_a_listed_shard(folder, tmp_path, capsys):
    """qkrope refit -o names a file the folder's index lists: refused by the output check (one
    line) before any engine is read."""
    from types import SimpleNamespace

    from qkrope.apps import refit

    first = _shards(folder)[0]
    _rename_shard(folder, first, "model.plan")
    args = SimpleNamespace(state_dict=None, plugin=None, diffusers=str(folder))
    with pytest.raises(OutputIsInputError, match="model.plan"):
        refit._check_refit_outputs(args, tmp_path / "other.plan", folder / "model.plan", None)


# ---------------------------------------------------------------------------------------------
# Class 2: what is read is what was checked
# ---------------------------------------------------------------------------------------------

def _resave(path: Path) -> None:
    """What a re-save does to a shard: a new file renamed over it (new inode)."""
    tmp = path.with_name(path.name + ".new")
    shutil.copyfile(path, tmp)
    os.replace(tmp, path)


def test_a_shard_resaved_after_its_header_is_refused(folder):
    headers = dw.tensor_headers(folder)
    header = next(h for h in headers.values() if h.end > h.start)
    _resave(header.file)
    with pytest.raises(dw.DiffusersWeightsError) as info:
        dw.read_tensor(header)
    msg = str(info.value)
    assert "\n" not in msg and str(header.file) in msg and "changed" in msg


def test_a_shard_rewritten_in_place_after_its_header_is_refused(folder):
    """Same inode, new mtime (a rewrite in place, cp over it)."""
    headers = dw.tensor_headers(folder)
    header = next(h for h in headers.values() if h.end > h.start)
    st = os.stat(header.file)
    os.utime(header.file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    with pytest.raises(dw.DiffusersWeightsError, match="changed"):
        dw.read_tensor(header)


def test_a_shard_changed_while_its_data_are_read_is_refused(folder, monkeypatch):
    """The identity is confirmed after the data too: a re-save during the read is refused."""
    headers = dw.tensor_headers(folder)
    header = next(h for h in headers.values() if h.end > h.start)
    real = dw._read_into

    def read_then_resave(fh, view, h):
        real(fh, view, h)
        _resave(h.file)

    monkeypatch.setattr(dw, "_read_into", read_then_resave)
    with pytest.raises(dw.DiffusersWeightsError, match="changed while"):
        dw.read_tensor(header)


def test_an_unchanged_shard_reads_as_before(folder):
    import torch
    from safetensors.torch import load_file

    headers = dw.tensor_headers(folder)
    header = next(h for h in headers.values() if h.end > h.start)
    assert header.ident is not None
    assert torch.equal(dw.read_tensor(header), load_file(str(header.file))[header.key])


def test_refit_load_refuses_a_shard_resaved_while_it_is_read(folder, monkeypatch):
    """qkrope refit's whole-file reader (load_state_dict): identity confirmed around it."""
    from qkrope.apps import refit

    first = folder / _shards(folder)[0]
    from qkrope.runtime import state_dict as sd

    real = sd.read_state_dict_file

    def read_then_resave(f, **kw):
        out = real(f, **kw)
        if Path(f) == first:
            _resave(first)
        return out

    monkeypatch.setattr(sd, "read_state_dict_file", read_then_resave)
    with pytest.raises(dw.DiffusersWeightsError, match=first.name):
        refit.load_state_dict(str(folder))


def test_export_of_a_shard_resaved_mid_export_writes_nothing(folder, tmp_path, monkeypatch,
                                                             capsys):
    """The streamed export: headers read, then the shard re-saved before its data are read.
    One line naming the shard, exit 2, nothing at --out."""
    real = dw.tensor_headers

    def headers_then_resave(*a, **kw):
        out = real(*a, **kw)
        _resave(folder / _shards(folder)[0])
        return out

    monkeypatch.setattr(dw, "tensor_headers", headers_then_resave)
    out = tmp_path / "out" / "m.onnx"
    rc = main(["export", "--model", "transformer", "--diffusers", str(folder), "--layers", "1",
               "--out", str(out)])
    err = _one_line_error(capsys)
    assert rc == 2 and _shards(folder)[0] in err and "changed" in err
    assert not out.exists() and not out.with_name("m.onnx.json").exists()
    assert not [p for p in out.parent.iterdir() if not p.name.startswith(".")] \
        if out.parent.exists() else True


# ---------------------------------------------------------------------------------------------
# Class 7: no raw tracebacks
# ---------------------------------------------------------------------------------------------

def _loop(folder: Path, name: str) -> None:
    os.unlink(folder / name)
    os.symlink(folder / "loop-b", folder / name)
    os.symlink(folder / name, folder / "loop-b")


def test_a_shard_that_is_a_symlink_loop_is_one_line(folder, tmp_path, capsys):
    name = _shards(folder)[0]
    _loop(folder, name)
    rc = main(["export", "--model", "transformer", "--diffusers", str(folder), "--layers", "1",
               "--out", str(tmp_path / "o" / "m.onnx")])
    assert rc == 2
    err = _one_line_error(capsys)
    assert name in err and "symbolic link loop" in err


def test_a_single_weights_file_that_is_a_symlink_loop_is_one_line(saved, tmp_path):
    d = tmp_path / "single"
    tp.tiny_transformer().save_pretrained(str(d))
    _loop(d, dw.WEIGHTS_NAME)
    with pytest.raises(dw.DiffusersWeightsError, match="symbolic link loop"):
        dw.weight_files(d)


def test_same_file_with_a_symlink_loop_does_not_raise(tmp_path):
    from qkrope._fileio import same_file

    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    assert same_file(tmp_path / "a", tmp_path / "a")
    assert not same_file(tmp_path / "a", tmp_path / "c")


def _corrupt_header(path: Path, edit) -> str:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    key = next(k for k in header if k != "__metadata__" and len(header[k]["shape"]) == 2)
    edit(header[key])
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    path.write_bytes(raw[:8] + text.ljust(n) + raw[8 + n:])
    return key


@pytest.mark.parametrize("edit", [
    lambda e: e.update(data_offsets=[e["data_offsets"][0],
                                     (e["data_offsets"][0] + e["data_offsets"][1]) // 2]),
    lambda e: e.update(dtype="F16"),
    lambda e: e.update(shape=[e["shape"][0], e["shape"][1] * 2]),
], ids=["range-short", "dtype", "shape"])
def test_a_header_whose_range_disagrees_with_its_shape_is_refused_with_the_headers(folder, edit):
    """Checked where every reader passes (weight_files' check of each shard): one line naming
    the key and both sizes, before any tensor or model is built."""
    name = _shards(folder)[0]
    key = _corrupt_header(folder / name, edit)
    for call in (dw.weight_files, dw.tensor_headers):
        with pytest.raises(dw.DiffusersWeightsError) as info:
            call(folder)
        msg = str(info.value)
        assert "\n" not in msg and key in msg and name in msg and "needs" in msg


def test_a_whole_model_load_refuses_a_shard_resaved_while_it_is_read(folder, monkeypatch):
    """load_transformer (qkrope quantize, the FLUX reference of qkrope check): from_pretrained
    reads whole shards; their identities are confirmed around it."""
    import diffusers

    from qkrope.export.patch_diffusers import load_transformer

    cls = diffusers.QwenImageTransformer2DModel
    real = cls.from_pretrained.__func__

    def load_then_resave(klass, *a, **kw):
        model = real(klass, *a, **kw)
        _resave(folder / _shards(folder)[-1])
        return model

    monkeypatch.setattr(cls, "from_pretrained", classmethod(load_then_resave))
    with pytest.raises(dw.ShardChangedError, match=_shards(folder)[-1]):
        load_transformer(str(folder))


def test_check_workdir_that_would_overwrite_a_reference_file_is_refused(folder, tmp_path):
    """qkrope check --workdir: its work files are never one of the files it reads, here a
    shard of the reference folder the index names inputs.json."""
    from qkrope.apps import check

    first = _shards(folder)[0]
    _rename_shard(folder, first, "inputs.json")
    before = (folder / "inputs.json").read_bytes()
    with pytest.raises(OutputIsInputError, match="--workdir") as info:
        check._check_workdir(folder, str(tmp_path / "m.onnx"), None, None, str(folder))
    assert "\n" not in str(info.value) and "inputs.json" in str(info.value)
    assert (folder / "inputs.json").read_bytes() == before
    check._check_workdir(tmp_path / "w", str(tmp_path / "m.onnx"), None, None, str(folder))
