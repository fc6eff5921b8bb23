"""The TensorRT loader (qkrope.runtime.loader_tensorrt): the plugin library is resolved by the
one function every caller uses, only from what the caller named (never the engine's recorded
library, which only checks it), a warning for another."""

from __future__ import annotations

import pytest

from qkrope.runtime import loader_tensorrt
from qkrope.runtime import runner as rn


def test_plugin_resolution_is_one_function(tmp_path, monkeypatch):
    """engine (qkrope build), runner and triton all resolve the plugin with
    plugin_build.resolve_plugin_library: explicit, else QKROPE_PLUGIN_LIB, else the built
    library; the library a sidecar records is never the answer (one line saying how to allow
    it when nothing else is there); the hash check is one of its options."""
    import inspect

    from qkrope.runtime import engine as eng
    from qkrope.runtime import plugin_build as pb
    from qkrope.runtime import triton
    from qkrope.sidecars import PluginRecord

    built = tmp_path / "build" / "libqkrope_plugin.so"
    built.parent.mkdir()
    built.write_bytes(b"built")
    monkeypatch.setenv("QKROPE_PLUGIN_LIB", str(built))
    recorded = tmp_path / "recorded.so"
    recorded.write_bytes(b"recorded")
    record = PluginRecord(str(recorded), None)
    assert pb.resolve_plugin_library(None, record) == built.resolve()
    assert pb.resolve_plugin_library(None, PluginRecord(str(tmp_path / "gone.so"))) == \
        built.resolve()
    assert pb.resolve_plugin_library(None, None) == built.resolve()
    assert pb.resolve_plugin_library(built, record) == built.resolve()
    with pytest.raises(FileNotFoundError, match="qkrope build-plugin"):
        pb.resolve_plugin_library(tmp_path / "missing.so", record)
    assert pb.resolve_plugin_library(recorded, PluginRecord(str(recorded), None),
                                     check_hash="error") == recorded.resolve()
    with pytest.raises(pb.PluginMismatchError):
        pb.resolve_plugin_library(recorded, PluginRecord(str(recorded), "0" * 64),
                                  check_hash="error")
    # nothing the caller set up: the record's existing library is named, not loaded
    monkeypatch.delenv("QKROPE_PLUGIN_LIB")
    empty = tmp_path / "no-build"
    with pytest.raises(pb.PluginNotNamedError) as exc:
        pb.resolve_plugin_library(None, record, build_dir=empty, source="/m/t.engine")
    assert str(exc.value) == (
        f"the sidecar of /m/t.engine names the plugin library {recorded}; qkrope loads no "
        f"library a file names. Fix: if you trust it, pass plugin='{recorded}' (--plugin) or "
        f"set QKROPE_PLUGIN_LIB={recorded}")
    with pytest.raises(pb.PluginNotNamedError, match="QKROPE_VC_PLUGIN_LIB"):
        pb.resolve_plugin_library(None, record, kind="vc", build_dir=empty)
    with pytest.raises(pb.PluginNotBuiltError, match="qkrope build-plugin"):
        pb.resolve_plugin_library(None, PluginRecord(str(tmp_path / "gone.so")), build_dir=empty)
    monkeypatch.setenv("QKROPE_PLUGIN_LIB", str(tmp_path / "typo.so"))  # the caller's error
    with pytest.raises(pb.PluginNotBuiltError, match="QKROPE_PLUGIN_LIB=.*typo.so"):
        pb.resolve_plugin_library(None, record, build_dir=empty)
    # the callers use it (no private copies or other spellings left)
    assert not hasattr(eng, "resolve_plugin_library") or \
        eng.resolve_plugin_library is pb.resolve_plugin_library
    for gone in ((pb, "plugin_record"), (pb, "plugin_sha256_mismatch"), (pb, "add_cli"),
                 (triton, "resolve_plugin"), (rn, "resolve_runtime_plugin")):
        assert not hasattr(*gone), gone
    for mod in (loader_tensorrt, triton):
        assert "resolve_plugin_library(" in inspect.getsource(mod)


def test_runtime_plugin_resolution(tmp_path):
    """The runner's use: the caller's library, checked against the engine's record (a warning
    for a different one)."""
    from qkrope._fileio import sha256_file
    from qkrope.runtime.plugin_build import resolve_plugin_library
    from qkrope.sidecars import PluginRecord

    lib = tmp_path / "libqkrope_plugin.so"
    lib.write_bytes(b"v1")
    record = PluginRecord(str(lib), sha256_file(lib))
    assert resolve_plugin_library(lib, record, check_hash="warn") == lib
    other = tmp_path / "other.so"
    other.write_bytes(b"v2")
    with pytest.warns(RuntimeWarning, match="differs from the one the engine was built with"):
        assert resolve_plugin_library(other, record, check_hash="warn") == other
    with pytest.raises(FileNotFoundError, match="qkrope build-plugin"):
        resolve_plugin_library(tmp_path / "missing.so", record, check_hash="warn")
