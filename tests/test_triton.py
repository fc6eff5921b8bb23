"""``qkrope triton-repo``: the config.pbtxt parses as Triton's ModelConfig and matches the engine.

No TensorRT needed: the engine file is dummy bytes, its sidecar is a realistic one (written by
the engine module's own writer when it exposes one, else following its schema).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

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
        triton.write_repository(eng, tmp_path / "r", plugin=plugin, max_batch_size=2)
    info = _engine([("x", "float32", [-1, 4])], [("y", "float32", [-1, 4])])
    cfg = text_format.Parse(triton.render_config("m", info, max_batch_size=8),
                            model_config_pb2.ModelConfig())
    assert cfg.max_batch_size == 8 and list(cfg.input[0].dims) == [4]


def test_refuses_overwrite_without_force(engine, tmp_path):
    eng, plugin = engine
    repo = tmp_path / "repo"
    triton.write_repository(eng, repo, plugin=plugin)
    (repo / "attn" / "marker").write_text("old")
    with pytest.raises(triton.TritonRepoError, match="--force"):
        triton.write_repository(eng, repo, plugin=plugin)
    assert (repo / "attn" / "marker").exists()
    triton.write_repository(eng, repo, plugin=plugin, force=True, name="attn")
    assert not (repo / "attn" / "marker").exists()
    assert (repo / "attn" / "config.pbtxt").is_file()


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


def test_plugin_hash_mismatch_and_default_from_sidecar(engine, tmp_path):
    eng, plugin = engine
    other = tmp_path / "other.so"
    other.write_bytes(b"a different build")
    with pytest.raises(PluginMismatchError, match="not the one the engine was built with"):
        triton.write_repository(eng, tmp_path / "r", plugin=other)
    res = triton.write_repository(eng, tmp_path / "r2", plugin=other, check_plugin_hash=False,
                                  copy_plugin=False)
    assert res.plugin_path == other.resolve()
    assert not (res.model_dir / triton.PLUGIN_FILE_NAME).exists()
    res = triton.write_repository(eng, tmp_path / "r3")  # plugin from the sidecar
    assert (res.model_dir / triton.PLUGIN_FILE_NAME).read_bytes() == plugin.read_bytes()


@pytest.mark.parametrize("spelling,expected", [
    ("bfloat16", "TYPE_BF16"), ("DataType.BF16", "TYPE_BF16"), ("float", "TYPE_FP32"),
    ("DataType.FLOAT", "TYPE_FP32"), ("half", "TYPE_FP16"), ("bool", "TYPE_BOOL"),
    ("DataType.INT64", "TYPE_INT64"), ("int32", "TYPE_INT32"), ("uint8", "TYPE_UINT8"),
])
def test_dtype_names(spelling, expected):
    assert triton.triton_dtype(spelling) == expected
    assert expected in model_config_pb2.DataType.keys()


def test_fp8_io_rejected():
    with pytest.raises(triton.TritonRepoError, match="no Triton TYPE_"):
        triton.triton_dtype("DataType.FP8")


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


def test_missing_tritonclient_warns(engine, tmp_path, monkeypatch, capsys):
    eng, plugin = engine

    def no_tritonclient(text):
        from qkrope._deps import MissingDependencyError

        raise MissingDependencyError("tritonclient is not installed")

    monkeypatch.setattr(triton, "parse_config", no_tritonclient)
    res = triton.write_repository(eng, tmp_path / "r", plugin=plugin)
    assert res.config_path.is_file()  # still written
    err = capsys.readouterr().err
    assert "warning: config.pbtxt not checked against Triton's ModelConfig schema" in err
    assert "tritonclient" in err


def test_force_restores_the_old_model_when_the_swap_fails(engine, tmp_path, monkeypatch):
    eng, plugin = engine
    repo = tmp_path / "repo"
    triton.write_repository(eng, repo, plugin=plugin)
    (repo / "attn" / "marker").write_text("old")
    real_rename = triton.os.rename

    def rename(src, dst):
        if Path(dst) == repo / "attn" and Path(src).name == "attn":  # the staged model moving in
            raise OSError("disk full")
        return real_rename(src, dst)

    monkeypatch.setattr(triton.os, "rename", rename)
    monkeypatch.setattr(triton, "_exchange", lambda a, b: False)  # the two-rename fallback
    with pytest.raises(OSError, match="disk full"):
        triton.write_repository(eng, repo, plugin=plugin, force=True)
    assert (repo / "attn" / "marker").read_text() == "old"  # the old model is back
    assert sorted(p.name for p in repo.iterdir()) == ["attn"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # staging removed


# --------------------------------------------------------------------------------------------
# Only engines with their engine sidecar; the plugin checked by hash; VC engines (issue 10, 7)
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
    assert cli_main(["triton-repo", "--engine", str(eng), "-o", str(repo)]) == 0
    model = repo / "attn"
    assert sorted(p.name for p in model.iterdir()) == ["1", "config.pbtxt",
                                                       "libqkrope_vc_plugin.so"]
    assert (model / "libqkrope_vc_plugin.so").read_bytes() == vc.read_bytes()
    out = capsys.readouterr().out
    assert "--backend-config=tensorrt,version-compatible=true" in out
    assert "libqkrope_vc_plugin.so" in out and triton.PLUGIN_FILE_NAME + "," not in out
    # the static library is not the VC one the engine was built with
    with pytest.raises(PluginMismatchError):
        triton.write_repository(eng, tmp_path / "r2", plugin=plugin)


# --------------------------------------------------------------------------------------------
# Fault injection: the model directory is the old one or the new one, never a mix
# --------------------------------------------------------------------------------------------

from fake_tensorrt import fail_each_write_step  # noqa: E402


def _model_state(model: Path):
    files = sorted(str(p.relative_to(model)) for p in model.rglob("*"))
    if (model / "marker").exists():
        assert (model / "1" / "model.plan").read_bytes() == b"OLD-PLAN", files
        return "old"
    assert files == ["1", "1/model.plan", "config.pbtxt", triton.PLUGIN_FILE_NAME], files
    assert (model / "config.pbtxt").read_text().startswith('name: "attn"')
    return "new"


def _temporaries(*folders):
    return [p.name for f in folders for p in f.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_repository_replaced_whole_at_every_failing_step(engine, tmp_path, monkeypatch,
                                                         exchange):
    eng, plugin = engine
    if not exchange:
        monkeypatch.setattr(triton, "_exchange", lambda a, b: False)
    repo = tmp_path / "repo"
    model = repo / "attn"

    def reset_old():
        import shutil

        shutil.rmtree(repo, ignore_errors=True)
        (model / "1").mkdir(parents=True)
        (model / "1" / "model.plan").write_bytes(b"OLD-PLAN")
        (model / "config.pbtxt").write_text('name: "attn"\n')
        (model / "marker").write_text("old")

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
# The whole transformer: ensemble = Python-backend RoPE model -> TensorRT / ONNX Runtime model
# (issue 11 part 4)
# --------------------------------------------------------------------------------------------

import importlib.util  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402

import numpy as np  # noqa: E402

from qkrope.runtime.caches import build_qwen_rope_caches  # noqa: E402


@pytest.fixture(scope="module")
def tiny_transformer_onnx(tmp_path_factory):
    from qkrope.apps import tiny_pipeline as tp

    d = tmp_path_factory.mktemp("tinytr")
    tp.save_transformer(tp.tiny_transformer(), d / "t")
    out = d / "tiny.onnx"
    assert cli_main(["export", "--model", "transformer", "--diffusers", str(d / "t"),
                     "--out", str(out)]) == 0
    return out


def _io(cfg, kind):
    return [(t.name, model_config_pb2.DataType.Name(t.data_type), list(t.dims))
            for t in getattr(cfg, kind)]


def _check_ensemble(repo: Path, name: str, main_name: str, main_io):
    cfgs = {p.name: _parse(p / "config.pbtxt") for p in repo.iterdir()}
    assert set(cfgs) == {name, main_name, f"{name}_rope"}
    main, rope, ens = cfgs[main_name], cfgs[f"{name}_rope"], cfgs[name]
    assert (_io(main, "input"), _io(main, "output")) == main_io
    assert ens.platform == "ensemble" and ens.max_batch_size == 0
    assert rope.backend == "python" and rope.max_batch_size == 0
    assert (repo / f"{name}_rope" / "1" / "model.py").read_text() == \
        triton.ROPE_MODEL_TEMPLATE.read_text()
    client = {n for n, _, _ in _io(ens, "input")}
    assert client == {n for n, _, _ in main_io[0]} - set(triton.CACHE_INPUTS) | {"img_shapes"}
    # wiring: every step's model exists and each input map names the model's real input and a
    # tensor that exists upstream (a client input or an earlier step's output)
    avail = {n: (dt, d) for n, dt, d in _io(ens, "input")}
    for step in ens.ensemble_scheduling.step:
        model = cfgs[step.model_name]
        ins = {n: (dt, d) for n, dt, d in _io(model, "input")}
        assert set(step.input_map) == set(ins)
        for key, value in step.input_map.items():
            assert value in avail and avail[value][0] == ins[key][0]
        outs = {n: (dt, d) for n, dt, d in _io(model, "output")}
        for key, value in step.output_map.items():
            avail[value] = outs[key]
    assert [o[0] for o in _io(ens, "output")] == ["sample"]
    assert all(o in avail for o, _, _ in _io(ens, "output"))
    return cfgs


def _onnx_io(onnx_path):
    info = ModelInfo.load(onnx_path)
    return tuple([(t.name, TYPE.get(t.dtype, triton.triton_dtype(t.dtype)),
                   [d if isinstance(d, int) else -1 for d in t.shape]) for t in items]
                 for items in (info.inputs, info.outputs))


def test_onnxruntime_ensemble_for_the_transformer(tiny_transformer_onnx, tmp_path, capsys):
    repo = tmp_path / "repo"
    assert cli_main(["triton-repo", "--backend", "onnxruntime", "--onnx",
                     str(tiny_transformer_onnx), "-o", str(repo)]) == 0
    cfgs = _check_ensemble(repo, "tiny", "tiny_onnx", _onnx_io(tiny_transformer_onnx))
    assert cfgs["tiny_onnx"].backend == "onnxruntime"
    files = sorted(p.name for p in (repo / "tiny_onnx" / "1").iterdir())
    data = Path(str(tiny_transformer_onnx) + ".data")
    assert files == ["model.onnx"] + (["tiny.onnx.data"] if data.exists() else [])
    assert "qkrope" in capsys.readouterr().out  # the Python env note
    # an engine is refused for --backend onnxruntime
    eng = tmp_path / "x.engine"
    eng.write_bytes(b"plan")
    assert cli_main(["triton-repo", "--backend", "onnxruntime", "--onnx", str(eng), "-o",
                     str(tmp_path / "r2")]) == 2
    assert not (tmp_path / "r2").exists()


def test_tensorrt_ensemble_for_the_transformer(tiny_transformer_onnx, tmp_path):
    info = ModelInfo.load(tiny_transformer_onnx)
    plugin = tmp_path / "libqkrope_plugin.so"
    plugin.write_bytes(b"\x7fELF fake plugin")
    net = lambda items: [EngineTensor(t.name, t.dtype, _dyn(t.shape)) for t in items]  # noqa
    side = EngineInfo(
        tensorrt_version="10.14", onnx=str(tiny_transformer_onnx),
        inputs=engine_tensors(net(info.inputs), info),
        outputs=engine_tensors(net(info.outputs), info), profiles=[],
        plugin=PluginRecord(str(plugin), hashlib.sha256(plugin.read_bytes()).hexdigest()),
        plugin_layers=2, version_compatible=False, strongly_typed=True, config=info.config)
    eng = tmp_path / "tiny.engine"
    eng.write_bytes(b"not really a TensorRT plan" * 10)
    Path(str(eng) + ".json").write_text(json.dumps(side.to_dict()))
    repo = tmp_path / "repo"
    res = triton.write_repository(eng, repo, plugin=plugin)
    cfgs = _check_ensemble(repo, "tiny", "tiny_trt", _onnx_io(tiny_transformer_onnx))
    assert cfgs["tiny_trt"].platform == "tensorrt_plan"
    assert (repo / "tiny_trt" / triton.PLUGIN_FILE_NAME).is_file()
    assert res.model_dir == repo / "tiny" and "plugins=" in res.command


class _Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


def _stand_in_pb_utils():
    m = types.ModuleType("triton_python_backend_utils")
    m.Tensor = _Tensor

    class InferenceRequest:
        def __init__(self, inputs):
            self.inputs = inputs

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self.output_tensors, self.error = output_tensors, error

    class TritonError(Exception):
        pass

    m.InferenceRequest, m.InferenceResponse, m.TritonError = (InferenceRequest,
                                                              InferenceResponse, TritonError)
    m.get_input_tensor_by_name = lambda r, n: next((t for t in r.inputs if t.name() == n), None)
    m.get_output_tensor_by_name = lambda r, n: next(
        (t for t in r.output_tensors if t.name() == n), None)
    return m


def test_the_rope_model_builds_the_library_caches(tiny_transformer_onnx, tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    triton.write_onnx_repository(tiny_transformer_onnx, repo)
    rope_dir = repo / "tiny_rope"
    from google.protobuf import json_format

    cfg = json_format.MessageToDict(_parse(rope_dir / "config.pbtxt"),
                                    preserving_proto_field_name=True)
    pb = _stand_in_pb_utils()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    spec = importlib.util.spec_from_file_location("tiny_rope_model", rope_dir / "1" / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = mod.TritonPythonModel()
    model.initialize({"model_config": json.dumps(cfg)})
    axes = tuple(ModelInfo.load(tiny_transformer_onnx).config["diffusers_config"]
                 ["axes_dims_rope"])
    for shapes, txt in (([[1, 4, 6]], 7), ([[1, 3, 3], [1, 2, 4]], 5)):
        req = pb.InferenceRequest([_Tensor("img_shapes", np.array(shapes, np.int64)),
                                   _Tensor("encoder_hidden_states_mask",
                                           np.ones((2, txt), bool))])
        resp, = model.execute([req])
        assert resp.error is None
        ref = build_qwen_rope_caches(shapes, txt, axes_dim=axes)
        img = pb.get_output_tensor_by_name(resp, "img_cos_sin_cache").as_numpy()
        txt_c = pb.get_output_tensor_by_name(resp, "txt_cos_sin_cache").as_numpy()
        assert img.dtype == np.float32 and txt_c.dtype == np.float32
        assert np.array_equal(img, ref.img.numpy()) and np.array_equal(txt_c, ref.txt.numpy())
        assert img.shape[1] == sum(axes)
    bad, = model.execute([pb.InferenceRequest([_Tensor("img_shapes", np.zeros((2,), np.int64)),
                                               _Tensor("encoder_hidden_states_mask",
                                                       np.ones((1, 3), bool))])])
    assert bad.error is not None and "img_shapes" in str(bad.error)
