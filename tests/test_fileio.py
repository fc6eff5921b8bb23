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
import os
import signal
import subprocess
import sys
import textwrap

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
