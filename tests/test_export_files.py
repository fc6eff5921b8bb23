"""What an export leaves on disk when it fails or is killed: the old pair or the new one, never
a mix (fault injection at every write and rename step, real SIGTERM/SIGKILL mid-commit), no
staging folder left, path errors in one line (export/save.py, arguments.py)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import onnx
import pytest

from qkrope import _fileio
from qkrope.cli import main
from qkrope.errors import QkropeError
from qkrope.export import attention_export as ox  # where export_attention looks up the trace
from qkrope.export import save
from qkrope.export.onnx_export import export_attention
from qkrope.sidecars import ModelInfo

HEADS, HEAD_DIM = 2, 64


@pytest.fixture(scope="module")
def traced():
    """One real trace of the tiny block; exports in these tests reuse it (fast)."""
    import onnx_ir as ir

    holder = {}
    real = ox._torch_export

    def capture(*a, **kw):
        model = real(*a, **kw)
        holder["proto"] = ir.serde.serialize_model(model).SerializeToString()
        return model

    ox._torch_export = capture
    try:
        export_attention(Path(os.environ.get("TMPDIR", "/tmp")) / f"trace{os.getpid()}.onnx",
                         heads=HEADS, head_dim=HEAD_DIM)
    finally:
        ox._torch_export = real
    for suffix in ("", ".json"):
        Path(os.environ.get("TMPDIR", "/tmp"), f"trace{os.getpid()}.onnx{suffix}").unlink()
    return holder["proto"]


@pytest.fixture
def fast_export(traced, monkeypatch):
    import onnx_ir as ir

    def fake(*a, **kw):
        proto = onnx.ModelProto()
        proto.ParseFromString(traced)
        return ir.serde.deserialize_model(proto)

    monkeypatch.setattr(ox, "_torch_export", fake)

    def run(out, seed):
        return export_attention(out, heads=HEADS, head_dim=HEAD_DIM, seed=seed)
    return run


def _pair(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def _normalized(pair: dict) -> dict:
    """A pair with what differs between two exports of one configuration taken out: the random
    write id (in the sidecar and the model's metadata_props) and the sidecar's records of the
    files (their sha256 covers the write id; size, mtime and inode are the new files')."""
    side = json.loads(pair["m.onnx.json"])
    wid = side.pop("write_id").encode()
    for key in ("model_sha256", "model_file", "external_data"):
        side.pop(key)
    out = {k: v.replace(wid, b"0" * len(wid)) for k, v in pair.items()}
    out["m.onnx.json"] = json.dumps(side, sort_keys=True).encode()
    return out


def _staging(folder):
    return [p for p in folder.iterdir() if p.name.startswith(_fileio.STAGING_PREFIX)]


def test_eps_that_underflows_in_float32_is_refused_at_export(tmp_path, capsys):
    for eps in (1e-50, 1.0, -1.0):
        with pytest.raises(QkropeError, match="0 < eps < 1 in float32"):
            export_attention(tmp_path / "m.onnx", heads=HEADS, head_dim=HEAD_DIM, eps=eps)
    assert main(["export", "-o", str(tmp_path / "m.onnx"), "--heads", "2", "--head-dim", "64",
                 "--eps", "1e-50"]) == 2
    assert "float32 stores as 0.0" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_every_write_and_rename_step_failing_leaves_old_or_new_pair(tmp_path, fast_export,
                                                                    monkeypatch):
    """Fault injection: a full disk at each write/fsync/link/rename/save step of a re-export."""
    from fake_tensorrt import fail_each_write_step

    out = tmp_path / "m.onnx"
    fast_export(out, seed=1)
    old = _pair(tmp_path)

    def reset():  # back to the old pair
        for p in tmp_path.iterdir():
            if p.is_file():
                p.unlink()
        for name, data in old.items():
            (tmp_path / name).write_bytes(data)

    def after(k):
        got = _pair(tmp_path)
        if got != old:  # then it must be the complete new pair, described by its sidecar
            assert sorted(got) == sorted(old), f"step {k} left {sorted(got)}"
            assert ModelInfo.load(out).config.seed == 2, f"step {k}"
            assert got["m.onnx"] != old["m.onnx"] and got["m.onnx.json"] != old["m.onnx.json"]
        fast_export(out, seed=3)  # the next run leaves no temporary
        assert not _staging(tmp_path) and ModelInfo.load(out).config.seed == 3

    steps = fail_each_write_step(monkeypatch, lambda: fast_export(out, seed=2), reset=reset,
                                 after=after, extra=(("onnx_ir", "save"),))
    assert len(steps) >= 6 and {"os.replace", "onnx_ir.save", "os.fsync"} <= set(steps), steps


def test_sidecar_path_is_a_directory_keeps_the_old_model(tmp_path, fast_export):
    out = tmp_path / "m.onnx"
    fast_export(out, seed=1)
    model = out.read_bytes()
    Path(str(out) + ".json").unlink()
    Path(str(out) + ".json").mkdir()
    with pytest.raises(QkropeError, match=r"m\.onnx\.json is a directory"):
        fast_export(out, seed=2)
    assert out.read_bytes() == model and not _staging(tmp_path)


def test_export_path_errors_are_one_line(tmp_path, capsys, fast_export, monkeypatch):
    (tmp_path / "somefile").write_text("x")
    rc = main(["export", "-o", str(tmp_path / "somefile" / "m.onnx"), "--heads", "2",
               "--head-dim", "64"])
    err = capsys.readouterr().err
    assert rc == 2 and "somefile is a file, not a folder" in err and err.count("\n") == 1
    import onnx_ir as ir

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ir, "save", full)
    with pytest.raises(_fileio.OutputWriteError, match=r"disk is full.*--out"):
        fast_export(tmp_path / "d" / "m.onnx", seed=1)
    assert not _staging(tmp_path / "d")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_export_into_a_read_only_folder_is_one_line(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        rc = main(["export", "-o", str(ro / "m.onnx"), "--heads", "2", "--head-dim", "64"])
    finally:
        ro.chmod(0o755)
    err = capsys.readouterr().err
    assert rc == 2 and "not writable" in err and err.count("\n") == 1


_KILL_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import onnx, onnx_ir as ir
    from qkrope.export import attention_export as ox
    proto = onnx.ModelProto()
    proto.ParseFromString(Path(sys.argv[1]).read_bytes())
    ox._torch_export = lambda *a, **kw: ir.serde.deserialize_model(proto)
    pause_at, n = int(sys.argv[3]), [0]
    real = os.replace
    def replace(*a, **kw):
        if Path(str(a[1])).parent == Path(sys.argv[2]).parent:
            n[0] += 1
            if n[0] == pause_at:
                print("commit", flush=True)
                time.sleep(5)
        return real(*a, **kw)
    os.replace = replace
    ox.export_attention(sys.argv[2], heads=2, head_dim=64, seed=2)
    print("done", flush=True)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
@pytest.mark.parametrize("pause_at", [1, 2])
def test_signal_mid_export_leaves_old_or_new_pair(tmp_path, traced, fast_export, sig, pause_at):
    """A real SIGTERM/SIGKILL of an exporting process when it reaches the commit's renames:
    old pair or new pair (or, for SIGKILL between two renames, a pair the reader refuses as
    'does not describe this model', never a silently mixed one), and after the next export no
    temporary is left."""
    out = tmp_path / "m.onnx"
    fast_export(out, seed=1)
    old = _pair(tmp_path)
    blob = tmp_path.parent / f"{tmp_path.name}.traced"
    blob.write_bytes(traced)
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(blob), str(out),
                             str(pause_at)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "commit"
    proc.send_signal(sig)
    rc = proc.wait(60)
    got = _pair(tmp_path)
    if sig == signal.SIGTERM:
        assert rc == 143
        assert not _staging(tmp_path)  # the handler removed it
        ModelInfo.load(out)  # the commit was finished (signals wait for it): the new pair
        assert got != old
    else:
        assert rc == -signal.SIGKILL
        if got != old:
            try:
                ModelInfo.load(out)
            except QkropeError as exc:
                assert "does not describe this model" in str(exc)
    fast_export(out, seed=1)
    assert not _staging(tmp_path) and _normalized(_pair(tmp_path)) == _normalized(old)




def test_an_export_with_external_data_loads_by_its_file_records(tmp_path, fast_export,
                                                                monkeypatch):
    """The exporter's sidecar records the model and its external-data file (sha256, size,
    mtime_ns, inode, taken in staging and kept by the commit's renames) and the write id it put
    into the model's metadata: the load afterwards hashes nothing; new bytes in the data file
    are refused."""
    from qkrope import file_record
    from qkrope.sidecars import onnx_metadata_props

    monkeypatch.setattr(save, "EXTERNAL_DATA_THRESHOLD", 0)  # every export writes m.onnx.data
    out = tmp_path / "m.onnx"
    fast_export(out, seed=1)
    data = tmp_path / "m.onnx.data"
    side = json.loads((tmp_path / "m.onnx.json").read_text())
    assert set(side["external_data"]) == {"m.onnx.data"}
    assert side["external_data"]["m.onnx.data"]["ino"] == data.stat().st_ino
    assert onnx_metadata_props(out)["qkrope.write_id"] == side["write_id"]

    def refuse(path):
        raise AssertionError(f"{path} was hashed")

    with monkeypatch.context() as m:
        m.setattr(file_record, "sha256_file", refuse)
        assert ModelInfo.load(out).verified == "stat"
    st = data.stat()
    data.write_bytes(bytes(st.st_size))  # rewritten in place: same size, new mtime
    with pytest.raises(QkropeError, match="does not describe this model's external data file"):
        ModelInfo.load(out)
