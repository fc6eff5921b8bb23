"""qkrope.runtime.engine (`qkrope build`) without TensorRT: plugin-layer detection, the progress
display, the version gate, the missing-TensorRT message, and the whole build driven through the
shared fake ``tensorrt`` (tests/fake_tensorrt.py: flags, profile shapes, atomic writes, sidecar
contents) for TensorRT 10.14, 10.15 and 11.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import fake_tensorrt as ft
from fake_tensorrt import fail_each_write_step
import pytest
from _tiny_model import C, fake_tensorrt, write_tiny_onnx

from qkrope._fileio import sha256_file
from qkrope._progress import BuildProgress
from qkrope.runtime import engine as eng
from qkrope.runtime import loader_tensorrt as lt

LT = ft.LayerType
TRT, _ = ft.make_fake_trt()
ours = ft.qknorm_rope_layer


# --------------------------------------------------------------------------------------------
# Plugin-layer detection over fake networks
# --------------------------------------------------------------------------------------------

def test_plugin_layers_found():
    net = ft.INetworkDefinition([(LT.MATRIX_MULTIPLY, "mm", None), ours("a"), ours("b"),
                                  (LT.PLUGIN_V3, "other", ft.Plugin(ft.PluginCore(
                                      "QKNormRoPE", "1", "someone_else")))])
    found = eng.check_plugin_layers(net, TRT, ["a", "b"])
    assert [f.layer_name for f in found] == ["a", "b"]
    assert all(f.identified_by == "plugin" for f in found)
    mine, others = eng.find_plugin_layers(net, TRT)
    assert [o.plugin_namespace for o in others] == ["someone_else"]


def test_function_body_fallback_fails_loudly():
    body = ft.INetworkDefinition([(LT.ELEMENTWISE, f"QKNormRoPE_body_{i}", None)
                                  for i in range(20)])
    with pytest.raises(eng.PluginFallbackError) as exc:
        eng.check_plugin_layers(body, TRT, ["a", "b"], trt_version="10.6.0")
    msg = str(exc.value)
    assert "0 of 2" in msg and "function body" in msg and "10.7" in msg


def test_partial_fallback_and_no_nodes():
    with pytest.raises(eng.PluginFallbackError, match="1 of 2"):
        eng.check_plugin_layers(ft.INetworkDefinition([ours("a")]), TRT, ["a", "b"])
    with pytest.raises(eng.PluginFallbackError, match="no QKNormRoPE nodes"):
        eng.check_plugin_layers(ft.INetworkDefinition([ours("a")]), TRT, [])


def test_uninspectable_plugin_matched_by_node_name():
    net = ft.INetworkDefinition([(LT.PLUGIN_V3, "node_QKNormRoPE_0", ft.Plugin(broken=True)),
                                  (LT.PLUGIN_V3, "unrelated", ft.Plugin(broken=True))])
    found = eng.check_plugin_layers(net, TRT, ["node_QKNormRoPE_0"])
    assert found[0].identified_by == "layer name"


def test_get_layer_returns_an_ilayer_that_must_be_cast():
    """Like the real bindings: no .plugin before the cast, and the detection casts by type."""
    net = ft.INetworkDefinition([ours("a")])
    layer = net.get_layer(0)
    assert type(layer) is ft.ILayer and not hasattr(layer, "plugin")
    assert [f.identified_by for f in eng.find_plugin_layers(net, TRT)[0]] == ["plugin"]


# --------------------------------------------------------------------------------------------
# Progress display
# --------------------------------------------------------------------------------------------

def test_progress_plain_lines_and_cancel():
    out = io.StringIO()
    t = iter(range(100))
    p = BuildProgress(out, tty=False, clock=lambda: float(next(t)))
    p.phase_start("Building engine", None, 3)
    p.phase_start("Tactic selection", "Building engine", 10)
    p.phase_start("deep", "Tactic selection", 2)  # depth 2: not printed
    assert p.step_complete("deep", 0) is True
    p.phase_finish("deep")
    p.phase_finish("Tactic selection")
    p.cancel()
    assert p.step_complete("Building engine", 1) is False
    p.phase_finish("Building engine")
    text = out.getvalue()
    assert "[build] Building engine (3 steps)" in text
    assert "  [build] Tactic selection (10 steps)" in text
    assert "deep" not in text and "\r" not in text
    assert "Building engine done in" in text


def test_progress_tty_bars():
    """On a terminal: a tqdm bar per phase (steps counted), the top phase's time when it ends."""
    out = io.StringIO()
    p = BuildProgress(out, tty=True)
    p.phase_start("Build", None, 4)
    p.phase_start("Tactics", "Build", 3)
    p.step_complete("Tactics", 2)
    assert "[build] Tactics" in out.getvalue() and "3/3" in out.getvalue()
    p.phase_finish("Tactics")
    p.step_complete("Build", 1)
    assert "2/4" in out.getvalue()
    p.phase_finish("Build")
    assert not p.phases
    assert "[build] Build done in" in out.getvalue()
    assert "Tactics done in" not in out.getvalue()  # nested phases leave no line


# --------------------------------------------------------------------------------------------
# TensorRT versions
# --------------------------------------------------------------------------------------------

def test_trt_version_gate():
    assert lt.check_trt_version("10.14.1.48") == (10, 14)
    assert lt.check_trt_version("11.0.0") == (11, 0)
    with pytest.raises(lt.EngineBuildError, match="too old"):
        lt.check_trt_version("8.6.1")


def test_network_flags_follow_the_tensorrt_version():
    """STRONGLY_TYPED (1) on TensorRT 10; nothing on 11, where the flag is deprecated (0) and
    every network is strongly typed."""
    trt10, _ = ft.make_fake_trt("10.14.1")
    trt11, _ = ft.make_fake_trt("11.1.0")
    assert trt10.NetworkDefinitionCreationFlag.STRONGLY_TYPED == 1
    assert trt11.NetworkDefinitionCreationFlag.STRONGLY_TYPED == 0
    assert eng.network_creation_flags(trt10) == 1 << 1
    assert eng.network_creation_flags(trt11) == 0
    assert eng.is_strongly_typed(trt10, 2) and eng.is_strongly_typed(trt11, 0)


def test_parser_override_flag_only_where_it_exists():
    for version, expected in (("10.14.1", []), ("10.15.1", ["ENABLE_PLUGIN_OVERRIDE"]),
                              ("11.1.0", ["ENABLE_PLUGIN_OVERRIDE"])):
        trt, state = ft.make_fake_trt(version)
        assert hasattr(trt.OnnxParserFlag, "ENABLE_PLUGIN_OVERRIDE") == bool(expected)
        parser = trt.OnnxParser(None, None)
        assert eng.set_parser_flags(parser, trt) == expected
        assert state.parser_flags == expected


# --------------------------------------------------------------------------------------------
# Missing TensorRT
# --------------------------------------------------------------------------------------------

def test_build_without_tensorrt_one_message_exit_2(tmp_path, monkeypatch, capsys):
    from qkrope import cli

    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` raises ImportError
    onnx_path = write_tiny_onnx(tmp_path / "m.onnx")
    out = tmp_path / "m.engine"
    rc = cli.main(["build", str(onnx_path), "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1, err  # one message
    assert "tensorrt" in err and "NGC TensorRT container" in err and "qkrope build" in err
    assert not out.exists() and not Path(str(out) + ".json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.json"]


# --------------------------------------------------------------------------------------------
# The whole build through the fake tensorrt module
# --------------------------------------------------------------------------------------------

@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    def setup(**kw):
        trt, state, lib = fake_tensorrt(monkeypatch, tmp_path, **kw)
        onnx_path = write_tiny_onnx(tmp_path / "m.onnx")
        return trt, state, onnx_path, lib
    return setup


def test_fake_build_writes_engine_and_sidecar(fake_build, tmp_path, capsys):
    from qkrope import cli

    trt, state, onnx_path, lib = fake_build()
    out = tmp_path / "out" / "m.engine"
    tc = tmp_path / "timing.cache"
    rc = cli.main(["build", str(onnx_path), "-o", str(out), "--plugin", str(lib),
                   "--max-img-tokens", "64", "--timing-cache", str(tc),
                   "--builder-optimization-level", "4", "--workspace", "256",
                   "--max", "encoder_hidden_states:2x40x32"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert out.read_bytes() == ft.plan_bytes(state.network_name)
    assert tc.read_bytes() == bytes(trt.ITimingCache(b"").serialize())  # a new cache
    assert state.timing_cache_data == b""
    assert state.flags == 1 << 1  # STRONGLY_TYPED (1 in TensorRT 10)
    assert state.parser_flags == []  # no ENABLE_PLUGIN_OVERRIDE before 10.15
    assert state.loaded == [("dlopen", str(lib.resolve()))]
    assert state.config.pools == {"WS": 256 << 20}
    assert state.config.builder_optimization_level == 4
    assert state.profile["hidden_states"] == ((1, 1, C), (2, 16, C), (2, 64, C))
    assert state.profile["txt_cos_sin_cache"][2] == (40, 16)  # raised to the text tokens
    assert state.progress_calls == 1 and "[build] Building" in captured.err
    side = json.loads(Path(str(out) + ".json").read_text())
    assert side["tensorrt_version"] == "10.14.1"
    assert side["plugin"]["sha256"] == sha256_file(lib)
    assert side["plugin_layers"] == 2 and side["strongly_typed"] is True
    assert side["inputs"][2] == {"name": "encoder_hidden_states_mask", "dtype": "bool",
                                 "shape": [-1, -1], "axes": ["batch", "txt_tokens"]}
    assert side["config"]["head_dim"] == 16
    assert "wrote" in captured.out
    cache = tc.read_bytes()  # the next build reads the cache back and updates it
    assert cli.main(["build", str(onnx_path), "-o", str(out), "--plugin", str(lib),
                     "--max-img-tokens", "64", "--timing-cache", str(tc)]) == 0
    assert state.timing_cache_data == cache


def test_fake_build_version_compatible_uses_registry(fake_build, tmp_path):
    trt, state, onnx_path, lib = fake_build()
    eng.build_engine(onnx_path, tmp_path / "vc.engine",
                     eng.BuildOptions(plugin=str(lib), version_compatible=True, progress=False),
                     log=io.StringIO())
    assert state.loaded == [("registry", str(lib.resolve()))]
    assert state.config.flags == ["VC"]
    assert state.config.plugins_to_serialize == [str(lib.resolve())]
    assert json.loads((tmp_path / "vc.engine.json").read_text())["version_compatible"] is True


@pytest.mark.parametrize("kw,match", [
    (dict(fallback=True), "function body"),
    (dict(registered=False), "no creator"),
    (dict(build_ok=False), "failed to build"),
])
def test_fake_build_failures_write_nothing(fake_build, tmp_path, kw, match):
    trt, state, onnx_path, lib = fake_build(**kw)
    out = tmp_path / "bad.engine"
    with pytest.raises(eng.EngineBuildError, match=match):
        eng.build_engine(onnx_path, out, eng.BuildOptions(plugin=str(lib), progress=False),
                         log=io.StringIO())
    assert not out.exists() and not Path(str(out) + ".json").exists()


@pytest.mark.parametrize("version,flags,parser_flags", [
    ("10.15.1", 1 << 1, ["ENABLE_PLUGIN_OVERRIDE"]),
    ("11.1.0", 0, ["ENABLE_PLUGIN_OVERRIDE"]),
])
def test_fake_build_newer_tensorrt(fake_build, tmp_path, version, flags, parser_flags):
    """10.15: the override flag is set; 11: no deprecated STRONGLY_TYPED flag is passed, and the
    engine is recorded as strongly typed all the same."""
    trt, state, onnx_path, lib = fake_build(version=version)
    info = eng.build_engine(onnx_path, tmp_path / "m.engine",
                            eng.BuildOptions(plugin=str(lib), progress=False), log=io.StringIO())
    assert state.flags == flags and state.parser_flags == parser_flags
    assert info.strongly_typed is True and info.tensorrt_version == version
    assert info.plugin_layers == 2


def test_fake_build_function_body_engine(fake_build, tmp_path):
    """The no-plugin engine is an option of the one builder: nothing loaded, no parser flag,
    and it must hold no QKNormRoPE plugin layer."""
    trt, state, onnx_path, lib = fake_build(version="10.15.1", registered=False, fallback=True)
    info = eng.build_engine(onnx_path, tmp_path / "np.engine",
                            eng.BuildOptions(use_plugin=False, progress=False), log=io.StringIO())
    assert state.loaded == [] and state.parser_flags == []
    assert info.plugin is None and info.plugin_layers == 0
    assert json.loads((tmp_path / "np.engine.json").read_text())["plugin"] is None
    trt, state, onnx_path, lib = fake_build(registered=True, fallback=True)
    with pytest.raises(eng.EngineBuildError, match="already registered"):
        eng.build_engine(onnx_path, tmp_path / "np2.engine",
                         eng.BuildOptions(use_plugin=False, progress=False), log=io.StringIO())


# --------------------------------------------------------------------------------------------
# Fault injection: the engine and its sidecar are replaced as a pair or not at all
# --------------------------------------------------------------------------------------------

def test_engine_and_sidecar_replaced_as_a_pair_at_every_failing_step(fake_build, tmp_path,
                                                                      monkeypatch):
    trt, state, onnx_path, lib = fake_build()
    out = tmp_path / "out"
    engine = out / "m.engine"
    side = Path(str(engine) + ".json")
    opts = eng.BuildOptions(plugin=str(lib), progress=False)
    eng.build_engine(onnx_path, engine, opts, log=io.StringIO())
    old_side = json.loads(side.read_text())
    old_side["created"] = "OLD"

    def reset_old():
        engine.write_bytes(b"\x00OLD-ENGINE")
        side.write_text(json.dumps(old_side))

    outcomes = set()

    def after(k):
        pair = (engine.read_bytes(), json.loads(side.read_text())["created"] == "OLD")
        assert pair in ((b"\x00OLD-ENGINE", True), (ft.plan_bytes(state.network_name), False)), \
            (k, pair)
        outcomes.add(pair[1])
        eng.build_engine(onnx_path, engine, opts, log=io.StringIO())  # the next run
        assert sorted(p.name for p in out.iterdir()) == ["m.engine", "m.engine.json"], k

    steps = fail_each_write_step(
        monkeypatch, lambda: eng.build_engine(onnx_path, engine, opts, log=io.StringIO()),
        reset=reset_old, after=after)
    assert len(steps) >= 2 and outcomes == {True, False}  # failures injected, the last run wrote


def test_fake_build_resolution_presets_make_one_profile_each(fake_build, tmp_path, capsys):
    """--resolutions: one IOptimizationProfile per preset, in order, all in the sidecar;
    --refit marks the sidecar's parameters refittable (REFIT_INDIVIDUAL) and the sidecar says
    refittable."""
    from qkrope import cli

    trt, state, onnx_path, lib = fake_build()
    out = tmp_path / "p.engine"
    rc = cli.main(["build", str(onnx_path), "-o", str(out), "--plugin", str(lib),
                   "--resolutions", "1024x1024,512x512,1328x1328", "--txt-tokens", "1:256",
                   "--batch", "1:2", "--refit", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert len(state.profiles) == 3
    for p, n in zip(state.profiles, (1024, 4096, 83 * 83)):
        assert p["hidden_states"] == ((1, 1, C), (2, n, C), (2, n, C))
        assert p["encoder_hidden_states"] == ((1, 1, C), (2, 256, C), (2, 256, C))
        assert p["img_cos_sin_cache"] == ((1, 16), (n, 16), (n, 16))
    assert state.config.flags == ["REFIT_INDIVIDUAL"] and state.network.marked == ["w"]
    assert "1 parameter(s) marked refittable" in captured.err
    side = eng.EngineInfo.load(out)
    assert side.refittable is True and side.refit_mode == "individual"
    assert side.profile_labels == ["512x512", "1024x1024", "1328x1328"]
    assert [p["hidden_states"]["max"] for p in side.profiles] == [[2, 1024, C], [2, 4096, C],
                                                                   [2, 83 * 83, C]]
    assert "3 profile(s)" in captured.out and "refittable" in captured.out


@pytest.mark.parametrize("parameters,flag", [(["w", "not_a_weight"], "REFIT"),
                                              (None, "REFIT")])
def test_refit_falls_back_to_every_weight(fake_build, tmp_path, capsys, parameters, flag):
    """A parameter the network has no weights for, or a sidecar without the list (an older
    export): every weight refittable (BuilderFlag.REFIT), with a warning for the first."""
    import json

    from qkrope import cli

    trt, state, onnx_path, lib = fake_build()
    side_path = Path(str(onnx_path) + ".json")
    side = json.loads(side_path.read_text())
    side["config"]["parameters"] = parameters
    side_path.write_text(json.dumps(side))
    rc = cli.main(["build", str(onnx_path), "-o", str(tmp_path / "r.engine"), "--plugin",
                   str(lib), "--refit", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert state.config.flags == [flag]
    assert ("has no weights named not_a_weight" in captured.err) == (parameters is not None)
    assert eng.EngineInfo.load(tmp_path / "r.engine").refit_mode == "all"


def test_build_announces_each_step_once(fake_build, tmp_path, capsys):
    """The build's numbered steps (off a terminal: one line each) are 1..N of one N, and the
    builder's own lines come in between."""
    from test_progress import assert_numbered_once

    from qkrope import cli

    trt, state, onnx_path, lib = fake_build()
    assert cli.main(["build", str(onnx_path), "-o", str(tmp_path / "s.engine"), "--plugin",
                     str(lib)]) == 0
    err = capsys.readouterr().err
    assert_numbered_once(err, "qkrope build")
    assert "QKNormRoPE plugin layer(s), one per ONNX node" in err
    assert eng.EngineInfo.load(tmp_path / "s.engine").refit_mode is None


def test_transformer_default_opt_is_1024_preset_not_the_sample():
    from _tiny_model import model

    m = model(with_timestep=True)
    [(label, p)] = eng.plan_profiles(m, eng.BuildOptions())
    assert label == "1024x1024"
    assert p["hidden_states"]["opt"] == (2, 4096, C)
    # an attention block keeps the export sample as opt
    [(label, p)] = eng.plan_profiles(model(), eng.BuildOptions())
    assert label == "" and p["hidden_states"]["opt"] == (2, 16, C)
    with pytest.raises(eng.prof.ProfileError, match="--txt-tokens"):
        eng.plan_profiles(m, eng.BuildOptions(resolutions=[(512, 512)], max_txt_tokens=9))


def test_every_engine_pair_on_disk_identifies_itself(tmp_path, monkeypatch):
    """write_engine_pair under every injected write failure, and the readers after it: the pair
    on disk is always one that EngineInfo.load accepts (its sidecar records that engine's
    sha256), old or new, never engine A beside sidecar B."""
    from qkrope.sidecars import EngineInfo, EngineTensor

    engine = tmp_path / "m.engine"

    def info(tag):
        return EngineInfo(tensorrt_version="10.14.1", onnx=tag,
                          inputs=[EngineTensor("x", "float32", [-1])],
                          outputs=[EngineTensor("y", "float32", [-1])], profiles=[],
                          plugin=None, plugin_layers=1, version_compatible=False,
                          strongly_typed=True)

    eng.write_engine_pair(engine, b"\x00OLD-ENGINE", info("old"))

    def after(k):
        loaded = EngineInfo.load(engine)  # raises on a mixed pair
        assert (engine.read_bytes(), loaded.onnx) in ((b"\x00OLD-ENGINE", "old"),
                                                      (b"\x00NEW-ENGINE", "new")), k

    steps = fail_each_write_step(monkeypatch,
                                 lambda: eng.write_engine_pair(engine, b"\x00NEW-ENGINE", info("new")),
                                 reset=lambda: eng.write_engine_pair(engine, b"\x00OLD-ENGINE",
                                                                     info("old")),
                                 after=after)
    assert len(steps) >= 3


def test_fake_build_reports_the_parsers_errors_in_one_line(fake_build, tmp_path, capsys):
    """parse_from_file failing: the parser's errors (num_errors / get_error, the real API) in
    one line, nothing written."""
    from qkrope import cli

    trt, state, onnx_path, lib = fake_build(parse_errors=[
        ("No importer registered for op: Attention", "node_attn", "Attention"),
        ft.ParserError("Assertion failed:\nshape mismatch", "node_mm", "MatMul",
                       code=ft.ErrorCode.INVALID_NODE, node=7)])
    out = tmp_path / "m.engine"
    rc = cli.main(["build", str(onnx_path), "-o", str(out), "--plugin", str(lib),
                   "--no-progress"])
    lines = [l for l in capsys.readouterr().err.splitlines() if "error" in l]
    assert rc == 2 and len(lines) == 1, lines  # the [build] progress lines aside
    err = lines[0]
    assert "ONNX parser rejected" in err and "(2 error(s))" in err
    assert "name: node_attn and operator: Attention" in err and "No importer registered" in err
    assert "In node 7 with name: node_mm" in err and "INVALID_NODE: Assertion failed: shape" in err
    assert not out.exists() and not Path(str(out) + ".json").exists()


def test_fake_build_refuses_to_write_over_the_default_plugin(fake_build, tmp_path, monkeypatch,
                                                             capsys):
    """Without --plugin the library is found later (the one `qkrope build-plugin` built); an
    engine path naming it is refused too, before TensorRT builds anything."""
    from qkrope import cli

    trt, state, onnx_path, lib = fake_build()
    monkeypatch.setattr(eng, "resolve_plugin_library", lambda *a, **k: lib)
    before = lib.read_bytes()
    assert cli.main(["build", str(onnx_path), "-o", str(lib), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "same file as" in err and "choose another -o" in err, err
    assert lib.read_bytes() == before and state.config is None  # no build began


def test_fake_build_names_the_network_after_its_facts(fake_build, tmp_path):
    """The engine keeps the tag of the sidecar's facts as its network name, with the write id
    its sidecar records; the sidecar as written and read back gives the same tag (its build
    time, creation time, stat record and the engine's hash are not in it), and an edit of any
    fact does not."""
    from qkrope.sidecars import WRITE_ID_SEPARATOR, EngineInfo, EngineInfoError, facts_tag

    trt, state, onnx_path, lib = fake_build()
    out = tmp_path / "m.engine"
    eng.build_engine(onnx_path, out, eng.BuildOptions(plugin=str(lib), progress=False),
                     log=io.StringIO())
    side = EngineInfo.load(out)
    assert side.config and side.write_id and side.build_seconds is not None
    assert state.network_name == facts_tag(side) + WRITE_ID_SEPARATOR + side.write_id
    assert side.network_name == state.network_name
    side.check_engine_name(state.network_name, out)  # agrees
    for edit in (lambda d: d["inputs"][0].update(role="encoder_hidden_states"),
                 lambda d: d["profiles"][0]["hidden_states"]["max"].__setitem__(0, 3),
                 lambda d: d["config"].update(axes_dims_rope=[4, 8, 4]),
                 lambda d: d.update(refit_mode="all")):
        data = side.to_dict()
        edit(data)
        with pytest.raises(EngineInfoError):
            EngineInfo.from_dict(data).check_engine_name(state.network_name, out)
    data = side.to_dict()
    data.update(build_seconds=1e9, created="2000-01-01T00:00:00Z")  # not facts: still agrees
    EngineInfo.from_dict(data).check_engine_name(state.network_name, out)


def test_a_built_engines_edited_sidecar_is_refused_without_tensorrt(fake_build, tmp_path,
                                                                    monkeypatch):
    """The engine file keeps its facts tag (the network name, in the plan as text), so readers
    that never deserialise it (caches_for, triton-repo, the build's reuse check) refuse a
    sidecar edited beside it: RoPE axes set or permuted, a profile widened, roles swapped."""
    from qkrope.runtime import caches_for
    from qkrope.sidecars import EngineInfo, EngineInfoError, engine_file_tags, facts_tag

    trt, state, onnx_path, lib = fake_build()
    out = tmp_path / "m.engine"
    eng.build_engine(onnx_path, out, eng.BuildOptions(plugin=str(lib), progress=False),
                     log=io.StringIO())
    info = EngineInfo.load(out)
    assert facts_tag(info) in engine_file_tags(out)[1]
    side = Path(str(out) + ".json")
    original = side.read_text()
    monkeypatch.delitem(sys.modules, "tensorrt")  # nothing below deserialises the engine
    for edit in (lambda d: d["config"].update(axes_dims_rope=[4, 6, 6]),
                 lambda d: d["profiles"][0]["hidden_states"]["max"].__setitem__(1, 99999),
                 lambda d: d["sample"].update(txt_len=7)):
        data = json.loads(original)
        edit(data)
        side.write_text(json.dumps(data))
        with pytest.raises(EngineInfoError, match="edited or belongs to another build"):
            EngineInfo.load(out)
        with pytest.raises(EngineInfoError, match="edited or belongs to another build"):
            caches_for(out, [(1, 2, 2)], 3)
    side.write_text(original)
    EngineInfo.load(out)  # the pair as built


@pytest.mark.parametrize("kw, match", [
    (dict(max_img_tokens=100, max_shapes={"hidden_states": (2, 999, 32)}),
     r"--max-img-tokens 100 conflicts with the --max shape\(s\) given \(hidden_states\)"),
    (dict(max_txt_tokens=32, max_shapes={"encoder_hidden_states_mask": (2, 77)}),
     r"--max-txt-tokens 32 conflicts .*its txt_tokens 77"),
    (dict(max_txt_tokens=32, txt_tokens=(1, 64)),
     "--max-txt-tokens 32 and --txt-tokens 1:64 both set the txt_tokens range"),
    (dict(max_batch=1, batch=(1, 4)), "--max-batch 1 and --batch 1:4 both set the batch range"),
])
def test_max_token_flags_are_never_silently_overridden(kw, match):
    """--max-img-tokens / --max-txt-tokens / --max-batch of an attention block's build are its
    profile's max; a range or an explicit --max shape that would override them is refused (the
    flag used to be ignored)."""
    import _tiny_model

    model = _tiny_model.model()
    assert eng.plan_profile(model, eng.BuildOptions(max_img_tokens=100))["hidden_states"][
        "max"][1] == 100
    with pytest.raises(eng.prof.ProfileError, match=match):
        eng.plan_profiles(model, eng.BuildOptions(**kw))
