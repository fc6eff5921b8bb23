"""``qkrope triton-repo``: the config.pbtxt parses as Triton's ModelConfig and matches the engine.

No TensorRT needed: the engine file is dummy bytes, its sidecar is a realistic one (written by
the engine module's own writer when it exposes one, else following its schema).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

import sys

from qkrope import _fileio
from qkrope.cli import main as cli_main
from qkrope.runtime import triton

# tritonclient[grpc] is a test dependency: the schema check must run, not skip
from google.protobuf import text_format  # noqa: E402
from tritonclient.grpc import model_config_pb2  # noqa: E402
from qkrope.runtime.plugin_build import PluginMismatchError  # noqa: E402
from qkrope.sidecars import (EngineInfo, EngineInfoError, EngineTensor, ModelInfo,  # noqa: E402
                             PluginRecord, TensorInfo, engine_tensors)

C = 3072
MAX_IMG, MAX_TXT = 4096, 512

# What `qkrope export` writes for the attention block (symbolic axes) and what TensorRT's network
# reports for it (-1 = dynamic); dtypes as qkrope.dtypes.canonical spells them.
INPUTS = [
    ("hidden_states", "bfloat16", ["batch", "img_tokens", C]),
    ("encoder_hidden_states", "bfloat16", ["batch", "txt_tokens", C]),
    ("encoder_hidden_states_mask", "bool", ["batch", "txt_tokens"]),
    ("img_cos_sin_cache", "float32", ["img_cache_rows", 128]),
    ("txt_cos_sin_cache", "float32", ["txt_cache_rows", 128]),
]
OUTPUTS = [("img_out", "bfloat16", ["batch", "img_tokens", C]),
           ("txt_out", "bfloat16", ["batch", "txt_tokens", C])]
AXIS_RANGE = {"batch": (1, 1, 2), "img_tokens": (1, 1024, MAX_IMG),
              "txt_tokens": (1, 512, MAX_TXT), "img_cache_rows": (1, 1024, MAX_IMG),
              "txt_cache_rows": (1, 512, MAX_TXT)}
TYPE = {"bfloat16": "TYPE_BF16", "float32": "TYPE_FP32", "bool": "TYPE_BOOL"}


def _dyn(shape):
    return [-1 if isinstance(d, str) else d for d in shape]


def _profile():
    return {n: {lv: tuple(AXIS_RANGE[d][i] if isinstance(d, str) else d for d in shape)
                for i, lv in enumerate(("min", "opt", "max"))} for n, _, shape in INPUTS}


def _sidecar(plugin: Path) -> dict:
    """The engine sidecar as `qkrope build` writes it: through the one writer
    (qkrope.sidecars.EngineInfo, the record runtime/engine.py fills)."""
    model = ModelInfo(
        model="attention", opset=18, ir_version=10, dtype="bf16",
        inputs=[TensorInfo(n, d, s) for n, d, s in INPUTS],
        outputs=[TensorInfo(n, d, s) for n, d, s in OUTPUTS], node_attributes={},
        config={"dim": C, "heads": 24, "head_dim": 128},
        dynamic_axes={a: {"export_value": r[1]} for a, r in AXIS_RANGE.items()},
        sample={"img_shapes": [[1, 32, 32]], "txt_len": 512, "batch": 1})
    net_in = [EngineTensor(n, d, _dyn(s)) for n, d, s in INPUTS]
    net_out = [EngineTensor(n, d, _dyn(s)) for n, d, s in OUTPUTS]
    sha = hashlib.sha256(plugin.read_bytes()).hexdigest()
    return EngineInfo(
        tensorrt_version="10.14.1.48", onnx="/models/attn.onnx",
        inputs=engine_tensors(net_in, model), outputs=engine_tensors(net_out, model),
        profiles=[{n: {lv: list(v) for lv, v in levels.items()}
                   for n, levels in _profile().items()}],
        plugin=PluginRecord(str(plugin), sha), plugin_layers=2, version_compatible=False,
        strongly_typed=True, builder_optimization_level=3, parser_flags=[],
        config=model.config, dynamic_axes=model.dynamic_axes, sample=model.sample,
        gpu={"name": "NVIDIA H200", "compute_capability": "9.0"}).to_dict()


@pytest.fixture
def engine(tmp_path):
    plugin = tmp_path / "build" / "libqkrope_plugin.so"
    plugin.parent.mkdir()
    plugin.write_bytes(b"\x7fELF fake plugin")
    eng = tmp_path / "attn.engine"
    eng.write_bytes(b"not really a TensorRT plan" * 10)
    side = _sidecar(plugin)
    assert side["inputs"][0]["shape"] == [-1, -1, C]
    Path(str(eng) + ".json").write_text(json.dumps(side, indent=2))
    return eng, plugin


def _parse(path: Path):
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def test_repo_config_parses_and_matches_engine_io(engine, tmp_path, capsys):
    eng, plugin = engine
    repo = tmp_path / "repo"
    rc = cli_main(["triton-repo", "--engine", str(eng), "--plugin", str(plugin), "-o", str(repo),
                   "--instances", "2"])
    assert rc == 0
    model = repo / "attn"
    assert (model / "1" / "model.plan").read_bytes() == eng.read_bytes()
    assert (model / triton.PLUGIN_FILE_NAME).read_bytes() == plugin.read_bytes()
    cfg = _parse(model / "config.pbtxt")
    assert cfg.name == "attn" and cfg.platform == "tensorrt_plan"
    assert cfg.max_batch_size == 0
    assert cfg.default_model_filename == "model.plan"
    got_in = {t.name: (model_config_pb2.DataType.Name(t.data_type), list(t.dims))
              for t in cfg.input}
    got_out = {t.name: (model_config_pb2.DataType.Name(t.data_type), list(t.dims))
               for t in cfg.output}
    assert got_in == {n: (TYPE[d], _dyn(s)) for n, d, s in INPUTS}
    assert got_out == {n: (TYPE[d], _dyn(s)) for n, d, s in OUTPUTS}
    assert [t.name for t in cfg.input] == [n for n, _, _ in INPUTS]  # engine order kept
    assert cfg.instance_group[0].count == 2
    assert cfg.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
    out = capsys.readouterr().out
    lib = (model / triton.PLUGIN_FILE_NAME).resolve()
    assert (f"tritonserver --model-repository={repo.resolve()} "
            f"--backend-config=tensorrt,plugins=\"{lib}\"") in out
    # nothing left behind by the atomic write
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attn.engine", "attn.engine.json",
                                                          "build", "repo"]


def _engine(inputs, outputs, profiles=()):
    return EngineInfo(tensorrt_version="10.14", onnx="/m.onnx",
                      inputs=[EngineTensor(*t) for t in inputs],
                      outputs=[EngineTensor(*t) for t in outputs], profiles=list(profiles),
                      plugin=None, plugin_layers=0, version_compatible=False,
                      strongly_typed=True)


def test_static_axes_stay_static_and_profiles_mark_dynamic(tmp_path):
    info = _engine([("x", "float16", [2, 16, 8])], [("y", "float16", [2, 16, 8])],
                   [{"x": {"min": [2, 1, 8], "opt": [2, 8, 8], "max": [2, 16, 8]}}])
    dims = triton.triton_dims(info)
    assert dims["x"] == [2, -1, 8] and triton.triton_dtype(info.inputs[0].dtype) == "TYPE_FP16"
    assert dims["y"] == [2, 16, 8]
    cfg = text_format.Parse(triton.render_config("m", info), model_config_pb2.ModelConfig())
    assert list(cfg.input[0].dims) == [2, -1, 8]
    assert model_config_pb2.DataType.Name(cfg.input[0].data_type) == "TYPE_FP16"


def test_max_batch_size_needs_batch_axis_everywhere(engine, tmp_path):
    eng, plugin = engine
    with pytest.raises(triton.TritonRepoError, match="RoPE caches"):
        triton.write_repository(eng, tmp_path / "r", plugin=plugin,
                                serving=triton.Serving(max_batch_size=2))
    info = _engine([("x", "float32", [-1, 4])], [("y", "float32", [-1, 4])])
    cfg = text_format.Parse(triton.render_config("m", info, triton.Serving(max_batch_size=8)),
                            model_config_pb2.ModelConfig())
    assert cfg.max_batch_size == 8 and list(cfg.input[0].dims) == [4]


def test_refuses_overwrite_without_force(engine, tmp_path):
    eng, plugin = engine
    repo = tmp_path / "repo"
    triton.write_repository(eng, repo, plugin=plugin)
    old = repo / "attn" / "config.pbtxt"  # a file qkrope wrote: --force may replace it
    old.write_text("old")
    with pytest.raises(triton.TritonRepoError, match="--force"):
        triton.write_repository(eng, repo, plugin=plugin)
    assert old.read_text() == "old"
    triton.write_repository(eng, repo, plugin=plugin, force=True, name="attn")
    assert old.read_text().startswith('name: "attn"')


def test_a_model_committed_by_another_writer_meanwhile_is_not_replaced(engine, tmp_path,
                                                                       monkeypatch, capsys):
    """Without --force the "exists?" decision is made under the repository's lock: another
    writer that commits repo/attn while this run assembles its model (here: just before this run
    takes the lock) keeps its model, and this run fails as if the model had been there."""
    eng, plugin = engine
    repo = tmp_path / "repo"
    real_lock = triton.folder_lock

    def other_writer_first(folder, **kw):
        if folder == repo and not (repo / "attn").exists():
            (repo / "attn" / "1").mkdir(parents=True)
            (repo / "attn" / "marker").write_text("the other writer's")
        return real_lock(folder, **kw)

    monkeypatch.setattr(triton, "folder_lock", other_writer_first)
    rc = cli_main(["triton-repo", "--engine", str(eng), "--plugin", str(plugin), "-o",
                   str(repo)])
    err = capsys.readouterr().err
    assert rc == 2 and "already exists; pass --force" in err and err.count("\n") == 1, err
    assert (repo / "attn" / "marker").read_text() == "the other writer's"
    assert sorted(p.name for p in repo.iterdir()) == ["attn"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # staging removed


def test_force_refuses_to_replace_a_model_holding_an_input(engine, tmp_path):
    """--force replaces a model directory whole: an engine (or plugin) read from inside it would
    go with it, so that is refused and the old model kept."""
    eng, plugin = engine
    repo = tmp_path / "repo"
    triton.write_repository(eng, repo, plugin=plugin)
    inside = repo / "attn" / "1" / "model.engine"
    shutil.copyfile(eng, inside)
    shutil.copyfile(str(eng) + ".json", str(inside) + ".json")
    before = sorted(p.name for p in (repo / "attn" / "1").iterdir())
    with pytest.raises(triton.TritonRepoError, match=r"model.engine is inside .*attn, which "
                                                     r"--force would replace"):
        triton.write_repository(inside, repo, plugin=plugin, name="attn", force=True)
    assert sorted(p.name for p in (repo / "attn" / "1").iterdir()) == before
    lib = repo / "attn" / "libqkrope_plugin.so"
    with pytest.raises(triton.TritonRepoError, match="which --force would replace"):
        triton.write_repository(eng, repo, plugin=lib, name="attn", force=True,
                                check_plugin_hash=False)
    # the copies are files qkrope did not write there: --force would delete them
    with pytest.raises(triton.TritonRepoError, match=r"qkrope did not write \(1/model.engine, "
                                                     r"1/model.engine.json\)"):
        triton.write_repository(eng, repo, plugin=plugin, name="attn", force=True)
    inside.unlink(), Path(str(inside) + ".json").unlink()
    triton.write_repository(eng, repo, plugin=plugin, name="attn", force=True)  # elsewhere: ok


def test_missing_engine_and_sidecar_errors(engine, tmp_path, capsys):
    eng, plugin = engine
    rc = cli_main(["triton-repo", "--engine", str(tmp_path / "nope.engine"), "--plugin",
                   str(plugin), "-o", str(tmp_path / "r")])
    assert rc == 2
    assert "nope.engine does not exist. Fix: build it" in capsys.readouterr().err
    Path(str(eng) + ".json").unlink()
    with pytest.raises(EngineInfoError, match="sidecar .* is missing"):
        triton.write_repository(eng, tmp_path / "r", plugin=plugin)
    assert not (tmp_path / "r").exists()


def test_plugin_hash_mismatch_and_no_default_from_sidecar(engine, tmp_path, monkeypatch):
    eng, plugin = engine
    other = tmp_path / "other.so"
    other.write_bytes(b"a different build")
    with pytest.raises(PluginMismatchError, match="not the one the engine was built with"):
        triton.write_repository(eng, tmp_path / "r", plugin=other)
    res = triton.write_repository(eng, tmp_path / "r2", plugin=other, check_plugin_hash=False,
                                  copy_plugin=False)
    assert res.plugin_path == other.resolve()
    assert not (res.model_dir / triton.PLUGIN_FILE_NAME).exists()
    # the sidecar's library is named, never taken (tests/test_trust_plugin.py): the caller's
    from qkrope.runtime import plugin_build
    from qkrope.runtime.plugin_build import PluginNotNamedError

    monkeypatch.setattr(plugin_build, "DEFAULT_BUILD_DIR", tmp_path / "no-build")
    monkeypatch.delenv("QKROPE_PLUGIN_LIB", raising=False)
    with pytest.raises(PluginNotNamedError, match="QKROPE_PLUGIN_LIB"):
        triton.write_repository(eng, tmp_path / "r3")
    monkeypatch.setenv("QKROPE_PLUGIN_LIB", str(plugin))
    res = triton.write_repository(eng, tmp_path / "r3")
    assert (res.model_dir / triton.PLUGIN_FILE_NAME).read_bytes() == plugin.read_bytes()


@pytest.mark.parametrize("spelling,source,expected", [
    ("bfloat16", None, "TYPE_BF16"), ("DataType.BF16", "tensorrt", "TYPE_BF16"),
    ("tensor(float)", "onnxruntime", "TYPE_FP32"), ("DataType.FLOAT", "tensorrt", "TYPE_FP32"),
    ("half", "numpy", "TYPE_FP16"), ("bool", None, "TYPE_BOOL"),
    ("DataType.INT64", "tensorrt", "TYPE_INT64"), ("int32", None, "TYPE_INT32"),
    ("uint8", None, "TYPE_UINT8"), ("float", "numpy", "TYPE_FP64"),
])
def test_dtype_names(spelling, source, expected):
    assert triton.triton_dtype(spelling, source) == expected
    assert expected in model_config_pb2.DataType.keys()


def test_fp8_io_rejected():
    with pytest.raises(triton.TritonRepoError, match="no Triton TYPE_"):
        triton.triton_dtype("DataType.FP8", "tensorrt")
    with pytest.raises(triton.TritonRepoError, match="no Triton TYPE_"):
        triton.triton_dtype("float8_e4m3fn")  # an engine sidecar's name for it
    with pytest.raises(triton.TritonRepoError, match="unknown tensor dtype 'DataType.BF16'"):
        triton.triton_dtype("DataType.BF16")  # a TensorRT name read as a sidecar's


def test_default_model_name_is_the_engine_stem(engine, tmp_path, capsys):
    """--name's help says "engine file stem": the code agrees (a dotted stem stays whole)."""
    eng, plugin = engine
    assert triton.default_model_name("a/attn.fp16.engine") == "attn.fp16"
    assert triton.default_model_name("model.PLAN") == "model"
    assert triton.default_model_name("attn") == "attn"
    dotted = tmp_path / "attn.bf16.engine"
    dotted.write_bytes(eng.read_bytes())
    Path(str(dotted) + ".json").write_text(Path(str(eng) + ".json").read_text())
    res = triton.write_repository(dotted, tmp_path / "r", plugin=plugin)
    assert res.model_dir.name == "attn.bf16"
    assert _parse(res.config_path).name == "attn.bf16"
    import argparse

    ap = argparse.ArgumentParser()
    from qkrope.apps import triton_repo

    triton_repo.add_parser(ap.add_subparsers())
    with pytest.raises(SystemExit):
        ap.parse_args(["triton-repo", "--help"])
    assert "engine file stem" in " ".join(capsys.readouterr().out.split())


def test_missing_tritonclient_is_one_line_and_writes_nothing(engine, tmp_path, monkeypatch,
                                                            capsys):
    """config.pbtxt is rendered through tritonclient's ModelConfig protobuf: without it,
    one line naming the install step, and nothing written."""
    eng, plugin = engine
    # None in sys.modules: importing it raises ImportError, as where it is not installed
    monkeypatch.setitem(sys.modules, "tritonclient.grpc.model_config_pb2", None)
    err = _refused(capsys, tmp_path, "--engine", str(eng), "--plugin", str(plugin))
    assert "tritonclient" in err and "pip install 'qkrope[triton]'" in err


def test_force_restores_the_old_model_when_the_swap_fails(engine, tmp_path, monkeypatch):
    eng, plugin = engine
    repo = tmp_path / "repo"
    triton.write_repository(eng, repo, plugin=plugin)
    (repo / "attn" / "config.pbtxt").write_text("old")
    real_rename = triton.os.rename

    def rename(src, dst):
        if Path(dst) == repo / "attn" and Path(src).name == "attn":  # the staged model moving in
            raise OSError("disk full")
        return real_rename(src, dst)

    monkeypatch.setattr(triton.os, "rename", rename)
    monkeypatch.setattr(_fileio, "_exchange", lambda a, b: False)  # the two-rename fallback
    with pytest.raises(OSError, match="disk full"):
        triton.write_repository(eng, repo, plugin=plugin, force=True)
    assert (repo / "attn" / "config.pbtxt").read_text() == "old"  # the old model is back
    assert sorted(p.name for p in repo.iterdir()) == ["attn"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # staging removed


# --------------------------------------------------------------------------------------------
# Only engines with their engine sidecar; the plugin checked by hash; VC engines
# --------------------------------------------------------------------------------------------

from _bad_nodes import BAD_NODE_CASES, write_bad_copy  # noqa: E402
from _tiny_model import write_tiny_onnx  # noqa: E402


def _refused(capsys, tmp_path, *args):
    rc = cli_main(["triton-repo", *args, "-o", str(tmp_path / "repo")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "repo").exists()
    return err


def test_an_onnx_model_is_not_an_engine(engine, tmp_path, capsys):
    """`--engine m.onnx` (with its ONNX sidecar m.onnx.json) is refused, and so is an ONNX file
    renamed .engine next to a genuine engine sidecar; nothing is written."""
    eng, plugin = engine
    model = write_tiny_onnx(tmp_path / "m.onnx")
    err = _refused(capsys, tmp_path, "--engine", str(model), "--plugin", str(plugin))
    assert "not a TensorRT engine" in err and "qkrope build" in err
    disguised = tmp_path / "disguised.engine"
    disguised.write_bytes(model.read_bytes())
    Path(str(disguised) + ".json").write_text(Path(str(eng) + ".json").read_text())
    err = _refused(capsys, tmp_path, "--engine", str(disguised), "--plugin", str(plugin))
    assert "ONNX model" in err and "not a TensorRT engine" in err
    empty = tmp_path / "empty.engine"
    empty.write_bytes(b"")
    Path(str(empty) + ".json").write_text(Path(str(eng) + ".json").read_text())
    assert "empty" in _refused(capsys, tmp_path, "--engine", str(empty), "--plugin",
                               str(plugin))


@pytest.mark.parametrize("case", list(BAD_NODE_CASES))
def test_an_onnx_model_with_bad_nodes_names_the_attribute(tmp_path, capsys, case):
    good = write_tiny_onnx(tmp_path / "good.onnx")
    bad, attribute, node = write_bad_copy(good, tmp_path / "bad.onnx", case)
    err = _refused(capsys, tmp_path, "--engine", str(bad))
    assert attribute in err and node in err


def test_an_onnx_sidecar_next_to_an_engine_is_refused(engine, tmp_path, capsys):
    eng, plugin = engine
    Path(str(eng) + ".json").write_text(json.dumps(
        {"format": "qkrope-onnx", "format_version": 1}))
    assert "qkrope-engine" in _refused(capsys, tmp_path, "--engine", str(eng), "--plugin",
                                       str(plugin))


@pytest.mark.parametrize("sidecar", ["[]", '{"format": "qkrope-engine", "format_version": 1, '
                                           '"inputs": 3}', "not json"])
def test_wrong_shape_engine_sidecar_is_one_line(engine, tmp_path, capsys, sidecar):
    eng, plugin = engine
    Path(str(eng) + ".json").write_text(sidecar)
    assert "attn.engine.json" in _refused(capsys, tmp_path, "--engine", str(eng), "--plugin",
                                          str(plugin))


def _edit_sidecar(eng, edit):
    path = Path(str(eng) + ".json")
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_the_plugin_must_be_checked_against_the_sidecar(engine, tmp_path, monkeypatch):
    """No sha256 recorded, or a plugin engine with no plugin record: the library cannot be
    checked, so it is refused (whatever is in build/plugins); --no-plugin-hash-check allows it."""
    eng, plugin = engine
    monkeypatch.setenv("QKROPE_PLUGIN_LIB", str(plugin))  # "whatever is in build/plugins"
    _edit_sidecar(eng, lambda d: d["plugin"].update(sha256=None))
    with pytest.raises(triton.TritonRepoError, match="no sha256"):
        triton.write_repository(eng, tmp_path / "r")
    with pytest.raises(triton.TritonRepoError, match="no sha256"):
        triton.write_repository(eng, tmp_path / "r", plugin=plugin)
    assert not (tmp_path / "r").exists()
    triton.write_repository(eng, tmp_path / "r", check_plugin_hash=False)
    _edit_sidecar(eng, lambda d: d.update(plugin=None))  # plugin_layers stays 2
    with pytest.raises(triton.TritonRepoError, match="2 plugin layers.*no plugin"):
        triton.write_repository(eng, tmp_path / "r2", plugin=plugin)


def test_a_function_body_engine_needs_no_plugin(engine, tmp_path, monkeypatch):
    eng, plugin = engine
    monkeypatch.setenv("QKROPE_PLUGIN_LIB", str(plugin))
    _edit_sidecar(eng, lambda d: d.update(plugin=None, plugin_layers=0))
    res = triton.write_repository(eng, tmp_path / "r")
    assert res.plugin_path is None and "plugins=" not in res.command
    assert sorted(p.name for p in res.model_dir.iterdir()) == ["1", "config.pbtxt"]
    with pytest.raises(triton.TritonRepoError, match="without the plugin"):
        triton.write_repository(eng, tmp_path / "r2", plugin=plugin)


def test_version_compatible_engine_gets_the_vc_library_and_flag(engine, tmp_path, capsys):
    eng, plugin = engine
    vc = tmp_path / "build" / "libqkrope_vc_plugin.so"
    vc.write_bytes(b"\x7fELF fake VC plugin")
    sha = hashlib.sha256(vc.read_bytes()).hexdigest()
    _edit_sidecar(eng, lambda d: d.update(version_compatible=True, plugin={
        "path": str(vc), "sha256": sha, "serialized_in_engine": True}))
    repo = tmp_path / "repo"
    assert cli_main(["triton-repo", "--engine", str(eng), "--plugin", str(vc), "-o",
                     str(repo), "--allow-host-code"]) == 0
    model = repo / "attn"
    assert sorted(p.name for p in model.iterdir()) == ["1", "config.pbtxt",
                                                       "libqkrope_vc_plugin.so"]
    assert (model / "libqkrope_vc_plugin.so").read_bytes() == vc.read_bytes()
    out = capsys.readouterr().out
    assert "--backend-config=tensorrt,version-compatible=true" in out
    assert "libqkrope_vc_plugin.so" in out and triton.PLUGIN_FILE_NAME + "," not in out
    # the static library is not the VC one the engine was built with
    with pytest.raises(PluginMismatchError):
        triton.write_repository(eng, tmp_path / "r2", plugin=plugin, allow_host_code=True)


# --------------------------------------------------------------------------------------------
# Fault injection: the model directory is the old one or the new one, never a mix
# --------------------------------------------------------------------------------------------

from fake_tensorrt import fail_each_write_step  # noqa: E402


def _model_state(model: Path):
    files = sorted(str(p.relative_to(model)) for p in model.rglob("*"))
    if (model / "config.pbtxt").read_text() == "old\n":
        assert (model / "1" / "model.plan").read_bytes() == b"OLD-PLAN", files
        return "old"
    assert files == ["1", "1/model.plan", "1/model.plan.json", "config.pbtxt",
                     triton.PLUGIN_FILE_NAME], files
    assert (model / "config.pbtxt").read_text().startswith('name: "attn"')
    return "new"


def _temporaries(*folders):
    return [p.name for f in folders for p in f.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_repository_replaced_whole_at_every_failing_step(engine, tmp_path, monkeypatch,
                                                         exchange):
    eng, plugin = engine
    if not exchange:
        monkeypatch.setattr(_fileio, "_exchange", lambda a, b: False)
    repo = tmp_path / "repo"
    model = repo / "attn"

    def reset_old():
        import shutil

        shutil.rmtree(repo, ignore_errors=True)
        (model / "1").mkdir(parents=True)
        (model / "1" / "model.plan").write_bytes(b"OLD-PLAN")
        (model / "config.pbtxt").write_text("old\n")  # qkrope's files only: --force may go

    outcomes = set()

    def after(k):
        outcomes.add(_model_state(model))
        assert sorted(p.name for p in repo.iterdir()) == ["attn"], k
        triton.write_repository(eng, repo, plugin=plugin, force=True)  # the next run
        assert _model_state(model) == "new"
        assert not _temporaries(tmp_path, repo), (k, _temporaries(tmp_path, repo))

    steps = fail_each_write_step(
        monkeypatch, lambda: triton.write_repository(eng, repo, plugin=plugin, force=True),
        reset=reset_old, after=after)
    assert len(steps) >= 3 and outcomes == {"old", "new"}


def test_a_killed_run_leaves_nothing_after_the_next(engine, tmp_path):
    """A SIGKILL cannot be handled: the staging folder it leaves (named after a dead process)
    is removed by the next run, and the model directory is never missing (it is exchanged
    with the staged one in one step)."""
    import subprocess
    import sys

    from qkrope import _fileio

    eng, plugin = engine
    repo = tmp_path / "repo"
    triton.write_repository(eng, repo, plugin=plugin)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = tmp_path / f"{_fileio.STAGING_PREFIX}{dead}-0-abc"
    (stale / "attn" / "1").mkdir(parents=True)
    (stale / "attn" / "1" / "model.plan").write_bytes(b"half")
    triton.write_repository(eng, repo, plugin=plugin, force=True)
    assert not stale.exists() and not _temporaries(tmp_path, repo)
    assert _model_state(repo / "attn") == "new"



# --------------------------------------------------------------------------------------------
# config.pbtxt through the ModelConfig protobuf: batching and placement
# --------------------------------------------------------------------------------------------

def _batchable():
    return _engine([("x", "float32", [-1, 4]), ("y", "float16", [-1, -1, 2])],
                   [("z", "float32", [-1, 4])],
                   [{"x": {"min": [1, 4], "opt": [4, 4], "max": [8, 4]},
                     "y": {"min": [1, 1, 2], "opt": [4, 3, 2], "max": [8, 9, 2]}}])


def test_dynamic_batching_instances_and_gpus_from_the_cli(engine, tmp_path, monkeypatch):
    eng, _ = engine
    info = _batchable()
    monkeypatch.setattr(triton, "load_engine_sidecar", lambda e: info)
    monkeypatch.setattr(triton, "resolve_engine_plugin", lambda *a, **k: None)
    repo = tmp_path / "repo"
    assert cli_main(["triton-repo", "--engine", str(eng), "-o", str(repo), "--name", "m",
                     "--max-batch-size", "8", "--preferred-batch-sizes", "4,2",
                     "--max-queue-delay-us", "250", "--instances", "3", "--gpus", "1,0"]) == 0
    cfg = _parse(repo / "m" / "config.pbtxt")
    assert cfg.max_batch_size == 8
    assert list(cfg.dynamic_batching.preferred_batch_size) == [2, 4]
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 250
    assert [list(t.dims) for t in cfg.input] == [[4], [-1, 2]]  # Triton adds the batch axis
    group, = cfg.instance_group
    assert (group.count, list(group.gpus)) == (3, [1, 0])
    assert group.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_batch_size=16), "exceeds the engine profile's largest batch 8"),
    (dict(max_batch_size=4, preferred_batch_sizes=(8,)), r"each must be in 1\.\.--max-batch"),
    (dict(preferred_batch_sizes=(2,)), "needs --max-batch-size"),
    (dict(max_queue_delay_us=100), "needs --max-batch-size"),
    (dict(max_queue_delay_us=-1, max_batch_size=2), r"--max-queue-delay-us must be an integer in 0\.\."),
    (dict(instances=0), r"--instances must be an integer in 1\.\.2147483647"),
    (dict(gpus=(0, 0)), "distinct GPU indices"),
    (dict(gpus=(-1,)), "distinct GPU indices"),
    (dict(max_batch_size=-1), r"--max-batch-size must be an integer in 0\.\."),
    # above the int32 / uint64 config.pbtxt fields: the flag's error, not protobuf's ValueError
    (dict(instances=2**31), r"--instances must be an integer in 1\.\.2147483647 .*got 2147483648$"),
    (dict(gpus=(0, 2**31)), r"--gpus must list distinct GPU indices 0\.\.2147483647"),
    (dict(max_batch_size=2**31), r"--max-batch-size must be an integer in 0\.\.2147483647"),
    (dict(max_batch_size=8, preferred_batch_sizes=(2**40,)), "--preferred-batch-sizes must be"),
    (dict(max_batch_size=2, max_queue_delay_us=2**64), r"--max-queue-delay-us .*18446744073"),
    (dict(instances=10**40), r"\(41 digits\)"),
])
def test_bad_serving_options_are_refused(kwargs, match):
    with pytest.raises(triton.TritonRepoError, match=match):
        triton.render_config("m", _batchable(), triton.Serving(**kwargs))


def test_configs_round_trip_through_the_protobuf_text_format(engine, tmp_path):
    """Every config written parses back to the message it was rendered from, including names
    outside the Basic Multilingual Plane (a JSON-escaped string would be surrogate pairs,
    which protobuf's text format does not take)."""
    name = "attn-\U0001F600-\u00e9"
    info = _batchable()
    cfg = triton._config(name, {"input": [("x\U0001D11E", "TYPE_FP32", [4])], "output": []},
                         triton.Serving(instances=2, gpus=(0,), max_batch_size=8,
                                        preferred_batch_sizes=(2, 4)), "KIND_GPU",
                         platform="tensorrt_plan")
    text = triton.to_text(cfg)
    assert "\\ud83d" not in text and name in text
    assert triton.parse_config(text) == cfg
    eng, plugin = engine
    res = triton.write_repository(eng, tmp_path / "r", plugin=plugin, name=name)
    back = _parse(res.config_path)
    assert back.name == name
    assert triton.to_text(back) == res.config_path.read_text(encoding="utf-8")
    assert triton.parse_config(triton.render_config("m", info)) == \
        text_format.Parse(triton.render_config("m", info), model_config_pb2.ModelConfig())


def test_onnxruntime_models_batch_only_with_a_batch_axis_everywhere(tmp_path):
    """--backend onnxruntime takes the same options; an attention block's caches have no batch
    axis, so --max-batch-size is refused for it, and placement reaches instance_group."""
    model = write_tiny_onnx(tmp_path / "m.onnx")
    with pytest.raises(triton.TritonRepoError, match=r"img_cos_sin_cache.*have none"):
        triton.write_onnx_repository(model, tmp_path / "r",
                                     serving=triton.Serving(max_batch_size=2))
    assert not (tmp_path / "r").exists()
    res = triton.write_onnx_repository(model, tmp_path / "r",
                                       serving=triton.Serving(instances=2, gpus=(1,)))
    group, = _parse(res.config_path).instance_group
    assert (group.count, list(group.gpus)) == (2, [1])
    assert group.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
    res = triton.write_onnx_repository(model, tmp_path / "r", force=True)
    assert _parse(res.config_path).instance_group[0].kind == \
        model_config_pb2.ModelInstanceGroup.KIND_AUTO


@pytest.mark.parametrize("flags", [["--max-img-tokens", "100"], ["--max-txt-tokens", "50"],
                                   ["--max-img-tokens", "100", "--max-txt-tokens", "50"]])
def test_token_limits_are_refused_for_an_attention_block(engine, tmp_path, capsys, flags):
    """An attention block gets no rope model, so --max-img-tokens / --max-txt-tokens, which
    bound the rope model, would be silently ignored: refused, in one line, nothing written
    (the engine backend and the ONNX backend alike)."""
    eng, plugin = engine
    err = _refused(capsys, tmp_path, "--engine", str(eng), "--plugin", str(plugin), *flags)
    assert flags[0] in err and "no rope model" in err and "qkrope build" in err
    onnx_path = write_tiny_onnx(tmp_path / "m.onnx")
    err = _refused(capsys, tmp_path, "--backend", "onnxruntime", "--onnx", str(onnx_path),
                   *flags)
    assert flags[0] in err and "no rope model" in err
