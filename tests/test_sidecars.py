"""qkrope/sidecars/ (the ONNX sidecar: model.py, files.py): one writer and one reader each, and
the check on load (a wrong version or shape of the file is a SidecarError naming the file, never
a KeyError; a sidecar beside another model, or one that disagrees with its model's own
metadata, is refused). The engine sidecar: tests/test_sidecar_engine.py; the config:
tests/test_sidecar_config.py; the file records: tests/test_sidecar_records.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _sidecar_samples import edited, engine_info as _engine, model_info as _model
from _tiny_model import C, sidecar_dict, write_tiny_onnx

from qkrope.errors import QkropeError
from qkrope.runtime import onnx_file, trt_utils as tu
from qkrope.sidecars import (FORMAT_VERSION, EngineInfo, EngineInfoError, ModelInfo,
                             ModelInfoError, PluginRecord, TensorInfo, engine_sidecar_path,
                             sidecar_path)


def test_round_trips(tmp_path):
    m = _model()
    assert m.save(tmp_path / "m.onnx") == sidecar_path(tmp_path / "m.onnx")
    back = ModelInfo.load(tmp_path / "m.onnx")
    assert back == m and back.source == str(sidecar_path(tmp_path / "m.onnx"))
    assert back.to_dict()["format_version"] == FORMAT_VERSION and "source" not in back.to_dict()
    assert back.export_values() == {"batch": 2, "img_tokens": 4}
    e = _engine()
    e.save(tmp_path / "m.engine")
    got = EngineInfo.load(tmp_path / "m.engine")
    assert got == e and got.plugin == PluginRecord("/lib.so", "ab", False)
    assert got.profile_ranges() == {"x": [([1, 8], [4, 8])]}
    assert "axes" not in got.to_dict()["outputs"][0]


@pytest.mark.parametrize("change,match", [
    (lambda d: d.update(format_version=3), "format_version 3; this qkrope reads versions 1, 2"),
    (lambda d: d.update(format_version=True), "format_version True"),
    (lambda d: d["inputs"][0].update(role="latents"), r"inputs\[0\] field 'role' must be one of"),
    (lambda d: d.pop("format_version"), "format_version None"),
    (lambda d: d.update(format="qkrope-onnx/1"), "not a qkrope sidecar of format"),
    (lambda d: d.pop("opset"), "has no 'opset' field"),
    (lambda d: d.update(opset="18"), "field 'opset' must be int"),
    (lambda d: d["inputs"][0].update(shape="batch"), r"inputs\[0\] field 'shape' must be list"),
    (lambda d: d["dynamic_axes"].update(batch=2), r"dynamic_axes\['batch'\] holds a int"),
    (lambda d: d.update(model="unet"), "unknown model 'unet'"),
])
def test_model_sidecar_errors_name_the_file(tmp_path, change, match):
    path = edited(_model(), tmp_path / "m.onnx", sidecar_path, change)
    with pytest.raises(ModelInfoError, match=match) as exc:
        ModelInfo.load(tmp_path / "m.onnx")
    assert str(path) in str(exc.value) and "qkrope export" in str(exc.value)
    assert isinstance(exc.value, QkropeError)


def test_unreadable_and_missing_files(tmp_path):
    with pytest.raises(EngineInfoError, match="sidecar .* is missing"):
        EngineInfo.load(tmp_path / "nothing.engine")
    engine_sidecar_path(tmp_path / "a.engine").write_text("{not json")
    with pytest.raises(EngineInfoError, match="cannot read the sidecar"):
        EngineInfo.load(tmp_path / "a.engine")
    engine_sidecar_path(tmp_path / "b.engine").write_text("[1, 2]")
    with pytest.raises(EngineInfoError, match="holds a list, expected a JSON object"):
        EngineInfo.load(tmp_path / "b.engine")
    with pytest.raises(ModelInfoError, match="no sidecar"):
        ModelInfo.load(tmp_path / "nothing.onnx")


def test_model_description_is_read_through_model_info(tmp_path):
    """ModelInfo.describe reads the sidecar with ModelInfo.load (format checked); the dict forms
    of the description are gone, and the sidecar path has one definition."""
    from qkrope.sidecars import ModelInfoError, sidecar_path

    for gone in ("onnx_sidecar_path", "load_model_description", "describe_onnx_graph",
                 "read_json", "engine_sidecar_path"):
        assert not hasattr(tu, gone) and not hasattr(onnx_file, gone), gone
    p = write_tiny_onnx(tmp_path / "m.onnx")
    desc = ModelInfo.describe(p)
    assert desc.source == str(sidecar_path(p)) and desc.to_dict()["format"] == "qkrope-onnx"
    assert desc.to_dict()["format_version"] == FORMAT_VERSION
    side = json.loads(sidecar_path(p).read_text())
    side["format"] = "someone-elses/2"
    sidecar_path(p).write_text(json.dumps(side))
    with pytest.raises(ModelInfoError, match="not a qkrope sidecar"):
        ModelInfo.describe(p)


def test_description_from_the_onnx_graph(tmp_path):
    """Without a sidecar, the description comes from the ONNX graph (dim_param names kept)."""
    p = write_tiny_onnx(tmp_path / "m.onnx", sidecar=False)
    desc = ModelInfo.describe(p)
    assert desc.source == str(p)
    assert desc.inputs[0] == TensorInfo("hidden_states", "float32", ["batch", "img_tokens", C])
    assert desc.input_names == [s["name"] for s in sidecar_dict()["inputs"]]


# ------------------------------------------------------------------ a sidecar belongs to one model file
def test_sidecar_records_and_checks_the_model_hash(tmp_path):
    """The sidecar names the sha256 of the model file it describes; a sidecar left next to
    another model (a stale pair, an interrupted re-export) is refused on load, not trusted."""
    import hashlib

    onnx_path = tmp_path / "m.onnx"
    onnx_path.write_bytes(b"model one")
    _model().save(onnx_path)
    side = json.loads(sidecar_path(onnx_path).read_text())
    assert side["model_sha256"] == hashlib.sha256(b"model one").hexdigest()
    assert ModelInfo.load(onnx_path).model_sha256 == side["model_sha256"]
    onnx_path.write_bytes(b"model two")
    with pytest.raises(ModelInfoError, match=r"does not describe this model \(.*m\.onnx has "
                                             r"sha256 [0-9a-f]{12}.*re-export") as exc:
        ModelInfo.load(onnx_path)
    assert str(sidecar_path(onnx_path)) in str(exc.value)
    with pytest.raises(ModelInfoError, match="does not describe this model"):
        ModelInfo.describe(onnx_path)


@pytest.mark.parametrize("value", [12, "xyz", ""])
def test_sidecar_model_hash_field_is_typed(tmp_path, value):
    onnx_path = tmp_path / "m.onnx"
    onnx_path.write_bytes(b"model")
    _model().save(onnx_path)
    path = sidecar_path(onnx_path)
    data = json.loads(path.read_text())
    data["model_sha256"] = value
    path.write_text(json.dumps(data))
    with pytest.raises(ModelInfoError, match="model_sha256"):
        ModelInfo.load(onnx_path)


@pytest.fixture(scope="module")
def exported_attention(tmp_path_factory):
    from qkrope.export.onnx_export import export_attention

    d = tmp_path_factory.mktemp("exported")
    export_attention(d / "m.onnx", heads=2, head_dim=32)
    return d / "m.onnx"


def _edited_copy(src, dst, edit):
    import shutil

    shutil.copyfile(src, dst)
    side = json.loads(Path(str(src) + ".json").read_text())
    edit(side)
    Path(str(dst) + ".json").write_text(json.dumps(side))
    return dst


@pytest.mark.parametrize("edit, field", [
    (lambda s: s["config"].update(axes_dims_rope=s["config"]["axes_dims_rope"][::-1]),
     "config.axes_dims_rope"),                      # same sum, the model's hash still valid
    (lambda s: s["config"].update(heads=4), "config.heads"),
    (lambda s: s["config"].pop("rotary_dim"), "config.rotary_dim"),
    (lambda s: s["node_attributes"].update(epsilon=1e-5), "node_attributes"),
    (lambda s: s.update(dtype="fp16"), "dtype"),
    # the graph's I/O and the export's sizes (the model's qkrope.io metadata) and the header
    (lambda s: s["inputs"][0]["shape"].__setitem__(2, 65), "inputs"),
    (lambda s: s["inputs"][1].update(dtype="float16"), "inputs"),
    (lambda s: s["outputs"].reverse(), "outputs"),
    (lambda s: s["dynamic_axes"]["img_tokens"].update(export_value=999), "dynamic_axes"),
    (lambda s: s["sample"].update(txt_len=99), "sample"),
    (lambda s: s.update(opset=19), "opset"),
    (lambda s: s.update(ir_version=9), "ir_version"),
])
def test_a_sidecar_that_disagrees_with_its_model_is_refused(exported_attention, tmp_path,
                                                            edit, field):
    """The model's own metadata_props hold what it was exported with; a sidecar edited beside
    the unchanged model (model_sha256 still matches) is refused by every reader: load and the
    runner through ModelInfo.load."""
    from qkrope.runtime import load

    side = json.loads(Path(str(exported_attention) + ".json").read_text())
    axes = side["config"]["axes_dims_rope"]
    assert axes != axes[::-1]  # the permutation changes something
    path = _edited_copy(exported_attention, tmp_path / "m.onnx", edit)
    with pytest.raises(ModelInfoError, match=rf"disagrees with its model .* on {field}: sidecar"):
        ModelInfo.load(path)
    # each fact of the sidecar is one of these (versions aside: nothing is computed from them;
    # the file records and the write id are checked against the files themselves)
    assert set(side) - {"format", "format_version", "versions", "model_sha256", "model_file",
                        "external_data", "write_id"} == {
        "model", "opset", "ir_version", "dtype", "inputs", "outputs", "dynamic_axes",
        "node_attributes", "config", "sample"}
    with pytest.raises(ModelInfoError, match=field):
        load(path)
    ModelInfo.load(exported_attention)  # the original pair agrees


@pytest.mark.parametrize("edit, match", [
    (lambda s: s["node_attributes"].update(plugin_version="9"), "plugin_version '9'"),
    (lambda s: s["node_attributes"].update(plugin_namespace="x"), "plugin_namespace 'x'"),
    (lambda s: s["node_attributes"].update(epsilonn=1e-6), "'epsilonn'"),
    (lambda s: s["inputs"][0].update(dtype="junk"), "must be a dtype name"),
    (lambda s: s["inputs"].append(dict(s["inputs"][0])), "'hidden_states' twice"),
    (lambda s: (s["inputs"][0].update(role="encoder_hidden_states"),
                s["inputs"][1].update(role="hidden_states")), "edited or swapped"),
])
def test_sidecar_facts_the_reader_would_drop_or_misread_are_refused(exported_attention,
                                                                    tmp_path, edit, match):
    """Facts the reader would otherwise drop silently (a node attribute no node has, a plugin
    identity that is not this qkrope's) or misread (a junk dtype, a tensor twice, swapped
    roles): refused on reading."""
    path = _edited_copy(exported_attention, tmp_path / "m.onnx", edit)
    with pytest.raises(ModelInfoError, match=match):
        ModelInfo.load(path)


def test_metadata_props_are_read_without_the_graph(exported_attention):
    import onnx

    model = onnx.load(str(exported_attention), load_external_data=False)
    from qkrope.sidecars import onnx_metadata_props

    assert onnx_metadata_props(exported_attention) == {p.key: p.value
                                                        for p in model.metadata_props}
    assert "qkrope.config" in onnx_metadata_props(exported_attention)


def test_an_export_stores_the_node_attributes_once(exported_attention):
    side = json.loads(Path(str(exported_attention) + ".json").read_text())
    assert side["format_version"] == FORMAT_VERSION
    assert not {"eps", "epsilon", "interleaved", "rounding"} & set(side["config"])
    assert side["node_attributes"]["epsilon"] == pytest.approx(1e-6)
