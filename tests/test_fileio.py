"""qkrope._fileio: atomic writes."""

from __future__ import annotations

import pytest

from qkrope._fileio import write_atomic


def test_write_atomic_replaces_and_cleans_up(tmp_path):
    target = tmp_path / "sub" / "m.engine"
    write_atomic(target, b"one")
    write_atomic(target, memoryview(b"two"))
    assert target.read_bytes() == b"two"

    class Boom:
        def __len__(self):
            raise RuntimeError("boom")

    with pytest.raises(TypeError):
        write_atomic(target, Boom())
    assert target.read_bytes() == b"two"
    assert sorted(p.name for p in target.parent.iterdir()) == ["m.engine"]


# ------------------------------------------------------------------ interrupted writes leave old outputs
import errno
import shutil
import os
import signal
import subprocess
import sys
import textwrap

from _killed import kill_at

from qkrope import _fileio
from qkrope.errors import QkropeError


def _stage_pair(folder, a=b"A", b=b"B", order=("x.json", "x.bin")):
    with _fileio.staged_outputs(folder, ["x.bin", "x.json"]) as st:
        st.path("x.bin").write_bytes(a)
        st.path("x.json").write_bytes(b)
        st.commit(list(order))


def _staging_dirs(folder):
    return [p.name for p in folder.iterdir() if p.name.startswith(_fileio.STAGING_PREFIX)]


def test_staged_outputs_commit_replaces_the_pair(tmp_path):
    _stage_pair(tmp_path, b"old", b"old-side")
    _stage_pair(tmp_path, b"new", b"new-side")
    assert (tmp_path / "x.bin").read_bytes() == b"new"
    assert (tmp_path / "x.json").read_bytes() == b"new-side"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin", "x.json"]


@pytest.mark.parametrize("k", range(1, 8))
def test_a_failing_rename_or_link_rolls_the_pair_back(tmp_path, monkeypatch, k):
    _stage_pair(tmp_path, b"old", b"old-side")
    calls = {"n": 0}
    real_replace, real_link = os.replace, os.link

    def counted(real):
        def f(*a, **kw):
            calls["n"] += 1
            if calls["n"] == k:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(*a, **kw)
        return f

    monkeypatch.setattr(os, "replace", counted(real_replace))
    monkeypatch.setattr(os, "link", counted(real_link))
    try:
        _stage_pair(tmp_path, b"new", b"new-side")
    except QkropeError as exc:
        assert "No space left" in str(exc)
        committed = False
    else:
        committed = True
    monkeypatch.undo()
    pair = ((tmp_path / "x.bin").read_bytes(), (tmp_path / "x.json").read_bytes())
    assert pair == ((b"new", b"new-side") if committed else (b"old", b"old-side"))
    _stage_pair(tmp_path, b"next", b"next-side")  # the next run leaves no temporary
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin", "x.json"]


def test_a_target_that_is_a_directory_is_refused_before_anything_moves(tmp_path):
    _stage_pair(tmp_path, b"old", b"old-side")
    (tmp_path / "x.json").unlink()
    (tmp_path / "x.json").mkdir()
    with pytest.raises(_fileio.OutputWriteError, match=r"x\.json is a directory"):
        _stage_pair(tmp_path, b"new", b"new-side")
    assert (tmp_path / "x.bin").read_bytes() == b"old" and not _staging_dirs(tmp_path)


def test_stale_staging_of_a_dead_process_is_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = tmp_path / f"{_fileio.STAGING_PREFIX}{dead}-0-abc"
    stale.mkdir()
    (stale / "m.onnx").write_bytes(b"partial")
    alive = tmp_path / f"{_fileio.STAGING_PREFIX}{os.getppid()}-{_fileio._start_time(os.getppid())}-x"
    alive.mkdir()
    other = tmp_path / ".not-ours"
    other.mkdir()
    _stage_pair(tmp_path)
    assert not stale.exists() and alive.exists() and other.exists()


@pytest.mark.parametrize("error, match", [
    (errno.ENOSPC, "disk is full.*free space"),
    (errno.EACCES, "not writable.*writable folder"),
    (errno.EROFS, "not writable.*writable folder"),
])
def test_write_errors_are_one_line_naming_the_path_and_the_fix(tmp_path, monkeypatch, error,
                                                               match):
    def fail(*a, **kw):
        raise OSError(error, os.strerror(error))

    with pytest.raises(_fileio.OutputWriteError, match=match) as exc:
        with _fileio.staged_outputs(tmp_path, ["x.bin"]) as st:
            monkeypatch.setattr(os, "fsync", fail)
            _fileio.write_atomic(st.path("x.bin"), b"data")
    assert str(tmp_path) in str(exc.value) and "\n" not in str(exc.value)
    assert not _staging_dirs(tmp_path)


def test_a_path_under_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "somefile").write_text("x")
    with pytest.raises(_fileio.OutputWriteError, match=r"somefile is a file, not a folder"):
        with _fileio.staged_outputs(tmp_path / "somefile" / "sub", ["x.bin"]):
            pass


@pytest.mark.skipif(os.name != "posix", reason="signals")
def test_sigterm_removes_the_staging_folder_and_exits_143(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        from qkrope import _fileio
        with _fileio.staged_outputs({str(tmp_path)!r}, ["x.bin"]) as st:
            st.path("x.bin").write_bytes(b"partial")
            print("staged", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "staged"
    assert _staging_dirs(tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 143
    assert not _staging_dirs(tmp_path) and not (tmp_path / "x.bin").exists()


# ---- concurrent writers of one output group -------------------------------------------------

def test_two_concurrent_commits_of_one_pair_do_not_interleave(tmp_path, monkeypatch):
    """Writer A is held after its first rename until writer B has committed (or 2 s have
    passed): without the folder lock B's two renames land between A's (sidecar B, data A);
    with it B waits for A, and the pair on disk is always one writer's."""
    import threading

    real_replace = os.replace
    first_done, b_done = threading.Event(), threading.Event()

    def replace(src, dst, *a, **kw):
        real_replace(src, dst, *a, **kw)
        if threading.current_thread().name == "A" and str(dst).endswith("x.json"):
            first_done.set()
            b_done.wait(2.0)  # a bound on the wait only; B cannot commit while A holds the lock

    monkeypatch.setattr(os, "replace", replace)

    def writer(tag):
        _stage_pair(tmp_path, b"data " + tag, b"side " + tag)
        if tag == b"B":
            b_done.set()

    a = threading.Thread(target=writer, args=(b"A",), name="A")
    a.start()
    assert first_done.wait(30)
    b = threading.Thread(target=writer, args=(b"B",), name="B")
    b.start()
    a.join(60)
    b.join(60)
    data, side = (tmp_path / "x.bin").read_bytes(), (tmp_path / "x.json").read_bytes()
    assert (data[-1:], side[-1:]) == (b"B", b"B"), (data, side)  # B committed last, whole


def test_a_commit_waits_for_another_process_holding_the_folder_lock(tmp_path):
    """The lock excludes other processes: while a second process holds it, a commit does not
    move anything; once it lets go, the commit completes."""
    import threading

    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from qkrope._fileio import folder_lock
            with folder_lock({str(tmp_path)!r}):
                print("locked", flush=True)
                sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        t = threading.Thread(target=_stage_pair, args=(tmp_path, b"new", b"new-side"))
        t.start()
        t.join(1.0)
        assert t.is_alive() and not (tmp_path / "x.bin").exists()  # blocked on the lock
        holder.stdin.close()
        t.join(60)
        assert not t.is_alive()
    finally:
        holder.kill() if holder.poll() is None else None
        holder.wait()
    assert (tmp_path / "x.bin").read_bytes() == b"new"
    assert (tmp_path / "x.json").read_bytes() == b"new-side"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin", "x.json"]  # no lock file


# ---- one replacement rule, folders as outputs (issue 26) --------------------------------------

def _write(path, content):
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:  # a folder: {name: text}
        path.mkdir()
        for name, text in content.items():
            (path / name).write_text(text)


QMODEL = {"config.json": "{}", "modelopt_state.pth": "state"}


@pytest.mark.parametrize("content, kind", [
    ({}, None),                                              # an empty folder
    (QMODEL, _fileio.QUANTIZED_MODEL),
    ({"cat.jpg": "x"}, _fileio.FOLDER),
    ('{"format": "qkrope-onnx", "model": "attn", "inpu', _fileio.MODEL_SIDECAR),  # truncated
    ('{"format": "qkrope-engine", "engine_sha2', _fileio.ENGINE_SIDECAR),
    ('{"format": ["qkrope-onnx"]}', _fileio.JSON_FILE),     # a list where the name goes
    ('{"format": {"a": 1}}', _fileio.JSON_FILE),
    ("# notes\n", _fileio.TEXT_FILE),
    (b"\x00\x01 binary", None),
])
def test_file_kind_of_folders_damaged_sidecars_and_odd_json(tmp_path, content, kind):
    _write(tmp_path / "x", content)
    assert _fileio.file_kind(tmp_path / "x") == kind


_EXISTING = {"text": "# notes\n", "json": '{"theme": "dark"}', "binary": b"\x00\x01 old",
             "onnx": b"\x08\x07\x12\x05 onnx", "model sidecar": '{"format": "qkrope-onnx"}',
             "engine sidecar": '{"format": "qkrope-engine"}', "empty": b"",
             "quantised model": QMODEL, "other folder": {"cat.jpg": "x"}, "empty folder": {}}
# what each output may replace (the rule as a user states it; REPLACES must agree)
_MAY_REPLACE = {
    _fileio.TENSORRT_ENGINE: {"binary", "empty"},
    _fileio.TIMING_CACHE: {"binary", "empty"},
    _fileio.EXTERNAL_DATA: {"binary", "empty"},
    _fileio.CALIBRATION: {"binary", "empty"},
    _fileio.ONNX_MODEL: {"binary", "empty", "onnx"},
    _fileio.MODEL_SIDECAR: {"binary", "empty", "model sidecar"},
    _fileio.ENGINE_SIDECAR: {"binary", "empty", "engine sidecar"},
    _fileio.QUANTIZED_MODEL: {"quantised model", "empty folder"},
}


@pytest.mark.parametrize("written", sorted(_MAY_REPLACE))
def test_one_replacement_rule_for_every_output(tmp_path, written):
    """A text or JSON file is never replaced by a binary output (`build -o notes.md`), a
    folder output replaces only a previous one of its kind, a file output no folder."""
    assert set(_fileio.REPLACES) == set(_MAY_REPLACE)
    for name, content in _EXISTING.items():
        path = tmp_path / name.replace(" ", "_")
        _write(path, content)
        try:
            _fileio.check_outputs([(path, written)])
        except (_fileio.OutputIsInputError, _fileio.OutputWriteError) as exc:
            assert name not in _MAY_REPLACE[written], (written, name, str(exc))
            assert "\n" not in str(exc) and "--out" in str(exc), str(exc)
        else:
            assert name in _MAY_REPLACE[written], (written, name)


def test_a_folder_output_that_is_or_contains_an_input_is_refused(tmp_path):
    (tmp_path / "models" / "float").mkdir(parents=True)
    (tmp_path / "calib.pt").write_bytes(b"\x00")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    inputs = [tmp_path / "models" / "float", tmp_path / "calib.pt"]
    for out, says in [(tmp_path / "models", "contains"), (tmp_path, "contains"),
                      (tmp_path / "models" / "float", "same file"),
                      (tmp_path / "link", "symbolic link")]:
        with pytest.raises(_fileio.OutputIsInputError, match=says):
            _fileio.check_outputs([(out, _fileio.QUANTIZED_MODEL)], inputs)
    _fileio.check_outputs([(tmp_path / "models" / "float" / "q", _fileio.QUANTIZED_MODEL)],
                          inputs)  # a new folder inside the float one reads nothing it replaces


def _stage_folder(folder, tag, *, mode=None):
    with _fileio.staged_outputs(folder, ["m"], kinds={"m": _fileio.QUANTIZED_MODEL}) as st:
        d = st.path("m")
        d.mkdir(mode=0o700)  # as mkdtemp would: the commit gives it the umask's mode
        (d / "config.json").write_text(tag)
        (d / "modelopt_state.pth").write_text(tag)
        (d / "sub").mkdir()
        (d / "sub" / "w.bin").write_bytes(tag.encode())
        os.chmod(d / "sub" / "w.bin", 0o600)
        st.commit(["m"])


def _folder_state(folder):
    d = folder / "m"
    files = sorted(str(p.relative_to(d)) for p in d.rglob("*"))
    assert files == ["config.json", "modelopt_state.pth", "sub", "sub/w.bin"], files
    tags = {(d / "config.json").read_text(), (d / "modelopt_state.pth").read_text(),
            (d / "sub" / "w.bin").read_text()}
    assert len(tags) == 1, tags  # one writer's complete folder
    return tags.pop()


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_a_folder_output_is_replaced_whole_at_every_failing_step(tmp_path, monkeypatch,
                                                                 exchange):
    from fake_tensorrt import fail_each_write_step

    if not exchange:
        monkeypatch.setattr(_fileio, "_exchange", lambda a, b: False)
    outcomes = set()

    def after(k):
        outcomes.add(_folder_state(tmp_path))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["m"], k  # no staging left

    steps = fail_each_write_step(monkeypatch, lambda: _stage_folder(tmp_path, "new"),
                                 reset=lambda: (shutil.rmtree(tmp_path / "m", True),
                                                _stage_folder(tmp_path, "old")),
                                 after=after)
    assert outcomes == {"old", "new"} and ("os.rename" in steps) == (not exchange), steps


def test_a_staged_folder_gets_the_umask_modes(tmp_path):
    old = os.umask(0o027)
    try:
        _stage_folder(tmp_path, "new")
    finally:
        os.umask(old)
    d = tmp_path / "m"
    assert [oct(p.stat().st_mode & 0o777) for p in (d, d / "sub", d / "sub" / "w.bin")] == \
        [oct(0o750), oct(0o750), oct(0o640)]


def test_the_targets_are_judged_again_under_the_lock(tmp_path, monkeypatch):
    """Another writer puts a text file where the engine goes (or a folder of photos where the
    model folder goes) after the first check: the commit, under the lock, refuses to replace
    it."""
    real_lock = _fileio.folder_lock

    def meanwhile(folder, **kw):
        if not (tmp_path / "x.engine").exists():
            (tmp_path / "x.engine").write_text("my notes\n")
        if not (tmp_path / "m").exists():
            (tmp_path / "m").mkdir()
            (tmp_path / "m" / "cat.jpg").write_text("x")
        return real_lock(folder, **kw)

    monkeypatch.setattr(_fileio, "folder_lock", meanwhile)
    with pytest.raises(_fileio.OutputIsInputError, match="is a text file, not a TensorRT engine"):
        with _fileio.staged_outputs(tmp_path, ["x.engine"],
                                    kinds={"x.engine": _fileio.TENSORRT_ENGINE}) as st:
            st.path("x.engine").write_bytes(b"\x00engine")
            st.commit(["x.engine"])
    with pytest.raises(_fileio.OutputIsInputError, match="is a folder, not a quantised model"):
        _stage_folder(tmp_path, "new")
    assert (tmp_path / "x.engine").read_text() == "my notes\n"
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["cat.jpg"]
    assert not _staging_dirs(tmp_path)


_FOLDER_KILL = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from qkrope import _fileio
    _fileio._exchange = lambda a, b: False  # the two-rename fallback
    real = os.rename
    def rename(a, b):
        real(a, b)
        if Path(b).name.endswith(".old"):
            print("moved", flush=True)
            time.sleep(60)
    os.rename = rename
    with _fileio.staged_outputs(sys.argv[1], ["m"]) as st:
        st.path("m").mkdir()
        (st.path("m") / "config.json").write_text("new")
        st.commit(["m"])
""")


@pytest.mark.skipif(os.name != "posix", reason="signals")
def test_a_kill_between_the_two_renames_is_undone_by_the_next_writer(tmp_path):
    """SIGKILL after the old folder moved away and before the new one moved in: nothing at the
    target for that instant; the next writer into the folder puts the old one back (and removes
    the dead process's staging folder) before its own work."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("old")
    kill_at(_FOLDER_KILL, str(tmp_path))
    assert not (tmp_path / "m").exists() and _staging_dirs(tmp_path)
    with _fileio.staged_outputs(tmp_path, ["other.bin"]):
        assert (tmp_path / "m" / "config.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
