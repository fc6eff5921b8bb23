"""qkrope/sidecars/engine.py: the engine sidecar's reader refuses a bad field or profile by
name, writes what the runtime reads back, and is refused beside another engine by every
reader (load, refit, triton-repo)."""

from __future__ import annotations

import json

import pytest

from _sidecar_samples import edited, engine_info as _engine
from _tiny_model import C, model

from qkrope.runtime import profiles as prof
from qkrope.sidecars import (ENGINE_FORMAT, FORMAT_VERSION, EngineInfo, EngineInfoError,
                             EngineTensor, PluginRecord, engine_sidecar_path, engine_tensors)


@pytest.mark.parametrize("change,match", [
    (lambda d: d.update(format_version=0), "format_version 0"),
    (lambda d: d.pop("inputs"), "has no 'inputs' field"),
    (lambda d: d.update(inputs=[]), "lists no inputs"),
    (lambda d: d["plugin"].pop("path"), "plugin has no 'path' field"),
    (lambda d: d["profiles"][0]["x"].pop("max"), "has no 'max' field"),
    (lambda d: d["outputs"][0].update(shape=[-1, "8"]), "must be a list of int"),
    (lambda d: d.update(version_compatible="no"), "'version_compatible' must be bool"),
])
def test_engine_sidecar_errors_name_the_file(tmp_path, change, match):
    path = edited(_engine(), tmp_path / "m.engine", engine_sidecar_path, change)
    with pytest.raises(EngineInfoError, match=match) as exc:
        EngineInfo.load(tmp_path / "m.engine")
    assert str(path) in str(exc.value) and "qkrope build" in str(exc.value)


def test_engine_sidecar_contents():
    side = model()
    profile = prof.derive_profile(side)
    info = EngineInfo(
        tensorrt_version="10.14.1", onnx="/m.onnx",
        inputs=engine_tensors([EngineTensor("hidden_states", "float32", [-1, -1, C])], side),
        outputs=engine_tensors([EngineTensor("img_out", "float32", [-1, -1, C])], side),
        # the profile of the engine's one input (a profile of an input the engine does not
        # have is refused on reading)
        profiles=[{"hidden_states": prof.profile_to_json(profile)["hidden_states"]}],
        plugin=PluginRecord("/lib.so", "ab", True), plugin_layers=2, version_compatible=True,
        strongly_typed=True, builder_optimization_level=3,
        parser_flags=["ENABLE_PLUGIN_OVERRIDE"], config=side.config,
        gpu={"name": "H200", "compute_capability": "9.0"})
    doc = info.to_dict()
    assert doc["format"] == ENGINE_FORMAT and doc["format_version"] == FORMAT_VERSION
    assert doc["inputs"][0]["axes"] == ["batch", "img_tokens", None]
    assert doc["profiles"][0]["hidden_states"]["max"] == [2, 4096, C]
    assert doc["plugin"] == {"path": "/lib.so", "sha256": "ab", "serialized_in_engine": True}
    assert doc["config"]["head_dim"] == 16 and doc["version_compatible"] is True
    assert EngineInfo.from_dict(json.loads(json.dumps(doc))) == info
    for edit, match in ((lambda d: d["profiles"][0].update(mask={"min": [1], "opt": [1],
                                                                 "max": [1]}),
                         "'mask' is not an input of the engine"),
                        (lambda d: d["profiles"][0]["hidden_states"].update(min=[]),
                         r"min \[\] has 0 dimensions, the input has 3"),
                        (lambda d: d["profiles"][0]["hidden_states"]["min"].__setitem__(1, 9999),
                         "dimension 1 is min 9999"),
                        (lambda d: d["profiles"][0]["hidden_states"]["max"].__setitem__(2, 7),
                         r"dimension 2 .* all 32 \(a static dimension\)")):
        bad = json.loads(json.dumps(doc))
        edit(bad)
        with pytest.raises(EngineInfoError, match=match):
            EngineInfo.from_dict(bad)


def test_engine_sidecar_records_and_checks_its_engine(tmp_path):
    """An engine pair identifies itself like a model pair: the sidecar records the engine's
    sha256 and load() refuses it beside another engine (two writers, a copy by hand)."""
    import hashlib

    engine = tmp_path / "m.engine"
    engine.write_bytes(b"engine one")
    _engine().save(engine)
    side = json.loads((tmp_path / "m.engine.json").read_text())
    assert side["engine_sha256"] == hashlib.sha256(b"engine one").hexdigest()
    assert EngineInfo.load(engine).engine_sha256 == side["engine_sha256"]
    engine.write_bytes(b"engine two")
    with pytest.raises(EngineInfoError, match=r"does not describe this engine \(.*m\.engine has "
                                              r"sha256 [0-9a-f]{12}.*rebuild it"):
        EngineInfo.load(engine)
    side["engine_sha256"] = "xyz"
    (tmp_path / "m.engine.json").write_text(json.dumps(side))
    with pytest.raises(EngineInfoError, match="engine_sha256"):
        EngineInfo.load(engine)


@pytest.mark.parametrize("reader", ["load", "refit", "triton-repo"])
def test_readers_refuse_an_engine_beside_another_engines_sidecar(tmp_path, capsys, monkeypatch,
                                                                 reader):
    """load, refit and triton-repo read the engine sidecar through EngineInfo.load: an engine
    that is not the one its sidecar records is refused before TensorRT is needed."""
    import sys

    from qkrope import cli
    from qkrope.runtime import load

    monkeypatch.setitem(sys.modules, "tensorrt", None)
    engine = tmp_path / "m.engine"
    engine.write_bytes(b"\x00engine A")
    info = _engine()
    info.refittable = True
    info.save(engine)
    engine.write_bytes(b"\x00engine B")  # another writer's engine
    if reader == "load":
        with pytest.raises(EngineInfoError, match="does not describe this engine"):
            load(engine)
        return
    state = tmp_path / "sd.pt"
    import torch

    torch.save({"w": torch.ones(2)}, state)
    argv = {"refit": ["refit", str(engine), "--state-dict", str(state)],
            "triton-repo": ["triton-repo", "--engine", str(engine), "-o",
                            str(tmp_path / "repo"), "--no-plugin-hash-check"]}[reader]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "does not describe this engine" in err and err.count("\n") == 1, err
    assert engine.read_bytes() == b"\x00engine B" and not (tmp_path / "repo").exists()
