"""Issue 42, class 2: a leftover, stale or crafted staging folder or commit journal never makes a
later writer (:func:`qkrope._fileio.staged_outputs`) or reader (:func:`qkrope._fileio.recover`,
the preflight of input folders) create, move, rename or delete anything but the files that writer
commits. What does not check out is refused in one line naming the stale item and the fix; the
user's own files in the output folder are never removed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _killed import kill_at

from qkrope import _fileio, _preflight
from qkrope.errors import QkropeError

NOTES, DATA = b"my notes\n", b"\x00my data"


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """The pid of a process that has exited (its staging folders are stale)."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout)


@pytest.fixture
def out(tmp_path) -> Path:
    """An output folder holding the user's own files, and a folder elsewhere (also the user's)."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "notes.txt").write_bytes(NOTES)
    (folder / "data.bin").write_bytes(DATA)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "mine.txt").write_bytes(NOTES)
    return folder


def _stale(folder: Path, pid: int, token: str = "abc", start: int = 0) -> Path:
    d = folder / f"{_fileio.STAGING_PREFIX}{pid}-{start}-{token}"
    d.mkdir(mode=0o700)
    return d


def _next_writer(folder: Path) -> None:
    with _fileio.staged_outputs(folder, ["new.bin"]) as st:
        st.path("new.bin").write_bytes(b"new")
        st.commit(["new.bin"])


def _user_files_intact(out: Path) -> None:
    assert (out / "notes.txt").read_bytes() == NOTES
    assert (out / "data.bin").read_bytes() == DATA
    assert (out.parent / "elsewhere" / "mine.txt").read_bytes() == NOTES
    assert sorted(p.name for p in (out.parent / "elsewhere").iterdir()) == ["mine.txt"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["elsewhere", "out"]


def _refused(out: Path, staging: Path, run=None) -> str:
    """The writer (or ``run``) is refused in one line naming the stale item and the fix, before
    it writes anything; the stale item is left as it is for the user to inspect."""
    with pytest.raises(_fileio.OutputWriteError) as exc:
        (run or _next_writer)(out)
    msg = str(exc.value)
    assert isinstance(exc.value, QkropeError)
    assert "\n" not in msg and str(staging) in msg and "Fix:" in msg, msg
    assert not (out / "new.bin").exists()
    assert os.path.lexists(staging)
    return msg


# ---- journals ---------------------------------------------------------------------------------

@pytest.mark.parametrize("plan, staged", [
    ({"order": [], "remove": ["notes.txt"], "kinds": {}}, {}),               # deletes a user file
    ({"order": ["notes.txt"], "remove": [], "kinds": {}}, {"notes.txt": b"evil"}),  # overwrites
    ({"order": ["data.bin"], "remove": [],
      "kinds": {"data.bin": _fileio.TENSORRT_ENGINE}}, {"data.bin": b"\x00evil"}),
    ({"order": ["../x"], "remove": [], "kinds": {}}, {}),
    ({"order": [], "remove": ["../elsewhere/mine.txt"], "kinds": {}}, {}),
    ({"order": [], "remove": ["/etc/passwd"], "kinds": {}}, {}),
    ({"order": ["sub/x"], "remove": [], "kinds": {}}, {}),
    ("not json", {}),
], ids=["remove-user-file", "order-user-file", "order-binary", "dotdot", "remove-dotdot",
        "absolute", "slash", "garbage"])
def test_a_crafted_journal_moves_and_deletes_nothing(out, dead_pid, plan, staged):
    staging = _stale(out, dead_pid)
    (staging / _fileio.COMMIT_JOURNAL).write_text(plan if isinstance(plan, str)
                                                  else json.dumps(plan))
    for name, data in staged.items():
        (staging / name).write_bytes(data)
    msg = _refused(out, staging)
    assert "commit journal" in msg, msg
    _user_files_intact(out)


def _legit_journal(out: Path, order, remove=()) -> Path:
    """A journal as a writer writes it before its first rename, with its staged files, copied
    out of the writer's staging folder (the writer then exits without committing)."""
    copy = out.parent / "journal-copy"
    copy.mkdir()
    names = sorted(set(order) | {"x.bin"})
    with _fileio.staged_outputs(out, names) as st:
        for name in names:
            st.path(name).write_bytes(b"staged " + name.encode())
        st._journal(list(order), list(remove))
        for p in st.dir.iterdir():
            if p.is_file():
                (copy / p.name).write_bytes(p.read_bytes())
    return copy


def test_a_journal_copied_into_another_staging_folder_is_refused(out, dead_pid):
    """A journal names the files its writer staged, exactly: the same names and bytes in another
    staging folder (another writer's, or one unpacked from an archive) are not what qkrope
    staged there, and do not replace the user's files."""
    copy = _legit_journal(out, ["notes.txt", "x.bin"])
    staging = _stale(out, dead_pid)
    for p in copy.iterdir():
        os.replace(p, staging / p.name)
    copy.rmdir()
    _refused(out, staging)
    _user_files_intact(out)


def test_a_journal_edited_to_remove_a_user_file_is_refused(out, dead_pid):
    copy = _legit_journal(out, ["x.bin"], remove=["data.bin"])
    staging = _stale(out, dead_pid)
    for p in copy.iterdir():
        os.replace(p, staging / p.name)
    copy.rmdir()
    plan = json.loads((staging / _fileio.COMMIT_JOURNAL).read_text())
    text = json.dumps(plan).replace('"data.bin"', '"notes.txt"')  # another file of the user's
    (staging / _fileio.COMMIT_JOURNAL).write_text(text)
    _refused(out, staging)
    _user_files_intact(out)


def test_a_staged_file_that_is_a_link_is_not_moved_in(out, dead_pid):
    """A crafted staged 'file' that is a symbolic link to the user's file elsewhere: moving it
    in would put a link to the user's file into the output folder."""
    staging = _stale(out, dead_pid)
    (staging / "m.bin").symlink_to(out.parent / "elsewhere" / "mine.txt")
    (staging / _fileio.COMMIT_JOURNAL).write_text(
        json.dumps({"order": ["m.bin"], "remove": [], "kinds": {}}))
    _refused(out, staging)
    assert not os.path.lexists(out / "m.bin")
    _user_files_intact(out)


# ---- staging folders that are links, or whose .replaced holds what qkrope did not put there -----

def test_a_staging_folder_that_is_a_link_elsewhere_is_refused(out, dead_pid):
    """The link points to a folder of the user's holding a journal-like file and the file it
    names: today's reader would move the user's file from there into the output folder."""
    elsewhere = out.parent / "elsewhere"
    (elsewhere / _fileio.COMMIT_JOURNAL).write_text(
        json.dumps({"order": ["mine.txt"], "remove": [], "kinds": {}}))
    link = out / f"{_fileio.STAGING_PREFIX}{dead_pid}-0-abc"
    link.symlink_to(elsewhere)
    msg = _refused(out, link)
    assert "symbolic link" in msg, msg
    (elsewhere / _fileio.COMMIT_JOURNAL).unlink()
    _user_files_intact(out)
    assert not (out / "mine.txt").exists()


def test_a_staging_folder_that_is_a_link_to_the_output_folder_is_refused(out, dead_pid):
    (out / _fileio.COMMIT_JOURNAL).write_text(
        json.dumps({"order": [], "remove": ["notes.txt", "data.bin"], "kinds": {}}))
    link = out / f"{_fileio.STAGING_PREFIX}{dead_pid}-0-abc"
    link.symlink_to(out)
    _refused(out, link)
    (out / _fileio.COMMIT_JOURNAL).unlink()
    _user_files_intact(out)


def _replaced(staging: Path, note: str, moved: Path | None = None) -> Path:
    """``staging/.replaced`` with a moved-away folder ``x.old`` (or ``moved`` linked in its
    place) and its note."""
    rep = staging / _fileio.REPLACED
    rep.mkdir()
    if moved is None:
        (rep / "x.old").mkdir()
        (rep / "x.old" / "payload.txt").write_text("crafted")
    else:
        (rep / "x.old").symlink_to(moved)
    (rep / ("x.old" + _fileio._TARGET_SUFFIX)).write_text(note)
    return rep


def _note(path, ident=None):
    """A note as qkrope writes it now (the place below the output folder, the identity)."""
    return json.dumps({"format": _fileio._NOTE_FORMAT, "path": path, "id": ident or [0, 0]})


@pytest.mark.parametrize("note", [
    "{elsewhere}/x", "{out}/../x", "../x", "x", "{out}/link/x", "{out}/sub/../../x",
    _note(["..", "x"]), _note(["a/b"]), _note(["/etc"]), _note(["link", "x"]), _note(["x"]),
    _note([]), '{"format": "something else"}', "{not json",
], ids=["absolute-elsewhere", "dotdot", "relative-dotdot", "relative", "link-component",
        "dotdot-under", "new-dotdot", "new-slash", "new-absolute", "new-link-component",
        "new-other-folder", "new-empty", "new-format", "new-garbage"])
def test_a_replaced_note_naming_a_path_outside_the_folder_is_refused(out, dead_pid, note):
    """Older notes (an absolute path) and current ones (folder names below the output folder
    and the identity of the folder moved away): a note that names a place outside the folder,
    through a link, or another folder than the one beside it is refused."""
    (out / "link").symlink_to(out.parent / "elsewhere")
    staging = _stale(out, dead_pid)
    _replaced(staging, note.replace("{out}", str(out))
              .replace("{elsewhere}", str(out.parent / "elsewhere")))
    msg = _refused(out, staging)
    assert ".replaced" in msg, msg
    (out / "link").unlink()
    _user_files_intact(out)


def test_a_note_whose_place_goes_through_a_link_is_refused(out, dead_pid):
    """The moved-away folder is the one the note records, but its place goes through a link in
    the output folder (to the user's folder elsewhere): not put back there."""
    (out / "link").symlink_to(out.parent / "elsewhere")
    staging = _stale(out, dead_pid)
    rep = _replaced(staging, "")
    st = os.lstat(rep / "x.old")
    (rep / ("x.old" + _fileio._TARGET_SUFFIX)).write_text(_note(["link", "x"],
                                                               [st.st_dev, st.st_ino]))
    msg = _refused(out, staging)
    assert "through a link" in msg, msg
    (out / "link").unlink()
    _user_files_intact(out)


def test_a_replaced_folder_that_is_a_link_is_not_moved_in(out, dead_pid):
    staging = _stale(out, dead_pid)
    _replaced(staging, str(out / "x"), moved=out.parent / "elsewhere")
    _refused(out, staging)
    assert not os.path.lexists(out / "x")
    _user_files_intact(out)


def test_a_replaced_subfolder_that_is_a_link_elsewhere_is_refused(out, dead_pid):
    """``.replaced`` itself a link to a folder of the user's that holds a folder and a note:
    today's writer moves the user's folder from there into the output folder."""
    staging = _stale(out, dead_pid)
    user = out.parent / "elsewhere"
    (user / "x.old").mkdir()
    (user / ("x.old" + _fileio._TARGET_SUFFIX)).write_text(str(out / "x"))
    (staging / _fileio.REPLACED).symlink_to(user)
    _refused(out, staging)
    assert (user / "x.old").is_dir() and not os.path.lexists(out / "x")
    (user / "x.old").rmdir()
    (user / ("x.old" + _fileio._TARGET_SUFFIX)).unlink()
    _user_files_intact(out)


def test_a_reader_refuses_a_crafted_note_in_one_line(out, dead_pid):
    """The preflight of an input folder that is missing (a reader) finds a crafted note in the
    folder's parent: refused in one line, nothing created outside."""
    staging = _stale(out, dead_pid)
    _replaced(staging, str(out.parent / "elsewhere" / "x"))

    def read(folder):
        _preflight.input_dir(folder / "model", flag="--diffusers", fix="pass the folder")

    _refused(out, staging, run=read)
    _user_files_intact(out)


# ---- names, owners and modes --------------------------------------------------------------------

def _crafted_remove(staging: Path) -> None:
    (staging / _fileio.COMMIT_JOURNAL).write_text(
        json.dumps({"order": [], "remove": ["notes.txt"], "kinds": {}}))


@pytest.mark.parametrize("name", [
    "99999999999999999999-0-abc",      # a pid past any pid (os.kill overflows)
    "0-0-abc",                          # pid 0: the process group, not a process
    "{live}-{live_start}-abc",          # a live process's
    "{live}-0-abc",                     # a live process's, start time unknown
    "abc-0-x", "12-x-y", "12-0-",       # does not parse
])
def test_a_staging_like_name_that_is_not_a_dead_writers_is_left_alone(out, name):
    live = os.getppid()
    name = name.format(live=live, live_start=_fileio._start_time(live))
    staging = out / (_fileio.STAGING_PREFIX + name)
    staging.mkdir(mode=0o700)
    _crafted_remove(staging)
    _next_writer(out)
    assert (out / "new.bin").read_bytes() == b"new" and staging.is_dir()
    assert (staging / _fileio.COMMIT_JOURNAL).exists()
    _user_files_intact(out)


def test_another_users_staging_folder_is_left_alone(out, dead_pid, monkeypatch):
    """A staging folder the current user does not own (here: the current user seen as another
    uid) is another user's to finish: not read, not removed, and the writer goes on."""
    staging = _stale(out, dead_pid)
    _crafted_remove(staging)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(out).st_uid + 4242)
    _next_writer(out)
    monkeypatch.undo()
    assert (out / "new.bin").read_bytes() == b"new"
    assert (staging / _fileio.COMMIT_JOURNAL).exists()
    _user_files_intact(out)


def test_a_staging_folder_writable_by_others_is_refused(out, dead_pid, tmp_path):
    """Anyone in the group could have written its journal: it is not acted on."""
    copy = _legit_journal(out, ["x.bin"])
    staging = _stale(out, dead_pid)
    for p in copy.iterdir():
        os.replace(p, staging / p.name)
    copy.rmdir()
    os.chmod(staging, 0o777)
    msg = _refused(out, staging)
    assert "writable by others" in msg, msg
    assert not (out / "x.bin").exists()
    _user_files_intact(out)


def test_a_plain_stale_staging_folder_is_still_removed(out, dead_pid):
    """What a writer killed while writing (before its commit) leaves: removed by the next one,
    even with an older writer's modes (group-writable under umask 002)."""
    staging = _stale(out, dead_pid)
    (staging / "m.onnx").write_bytes(b"partial")
    (staging / "linked").symlink_to(out.parent / "elsewhere")  # removed as a link, not followed
    os.chmod(staging, 0o775)
    _next_writer(out)
    assert not os.path.lexists(staging) and (out / "new.bin").read_bytes() == b"new"
    _user_files_intact(out)


def test_the_staging_folder_is_private(tmp_path):
    """Created 0700 whatever the umask: no one else can put a journal or a note in it."""
    old = os.umask(0o002)
    try:
        with _fileio.staged_outputs(tmp_path, ["a"]) as st:
            assert st.dir.stat().st_mode & 0o777 == 0o700
    finally:
        os.umask(old)


# ---- legitimate crash recovery still works -------------------------------------------------------

_SWAP_KILL = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from qkrope import _fileio
    _fileio._exchange = lambda a, b: False  # the two-rename fallback
    real = os.rename
    def rename(a, b, **kw):
        real(a, b, **kw)
        if Path(b).name.endswith(".old"):
            print("moved", flush=True)
            time.sleep(60)
    os.rename = rename
    parent = Path(sys.argv[1])
    with _fileio.staged_outputs(parent, []) as st:     # as the Triton repository writer does
        (st.dir / "m").mkdir()
        (st.dir / "m" / "config.pbtxt").write_text("new")
        _fileio.swap_dir(st.dir / "m", parent / "repo" / "m", st.dir / _fileio.REPLACED)
""")


def _kill_mid_swap(tmp_path):
    """REPO/m (config.pbtxt "old") and a writer of REPO/m SIGKILLed between its two renames."""
    (tmp_path / "repo" / "m").mkdir(parents=True)
    (tmp_path / "repo" / "m" / "config.pbtxt").write_text("old")
    kill_at(_SWAP_KILL, str(tmp_path))


@pytest.mark.skipif(os.name != "posix", reason="signals")
def test_a_folder_moved_away_below_a_subfolder_is_put_back(tmp_path):
    """A writer whose staging folder sits beside the folder it writes into (the Triton
    repository) is killed between its two renames: the next writer puts the old folder back."""
    _kill_mid_swap(tmp_path)
    assert not (tmp_path / "repo" / "m").exists()
    _fileio.remove_stale_staging(tmp_path)
    assert (tmp_path / "repo" / "m" / "config.pbtxt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]


_KILL_AFTER_FIRST_RENAME = textwrap.dedent("""
    import os, signal, sys
    from qkrope import _fileio

    def killing_commit(self, order, remove, backups, done):
        os.replace(self.dir / order[0], self.folder / order[0])   # the first rename only
        os.kill(os.getpid(), signal.SIGKILL)

    _fileio.Staging._commit = killing_commit
    with _fileio.staged_outputs(sys.argv[1], ["m.side", "m.model", "m.data"]) as st:
        st.path("m.side").write_bytes(b"new side")
        st.path("m.model").write_bytes(b"new model")
        st.commit(["m.side", "m.model"], remove=["m.data"])
""")


def test_a_killed_commit_with_a_removal_is_finished_exactly(out):
    """A writer killed after its first rename, whose commit also removes a stale companion: the
    next writer finishes it from the journal (the companion it meant to remove is removed, the
    user's files are not)."""
    for name in ("m.side", "m.model", "m.data"):
        (out / name).write_bytes(b"old " + name.encode())
    r = subprocess.run([sys.executable, "-c", _KILL_AFTER_FIRST_RENAME, str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert (out / "m.model").read_bytes() == b"old m.model"  # the half state
    _next_writer(out)
    assert (out / "m.side").read_bytes() == b"new side"
    assert (out / "m.model").read_bytes() == b"new model"
    assert not (out / "m.data").exists()
    assert sorted(p.name for p in out.iterdir()) == ["data.bin", "m.model", "m.side", "new.bin",
                                                     "notes.txt"]
    _user_files_intact(out)


def test_a_folder_that_cannot_be_put_back_is_kept(out, dead_pid, monkeypatch):
    """A writer killed between its two renames left the user's old folder in its staging
    folder; when the next writer cannot move it back (here: the rename fails), the staging folder
    and the old folder in it are kept and the writer stops in one line (the old code removed
    the staging folder, the user's folder with it)."""
    (out / "m").mkdir()
    (out / "m" / "config.json").write_text("old")
    staging = _stale(out, dead_pid)
    rep = staging / _fileio.REPLACED
    rep.mkdir()
    (rep / ("m.old" + _fileio._TARGET_SUFFIX)).write_text(_fileio._replaced_note(out / "m", rep))
    os.rename(out / "m", rep / "m.old")

    def no_rename(*a, **kw):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "rename", no_rename)
    with pytest.raises(_fileio.OutputWriteError) as exc:
        _next_writer(out)
    monkeypatch.undo()
    assert "\n" not in str(exc.value) and "m.old" in str(exc.value), str(exc.value)
    assert (rep / "m.old" / "config.json").read_text() == "old"
    _next_writer(out)  # and once it can, it is put back
    assert (out / "m" / "config.json").read_text() == "old" and not staging.exists()


# ---- review: older notes, a renumbered device, a folder swapped in before its removal ------------

def test_an_older_note_naming_a_place_inside_the_folder_is_refused(out, dead_pid):
    """An older note records only a path (no identity): nothing confirms that qkrope moved the
    folder beside it away from there, so a crafted one would plant any folder anywhere below the
    output folder. Refused like an older journal; nothing is created."""
    (out / "sub").mkdir()
    staging = _stale(out, dead_pid)
    rep = _replaced(staging, str(out / "sub" / "planted"))
    msg = _refused(out, staging)
    assert "older qkrope" in msg and str(rep / "x.old.target") in msg, msg
    assert list((out / "sub").iterdir()) == [] and (rep / "x.old" / "payload.txt").exists()
    _user_files_intact(out)


def _killed_after_first_rename(out: Path) -> Path:
    """A writer killed after the first rename of its commit (the half state); its staging
    folder."""
    for name in ("m.side", "m.model", "m.data"):
        (out / name).write_bytes(b"old " + name.encode())
    r = subprocess.run([sys.executable, "-c", _KILL_AFTER_FIRST_RENAME, str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    return next(out.glob(_fileio.STAGING_PREFIX + "*"))


def _renumber_device(path: Path) -> None:
    """What a remount that renumbers the device (overlayfs after a container restart, an NFS
    remount) does to a recorded identity: the same files, another device number."""
    plan = json.loads(path.read_text())
    for entry in plan.get("order", []) + plan.get("remove", []):
        entry["id"][0] += 1
    if "id" in plan and "format" in plan and plan["format"] == _fileio._NOTE_FORMAT:
        plan["id"][0] += 1
    path.write_text(json.dumps(plan))


def test_a_killed_commit_is_finished_after_a_remount(out):
    staging = _killed_after_first_rename(out)
    _renumber_device(staging / _fileio.COMMIT_JOURNAL)
    _next_writer(out)
    assert (out / "m.side").read_bytes() == b"new side"
    assert (out / "m.model").read_bytes() == b"new model"
    assert not (out / "m.data").exists() and not os.path.lexists(staging)
    _user_files_intact(out)


@pytest.mark.skipif(os.name != "posix", reason="signals")
def test_a_folder_moved_away_is_put_back_after_a_remount(tmp_path):
    _kill_mid_swap(tmp_path)
    note, = tmp_path.glob(f"{_fileio.STAGING_PREFIX}*/{_fileio.REPLACED}/*{_fileio._TARGET_SUFFIX}")
    _renumber_device(note)
    _fileio.remove_stale_staging(tmp_path)
    assert (tmp_path / "repo" / "m" / "config.pbtxt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]


def test_a_refused_half_commit_says_how_to_finish_it(out):
    """A staged file that no longer checks out (here: rewritten since) is not moved in; the line
    names the staged files still to move in and where, so the user can finish the commit by hand
    instead of removing the staging folder and keeping the half state."""
    staging = _killed_after_first_rename(out)
    (staging / "m.model").write_bytes(b"new model, rewritten")
    msg = _refused(out, staging)
    assert f"move {staging / 'm.model'} to {out / 'm.model'}" in msg, msg
    assert f"remove {out / 'm.data'}" in msg, msg
    assert (out / "m.model").read_bytes() == b"old m.model"
    _user_files_intact(out)


def _victim(out: Path) -> Path:
    """A folder of the user's in the output folder, that a co-user (the folder group-writable,
    no sticky bit) could rename to a staging folder's name."""
    (out / "keep").mkdir()
    (out / "keep" / "model.onnx").write_bytes(DATA)
    return out / "keep"


def test_a_folder_swapped_in_after_the_check_is_not_removed(out, dead_pid, monkeypatch):
    """A stale staging folder is checked through its descriptor; a folder put under its name
    after that check (the checked one moved away) is not the one checked, and survives."""
    staging = _stale(out, dead_pid)
    (staging / "m.onnx").write_bytes(b"partial")
    victim = _victim(out)
    real, swapped = _fileio._exists_at, []

    def swap_after_check(name, dir_fd):
        if not swapped:  # the first look inside the checked folder: swap now
            os.rename(staging, out / "moved-away")
            os.rename(victim, staging)
            swapped.append(True)
        return real(name, dir_fd)

    monkeypatch.setattr(_fileio, "_exists_at", swap_after_check)
    _fileio.remove_stale_staging(out)
    monkeypatch.undo()
    assert swapped and (staging / "model.onnx").read_bytes() == DATA


def test_a_writers_own_staging_folder_swapped_in_the_block_is_not_removed(out):
    """The same for the writer's own staging folder, removed when the block ends."""
    victim = _victim(out)
    with _fileio.staged_outputs(out, ["new.bin"]) as st:
        st.path("new.bin").write_bytes(b"new")
        os.rename(st.dir, out / "moved-away")
        os.rename(victim, st.dir)
    assert (st.dir / "model.onnx").read_bytes() == DATA
    assert not (out / "moved-away" / "new.bin").exists()  # the checked folder was emptied
