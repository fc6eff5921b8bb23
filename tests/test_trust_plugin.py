"""A folder never loads code (issue 42, item 1): no shared library is loaded, copied or run
because a file names it, only because the caller did (``plugin=`` / ``--plugin``, the documented
``QKROPE_PLUGIN_LIB``, or what ``qkrope build-plugin`` built in this installation), and the host
code a version-compatible engine carries runs only with ``allow_host_code=True`` /
``--allow-host-code``.

The library is real: a tiny C file whose constructor appends a line to a marker file, compiled
here, so "loaded" means its code ran. It sits where an engine sidecar names it, with the matching
sha256. TensorRT is the tests' fake (tests/fake_tensorrt.py), which dlopens what TensorRT would:
the plugin library ``IPluginRegistry.load_library`` is given (``dlopen=True``) and the library a
version-compatible engine carries, when it deserialises that engine with host code allowed. The
loader itself dlopens the regular plugin library (ctypes), as the product does.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fake_tensorrt as ft
from _oneline import error_line
from _triton_helpers import tiny_engine

import qkrope.runtime  # noqa: F401  (diffusers resolves the saved drop-in's class there)
from qkrope._fileio import sha256_file
from qkrope.cli import main as cli_main
from qkrope.runtime.loader_tensorrt import HostCodeNotAllowedError
from qkrope.runtime.plugin_build import PluginNotNamedError
from qkrope.sidecars import engine_sidecar_path

CC = shutil.which("cc") or shutil.which("gcc")
TRT_TYPE = {"float32": "FLOAT", "float16": "HALF", "bfloat16": "BF16", "bool": "BOOL",
            "int64": "INT64", "int32": "INT32"}
NOT_NAMED = "names the plugin library {lib}; qkrope loads no library a file names. Fix: " \
            "if you trust it, pass plugin='{lib}' (--plugin) or set QKROPE_PLUGIN_LIB={lib}"


def marked_library(folder: Path, name: str = "libqkrope_plugin.so") -> tuple[Path, Path]:
    """A shared library whose constructor appends "loaded" to a marker file: (library, marker)."""
    if CC is None:
        pytest.skip("requires a C compiler (cc or gcc) to build the marking library")
    folder.mkdir(parents=True, exist_ok=True)
    mark = folder / (name + ".mark")
    src = folder / (name + ".c")
    src.write_text(f"#include <stdio.h>\n#define MARK {json.dumps(str(mark))}\n"
                   "__attribute__((constructor)) static void qkrope_test_mark(void) {\n"
                   "    FILE *f = fopen(MARK, \"a\");\n"
                   "    if (f) { fputs(\"loaded\\n\", f); fclose(f); }\n}\n")
    lib = folder / name
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True,
                   capture_output=True)
    return lib, mark


def ran(mark: Path) -> bool:
    return mark.is_file() and "loaded" in mark.read_text()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The tiny Qwen-Image transformer exported once (the engine stands for it)."""
    from _tiny_model import export_tiny_transformer

    return export_tiny_transformer(tmp_path_factory.mktemp("trust_plugin"),
                                   onnx="tiny.onnx")[1]


def _cuda_engine(sidecar) -> ft.ICudaEngine:
    """The fake ICudaEngine with the I/O the engine sidecar records."""
    io = []
    for t in sidecar.inputs:
        lo = [d if d >= 0 else 1 for d in t.shape]
        hi = [d if d >= 0 else 4096 for d in t.shape]
        io.append((t.name, TRT_TYPE[t.dtype], list(t.shape), [lo, hi, hi],
                   ft.TensorIOMode.INPUT))
    io += [(t.name, TRT_TYPE[t.dtype], list(t.shape), None, ft.TensorIOMode.OUTPUT)
           for t in sidecar.outputs]
    return ft.ICudaEngine(io)


class Setup:
    """A folder someone else wrote: an engine whose sidecar names ``lib`` (a real library,
    with its sha256), the fake TensorRT installed, a stand-in CUDA (is_available, device 0)."""

    def __init__(self, exported, tmp_path, monkeypatch, *, version_compatible=False,
                 refittable=False):
        from qkrope.sidecars import EngineInfo

        monkeypatch.delenv("QKROPE_PLUGIN_LIB", raising=False)
        monkeypatch.delenv("QKROPE_VC_PLUGIN_LIB", raising=False)
        from qkrope.runtime import plugin_build

        # no library of this installation's build/plugins: only what the test names
        monkeypatch.setattr(plugin_build, "DEFAULT_BUILD_DIR", tmp_path / "no-build")
        self.lib, self.mark = marked_library(tmp_path / "elsewhere")
        folder = tmp_path / "downloaded"
        folder.mkdir()
        self.engine, _, _ = tiny_engine(exported, folder)
        self.engine.write_bytes(b"\x00\x01 a TensorRT plan stand-in " * 8)  # binary, as one
        side = json.loads(engine_sidecar_path(self.engine).read_text())
        side.update(engine_sha256=sha256_file(self.engine), engine_file=None,
                    plugin={"path": str(self.lib), "sha256": sha256_file(self.lib),
                            "serialized_in_engine": version_compatible},
                    version_compatible=version_compatible, refittable=refittable)
        engine_sidecar_path(self.engine).write_text(json.dumps(side))
        self.info = EngineInfo.load(self.engine)
        self.trt, self.state = ft.make_fake_trt(dlopen=True)
        blob = self.engine.read_bytes()
        if refittable:  # one of the export's weights, refitted from tmp_path / "sd.pt"
            name = self.info.config.parameters[0]
            shape = self.info.config.parameter_shapes[name]
            count = int(torch.Size(shape).numel())
            self.cuda_engine = ft.RefittableEngine({name: ("FLOAT", count)})
            torch.save({name: torch.zeros(shape)}, tmp_path / "sd.pt")
        else:
            self.cuda_engine = _cuda_engine(self.info)
        self.state.engines[blob] = self.cuda_engine
        if version_compatible:
            self.state.host_code[blob] = str(self.lib)  # the plugin it carries
        monkeypatch.setitem(sys.modules, "tensorrt", self.trt)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def not_named(self) -> str:
        return f"the sidecar of {self.engine} " + NOT_NAMED.format(lib=self.lib)


@pytest.fixture
def setup(exported, tmp_path, monkeypatch):
    return Setup(exported, tmp_path, monkeypatch)


# --------------------------------------------------------------------------------------------
# The plugin library a sidecar names
# --------------------------------------------------------------------------------------------

def test_runtime_load_loads_only_the_callers_library(setup):
    with pytest.raises(PluginNotNamedError) as exc:
        qkrope.runtime.load(setup.engine)
    assert str(exc.value) == setup.not_named()
    assert not ran(setup.mark)
    runner = qkrope.runtime.load(setup.engine, plugin=setup.lib)
    assert ran(setup.mark) and runner.plugin_path == str(setup.lib.resolve())


def test_the_environment_variable_is_the_callers_choice(setup, monkeypatch):
    monkeypatch.setenv("QKROPE_PLUGIN_LIB", str(setup.lib))
    qkrope.runtime.load(setup.engine)
    assert ran(setup.mark)


def test_another_library_of_the_caller_is_loaded_and_checked(setup, tmp_path):
    """The record only checks the caller's library: a different one is loaded (it is the
    caller's), with the mismatch warned; the recorded one never runs."""
    other, other_mark = marked_library(tmp_path / "mine")
    with pytest.warns(RuntimeWarning, match="differs from the one the engine was built with"):
        qkrope.runtime.load(setup.engine, plugin=other)
    assert ran(other_mark) and not ran(setup.mark)


def test_load_transformer(setup):
    from qkrope.runtime import load_transformer

    with pytest.raises(PluginNotNamedError) as exc:
        load_transformer(setup.engine)
    assert str(exc.value) == setup.not_named()
    assert not ran(setup.mark)
    dropin = load_transformer(setup.engine, plugin=setup.lib)
    assert ran(setup.mark) and dropin._runner.backend == "tensorrt"


def _engine_pipeline_folder(setup, tmp_path, exported) -> Path:
    """A saved pipeline folder whose transformer component is the engine (what
    ``pipe.save_pretrained`` writes for an engine drop-in)."""
    diffusers = pytest.importorskip("diffusers", reason="requires diffusers")
    pytest.importorskip("transformers", reason="QwenImagePipeline imports transformers")
    from qkrope.apps import tiny_pipeline as tp
    from qkrope.runtime import load_transformer
    from qkrope.runtime.component import COMPONENT_FILE

    pipe = diffusers.QwenImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=tp.tiny_vae(),
        transformer=load_transformer(exported), text_encoder=None, tokenizer=None)
    folder = tmp_path / "pipeline"
    pipe.save_pretrained(folder)
    component = folder / "transformer"
    for f in component.iterdir():
        f.unlink()
    shutil.copy(setup.engine, component / setup.engine.name)
    shutil.copy(engine_sidecar_path(setup.engine), engine_sidecar_path(component /
                                                                       setup.engine.name))
    record = {"format": "qkrope-dropin-component", "format_version": 1,
              "class": json.loads((folder / "model_index.json").read_text())["transformer"][1],
              "model": setup.engine.name,
              "files": [setup.engine.name, setup.engine.name + ".json"], "backend": "tensorrt",
              "dtype": "float32", "cuda_graph": False}
    (component / COMPONENT_FILE).write_text(json.dumps(record))
    return folder


def test_pipeline_from_pretrained(setup, tmp_path, exported, monkeypatch):
    import diffusers

    folder = _engine_pipeline_folder(setup, tmp_path, exported)
    engine = folder / "transformer" / setup.engine.name
    with pytest.raises(PluginNotNamedError) as exc:
        diffusers.DiffusionPipeline.from_pretrained(folder, text_encoder=None, tokenizer=None)
    assert str(exc.value) == f"the sidecar of {engine} " + NOT_NAMED.format(lib=setup.lib)
    assert not ran(setup.mark)
    monkeypatch.setenv("QKROPE_PLUGIN_LIB", str(setup.lib))  # the caller allows it
    pipe = diffusers.DiffusionPipeline.from_pretrained(folder, text_encoder=None,
                                                       tokenizer=None)
    assert ran(setup.mark) and pipe.transformer._runner.backend == "tensorrt"


def test_check_engine_loads_only_the_callers_library(setup, exported):
    from qkrope.apps.check import check_model

    with pytest.raises(PluginNotNamedError) as exc:
        check_model(exported, engine=setup.engine)  # the Python API: no plugin given
    assert str(exc.value) == setup.not_named()
    assert not ran(setup.mark)


def test_refit(exported, tmp_path, monkeypatch, capsys):
    s = Setup(exported, tmp_path, monkeypatch, refittable=True)
    before = s.engine.read_bytes()
    assert cli_main(["refit", str(s.engine), "--state-dict", str(tmp_path / "sd.pt"),
                     "--allow-missing"]) == 2
    assert error_line(capsys) == "qkrope refit: error: " + s.not_named()
    assert not ran(s.mark) and s.engine.read_bytes() == before
    assert cli_main(["refit", str(s.engine), "--state-dict", str(tmp_path / "sd.pt"),
                     "--allow-missing", "--plugin", str(s.lib)]) == 0, capsys.readouterr().err
    assert ran(s.mark) and s.cuda_engine.refits


def test_triton_repo_copies_only_the_callers_library(setup, tmp_path, capsys):
    repo = tmp_path / "repo"
    assert cli_main(["triton-repo", "--engine", str(setup.engine), "-o", str(repo)]) == 2
    line = error_line(capsys)
    assert line.startswith("qkrope triton-repo: error: ") and \
        line.endswith(NOT_NAMED.format(lib=setup.lib)), line
    assert not repo.exists()
    assert cli_main(["triton-repo", "--engine", str(setup.engine), "--plugin", str(setup.lib),
                     "-o", str(repo)]) == 0
    copied = [p for p in repo.rglob("*.so")]
    assert [p.read_bytes() for p in copied] == [setup.lib.read_bytes()]


# --------------------------------------------------------------------------------------------
# The host code a version-compatible engine carries
# --------------------------------------------------------------------------------------------

def _host_code_line(engine) -> str:
    return (f"{engine} is a version-compatible engine: it carries its plugin library as host "
            f"code that TensorRT runs when it loads the engine, and qkrope runs no code a file "
            f"brings. Fix: if you trust {engine}, pass allow_host_code=True (--allow-host-code), "
            f"or rebuild it without --version-compatible")


def test_version_compatible_engine_needs_the_callers_opt_in(exported, tmp_path, monkeypatch):
    from qkrope.runtime import load_transformer

    s = Setup(exported, tmp_path, monkeypatch, version_compatible=True)
    for opening in (qkrope.runtime.load, load_transformer):
        with pytest.raises(HostCodeNotAllowedError) as exc:
            opening(s.engine)
        assert str(exc.value) == _host_code_line(s.engine)
        with pytest.raises(HostCodeNotAllowedError):
            opening(s.engine, plugin=s.lib)  # a plugin library is no opt-in to host code
    assert not ran(s.mark) and not s.state.loaded
    dropin = load_transformer(s.engine, allow_host_code=True)
    assert ran(s.mark) and s.state.loaded == [("host_code", str(s.lib))]
    assert dropin._runner.runtime.engine_host_code_allowed is True


def test_version_compatible_engine_in_a_pipeline_folder(exported, tmp_path, monkeypatch):
    import diffusers

    from qkrope.runtime.component import DropinComponent

    s = Setup(exported, tmp_path, monkeypatch, version_compatible=True)
    folder = _engine_pipeline_folder(s, tmp_path, exported)
    monkeypatch.setenv("QKROPE_VC_PLUGIN_LIB", str(s.lib))  # a library is no opt-in either
    with pytest.raises(HostCodeNotAllowedError, match="allow_host_code=True"):
        diffusers.DiffusionPipeline.from_pretrained(folder, text_encoder=None, tokenizer=None)
    assert not ran(s.mark)
    DropinComponent.from_pretrained(folder / "transformer", allow_host_code=True)
    assert ran(s.mark)


@pytest.mark.parametrize("command", ["refit", "check"])
def test_version_compatible_engine_on_the_command_line(exported, tmp_path, monkeypatch, capsys,
                                                       command):
    s = Setup(exported, tmp_path, monkeypatch, version_compatible=True, refittable=True)
    argv = (["refit", str(s.engine), "--state-dict", str(tmp_path / "sd.pt"), "--allow-missing"]
            if command == "refit" else
            ["check", str(exported), "--engine", str(s.engine), "--plugin", str(s.lib)])
    assert cli_main(argv) == 2
    assert error_line(capsys) == f"qkrope {command}: error: " + _host_code_line(s.engine)
    assert not ran(s.mark) and not s.state.loaded
    if command == "refit":
        assert cli_main(argv + ["--allow-host-code"]) == 0, capsys.readouterr().err
        assert ran(s.mark) and s.state.loaded == [("host_code", str(s.lib))]
