"""What a deployer uses without reading the code, on a tiny exported diffusers transformer:
``caches_for`` (the caches of any exported model, from its sidecar or its metadata), the session
options of ``load`` / ``load_transformer``, the drop-in taking what diffusers takes (strided
views, a 0-dim timestep) and refusing junk with one line, bounded output buffers, ONNX Runtime's
load failures as user errors, and the memory script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from qkrope.errors import InputError, QkropeError
from qkrope.runtime import build_qwen_rope_caches, caches_for, load
from qkrope.runtime import loader_onnxrt, loader_tensorrt, runner_tensorrt, trt_utils
from qkrope.runtime import runner as rn
from qkrope.sidecars import EngineInfo, EngineTensor

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

from qkrope.apps import tiny_pipeline as tp  # noqa: E402
from qkrope.runtime import load_transformer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
AXES = tuple(tp.TRANSFORMER_CONFIG["axes_dims_rope"])  # (8, 12, 12): not Qwen-Image's
CH, TXT_DIM = tp.TRANSFORMER_CONFIG["in_channels"], tp.TRANSFORMER_CONFIG["joint_attention_dim"]


@pytest.fixture(scope="module")
def onnx_path(tmp_path_factory):
    from _tiny_model import export_tiny_transformer

    return export_tiny_transformer(tmp_path_factory.mktemp("deploy"))[1]


@pytest.fixture(scope="module")
def transformer(onnx_path):
    return load_transformer(onnx_path)


def _args(batch=2, h=4, w=4, txt=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, h * w, CH, generator=g), torch.randn(batch, txt, TXT_DIM, generator=g),
            torch.ones(batch, txt, dtype=torch.long), torch.full((batch,), 0.5))


# --------------------------------------------------------------------------------------------
# caches_for
# --------------------------------------------------------------------------------------------

def test_caches_for_reads_the_models_axes_where_the_default_fails(onnx_path):
    hs, ehs, mask, ts = _args()
    runner = load(onnx_path)
    qwen = build_qwen_rope_caches([(1, 4, 4)], 7)  # Qwen-Image's (16, 56, 56): 128 wide
    with pytest.raises(QkropeError, match="got 128"):
        runner(hs, ehs, qwen, mask.bool(), ts)
    caches = caches_for(onnx_path, [(1, 4, 4)], 7)
    want = build_qwen_rope_caches([(1, 4, 4)], 7, axes_dim=AXES)
    assert torch.equal(caches.img, want.img) and torch.equal(caches.txt, want.txt)
    out = runner(hs, ehs, caches, mask.bool(), ts)
    assert out.shape == hs.shape[:2] + (tp.TRANSFORMER_CONFIG["out_channels"] * 4,)
    # the plain ONNX Runtime session takes them as numpy arrays
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    (plain,) = sess.run(None, {"hidden_states": hs.numpy(), "encoder_hidden_states": ehs.numpy(),
                               "encoder_hidden_states_mask": mask.bool().numpy(),
                               "timestep": ts.numpy(), "img_cos_sin_cache": caches.img.numpy(),
                               "txt_cos_sin_cache": caches.txt.numpy()})
    assert np.allclose(plain, out.numpy(), atol=1e-5)


def test_caches_for_without_a_sidecar_reads_the_models_metadata(onnx_path, tmp_path):
    alone = tmp_path / "alone.onnx"
    shutil.copy(onnx_path, alone)
    caches = caches_for(alone, [[(1, 2, 3)]] * 2, 5)  # diffusers' per-batch form
    want = build_qwen_rope_caches([(1, 2, 3)], 5, axes_dim=AXES)
    assert torch.equal(caches.img, want.img) and torch.equal(caches.txt, want.txt)


def test_caches_for_refuses_a_sidecar_whose_axes_do_not_fit_the_model(onnx_path, tmp_path):
    bad = tmp_path / "bad.onnx"
    shutil.copy(onnx_path, bad)
    side = json.loads(Path(str(onnx_path) + ".json").read_text())
    side["config"]["axes_dims_rope"] = [16, 56, 56]
    Path(str(bad) + ".json").write_text(json.dumps(side))
    # the sidecar disagrees with the model's own metadata_props: refused before any cache is made
    with pytest.raises(QkropeError, match="disagrees with its model"):
        caches_for(bad, [(1, 4, 4)], 7)
    with pytest.raises(InputError, match="suffix '.bin'"):
        caches_for(_touch(tmp_path / "x.bin"), [(1, 4, 4)], 7)
    with pytest.raises(QkropeError, match="does not exist"):
        caches_for(tmp_path / "nothere.onnx", [(1, 4, 4)], 7)


def _touch(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def _engine_sidecar(tmp_path, onnx_path) -> Path:
    side = json.loads(Path(str(onnx_path) + ".json").read_text())
    names = {t["name"]: t["shape"] for t in side["inputs"]}

    def prof(img, txt, batch):  # min 1, opt = max = these sizes
        sizes = {"batch": batch, "img_tokens": img, "txt_tokens": txt, "img_cache_rows": img,
                 "txt_cache_rows": txt}

        def dims(shape, level):
            return [d if isinstance(d, int) else 1 if level == "min" else sizes[d] for d in shape]

        return {n: {lv: dims(shape, lv) for lv in ("min", "opt", "max")}
                for n, shape in names.items()}

    engine = tmp_path / "t.engine"
    engine.write_bytes(b"not read by caches_for")
    EngineInfo(tensorrt_version="10.14", onnx=str(onnx_path),
               inputs=[EngineTensor(n, "float32", [-1 if isinstance(d, str) else d for d in s],
                                    [d if isinstance(d, str) else None for d in s])
                       for n, s in names.items()],
               outputs=[EngineTensor("output", "float32", [-1, -1, 16])],
               profiles=[prof(256, 64, 2), prof(1024, 16, 1)], plugin=None, plugin_layers=4,
               version_compatible=False, strongly_typed=True, config=side["config"],
               profile_labels=["256x256", "512x512"]).save(engine)
    return engine


def test_caches_for_an_engine_refuses_what_no_profile_holds(onnx_path, tmp_path):
    engine = _engine_sidecar(tmp_path, onnx_path)
    assert caches_for(engine, [(1, 16, 16)], 64, batch=2).img.shape == (256, 32)
    assert caches_for(engine, [(1, 32, 32)], 16, batch=1).img.shape == (1024, 32)
    with pytest.raises(InputError, match=r"cannot serve 1024 image tokens, 64 text tokens.*"
                                         r"profile 0 \(256x256\): img_cos_sin_cache 1..256"):
        caches_for(engine, [(1, 32, 32)], 64)
    with pytest.raises(InputError, match="batch 2"):
        caches_for(engine, [(1, 32, 32)], 16, batch=2)
    with pytest.raises(InputError, match="batch must be >= 1"):
        caches_for(engine, [(1, 16, 16)], 64, batch=0)


def test_cache_inputs_doc_strings_name_caches_for(onnx_path):
    import onnx

    docs = {i.name: i.doc_string for i in onnx.load(str(onnx_path)).graph.input}
    assert "qkrope.runtime.caches_for" in docs["img_cos_sin_cache"]
    assert "qkrope.runtime.caches_for" in docs["txt_cos_sin_cache"]


# --------------------------------------------------------------------------------------------
# load / load_transformer options
# --------------------------------------------------------------------------------------------

def test_default_session_options_turn_memory_patterns_off(onnx_path):
    r = load(onnx_path)
    assert r.session.get_session_options().enable_mem_pattern is False
    assert r.session.get_session_options().enable_cpu_mem_arena is True


def test_sess_options_and_provider_options_pass_through(onnx_path):
    so = ort.SessionOptions()
    so.enable_mem_pattern = True
    so.intra_op_num_threads = 1
    r = load(onnx_path, sess_options=so, providers=["CPUExecutionProvider"],
             provider_options=[{}])
    got = r.session.get_session_options()
    assert got.enable_mem_pattern is True and got.intra_op_num_threads == 1
    t = load_transformer(onnx_path, sess_options=so)
    assert t._runner.session.get_session_options().intra_op_num_threads == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(providers=["NopeExecutionProvider"]), r"providers \['NopeExecutionProvider'\] are "
                                                r"not available"),
    (dict(provider_options=[{}, {}]), "one dict per provider"),
    (dict(sess_options={"enable_mem_pattern": False}), "must be an onnxruntime.SessionOptions"),
    (dict(cuda_graph=True), "cuda_graph=True replays CUDA graphs of a TensorRT engine"),
])
def test_bad_options_are_one_line_errors(onnx_path, kwargs, match):
    with pytest.raises(rn.RunnerError, match=match):
        load(onnx_path, **kwargs)
    with pytest.raises(rn.RunnerError, match=match):
        load_transformer(onnx_path, **kwargs)


def test_onnx_runtime_options_on_an_engine_are_refused(tmp_path):
    engine = tmp_path / "m.engine"
    engine.write_bytes(b"\x00" * 16)
    with pytest.raises(rn.RunnerError, match="sess_options are ONNX Runtime options"):
        load(engine, sess_options=ort.SessionOptions())


def test_cuda_graph_reaches_the_tensorrt_runner(monkeypatch, tmp_path):
    seen = {}

    class Stop(Exception):
        pass

    def fake(self, loaded, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(loader_tensorrt, "engine_from_path", lambda path, **options: None)
    monkeypatch.setattr(runner_tensorrt.TensorRTRunner, "__init__", fake)
    monkeypatch.setattr(trt_utils, "check_engine_file", lambda p: None)
    engine = tmp_path / "m.engine"
    engine.write_bytes(b"\x00" * 16)
    with pytest.raises(Stop):
        load_transformer(engine, cuda_graph=True)
    assert seen["cuda_graph"] is True


def test_onnx_runtime_load_failures_are_one_line_user_errors(tmp_path):
    import onnx
    from onnx import helper, numpy_helper

    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", 1, [1, 4])],
                              [helper.make_tensor_value_info("y", 1, [1, 4])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="m.bin", size_threshold=0)
    (tmp_path / "m.bin").unlink()  # the external data is gone: refused before ONNX Runtime
    with pytest.raises(QkropeError) as info:
        loader_onnxrt.session_from_onnx(path)
    msg = str(info.value)
    assert "m.bin" in msg and "missing" in msg and "\n" not in msg and "Fix:" in msg
    # a model ONNX Runtime itself refuses (a MatMul of incompatible shapes): its Fail, one line
    w5 = numpy_helper.from_array(np.ones((5, 4), np.float32), "w")
    bad = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", 1, [1, 4])],
        [helper.make_tensor_value_info("y", 1, [1, 4])], [w5]),
        opset_imports=[helper.make_opsetid("", 18)])
    bad.ir_version = 10
    onnx.save(bad, str(tmp_path / "mm.onnx"))
    with pytest.raises(rn.RunnerError) as info:
        loader_onnxrt.session_from_onnx(tmp_path / "mm.onnx")
    msg = str(info.value)
    assert "ONNX Runtime could not load" in msg and "Incompatible dimensions" in msg
    assert "\n" not in msg and "Fix:" in msg


# --------------------------------------------------------------------------------------------
# The drop-in takes what diffusers takes
# --------------------------------------------------------------------------------------------

def test_drop_in_makes_strided_inputs_contiguous_the_runner_refuses_them(onnx_path, transformer):
    hs, ehs, mask, ts = _args(txt=9)
    wide = torch.randn(2, 9, TXT_DIM * 2)
    wide[..., ::2] = ehs
    strided = wide[..., ::2]  # a view: not contiguous
    assert not strided.is_contiguous()
    img = [[(1, 4, 4)]] * 2
    (want,) = transformer(hs, ehs, mask, ts, img_shapes=img, return_dict=False)
    (got,) = transformer(hs, strided, mask, ts, img_shapes=img, return_dict=False)
    assert torch.equal(got, want)
    runner = load(onnx_path)
    with pytest.raises(rn.RunnerInputError, match=r"must be contiguous.*\.contiguous\(\)"):
        runner(hs, strided, caches_for(onnx_path, [(1, 4, 4)], 9), mask.bool(), ts)


def test_drop_in_takes_a_0_dim_timestep(transformer):
    hs, ehs, mask, ts = _args()
    img = [[(1, 4, 4)]] * 2
    (want,) = transformer(hs, ehs, mask, ts, img_shapes=img, return_dict=False)
    (got,) = transformer(hs, ehs, mask, torch.tensor(0.5), img_shapes=img, return_dict=False)
    assert torch.equal(got, want)
    (got,) = transformer(hs, ehs, mask, 0.5, img_shapes=img, return_dict=False)
    assert torch.equal(got, want)


@pytest.mark.parametrize("value, shown", [
    ("seven", "'seven'"), (7, "7"), ([7.5, 7], r"\[7.5, 7\]"), ([None, 7], r"\[None, 7\]"),
    ([[7], [7]], r"\[\[7\], \[7\]\]"), ([7], r"\[7\]"), ([7, 99], r"\[7, 99\]"),
    ([-1, 7], r"\[-1, 7\]"),
])
def test_drop_in_refuses_junk_txt_seq_lens_in_one_line(transformer, value, shown):
    hs, ehs, mask, ts = _args()
    with pytest.raises(InputError, match=r"txt_seq_lens must be a list of 2 integer text "
                                         rf"lengths .*; got {shown}\. Fix: pass "
                                         r"prompt_embeds_mask\.sum\(dim=1\)\.tolist\(\)"):
        transformer(hs, ehs, mask, ts, img_shapes=[[(1, 4, 4)]] * 2, txt_seq_lens=value)
    transformer(hs, ehs, mask, ts, img_shapes=[[(1, 4, 4)]] * 2, txt_seq_lens=[7, 5])
    transformer(hs, ehs, mask, ts, img_shapes=[[(1, 4, 4)]] * 2,
                txt_seq_lens=torch.tensor([7, 7]))


@pytest.mark.parametrize("value, match", [
    ("scale", "attention_kwargs must be a dict"),
    (np.array([1.0, 2.0]), "attention_kwargs must be a dict"),
    ({"scale": torch.tensor([1.0, 2.0])}, "cannot be honoured"),
    ({"scale": True}, "cannot be honoured"),
    ({1: 2, "a": 3}, "cannot be honoured"),
    ({"scale": 0.5}, "cannot be honoured"),
])
def test_drop_in_refuses_junk_attention_kwargs_in_one_line(transformer, value, match):
    hs, ehs, mask, ts = _args()
    with pytest.raises(InputError, match=match):
        transformer(hs, ehs, mask, ts, img_shapes=[[(1, 4, 4)]] * 2, attention_kwargs=value)
    for fine in (None, {}, {"scale": 1.0}, {"scale": torch.tensor(1.0)}):
        transformer(hs, ehs, mask, ts, img_shapes=[[(1, 4, 4)]] * 2, attention_kwargs=fine)


# --------------------------------------------------------------------------------------------
# Bounded memory
# --------------------------------------------------------------------------------------------

def test_output_buffers_are_bounded_across_shapes(onnx_path):
    r = load(onnx_path)
    for txt in range(3, 9):  # six text lengths
        hs, ehs, mask, ts = _args(txt=txt)
        r(hs, ehs, caches_for(onnx_path, [(1, 4, 4)], txt), None, ts)
    kept = r._buffers()
    assert kept and all(len(per_shape) <= rn.BUFFERS_PER_NAME for per_shape in kept.values())
    assert len(kept["__mask__"]) == rn.BUFFERS_PER_NAME  # the default masks too


def test_memory_script_growth_is_bounded_and_was_not_with_memory_patterns(onnx_path):
    script = ROOT / "scripts" / "memory_growth.py"
    fixed = subprocess.run([sys.executable, str(script), "--model", str(onnx_path)],
                           capture_output=True, text=True)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "growth +" in fixed.stdout and "(< 25 %)" in fixed.stdout
    before = subprocess.run([sys.executable, str(script), "--model", str(onnx_path),
                             "--mem-pattern"], capture_output=True, text=True)
    assert before.returncode == 1, before.stdout + before.stderr  # ONNX Runtime's own default
    assert "(>= 25 %)" in before.stdout


# --------------------------------------------------------------------------------------------
# Plain ONNX Runtime errors point at the cache
# --------------------------------------------------------------------------------------------

def test_function_body_nodes_are_named_for_what_they_serve(onnx_path):
    import onnx

    from qkrope.export.onnx_function import BODY_NODE_PREFIX

    (fn,) = onnx.load(str(onnx_path)).functions
    names = [n.name for n in fn.node]
    assert all(n.startswith(BODY_NODE_PREFIX) for n in names) and len(set(names)) == len(names)
    assert any("q: Mul(q_ac) uses the cos_sin_cache rows of q's tokens" in n for n in names)
    hs, ehs, mask, ts = _args()
    caches = caches_for(onnx_path, [(1, 4, 4)], 7)
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception) as info:  # ONNX Runtime's own Fail: too few image cache rows
        sess.run(None, {"hidden_states": hs.numpy(), "encoder_hidden_states": ehs.numpy(),
                        "encoder_hidden_states_mask": mask.bool().numpy(), "timestep": ts.numpy(),
                        "img_cos_sin_cache": caches.img.numpy()[:10],
                        "txt_cos_sin_cache": caches.txt.numpy()})
    assert "uses the cos_sin_cache rows of" in str(info.value)


def test_check_reports_onnx_runtime_failures_in_one_line(onnx_path, tmp_path, capsys):
    """`qkrope check` of a model whose external data is gone: ONNX Runtime's Fail, one line."""
    import onnx

    from qkrope.cli import main
    from qkrope.sidecars import ModelInfo

    moved = tmp_path / "ext.onnx"
    onnx.save(onnx.load(str(onnx_path)), str(moved), save_as_external_data=True,
              location="ext.onnx.data", size_threshold=0)
    ModelInfo.load(onnx_path).save(moved)  # the sidecar, describing the re-saved file
    (tmp_path / "ext.onnx.data").unlink()
    capsys.readouterr()
    assert main(["check", str(moved)]) == 2
    err = capsys.readouterr().err.strip()
    # refused before ONNX Runtime runs (the external-data check), in one line naming the file
    assert "ext.onnx.data" in err and "missing" in err and "\n" not in err, err


def test_caches_for_an_engine_builds_nothing_for_a_refused_request(onnx_path, tmp_path,
                                                                   monkeypatch):
    """Every check comes before a cache is built or memoised: a request no profile holds, a
    width the model does not have, an unknown device, leave the memo as it was (they used to
    build and keep the tables first)."""
    import qkrope.runtime.caches as caches_mod

    engine = _engine_sidecar(tmp_path, onnx_path)
    caches_mod._build_cached.cache_clear()
    built = []
    real = caches_mod._build_cached._build
    monkeypatch.setattr(caches_mod._build_cached, "_build", lambda *k: built.append(k) or real(*k))
    for request, match in (((engine, [(1, 64, 64)], 64), "cannot serve 4096 image tokens"),
                           ((engine, [(1, 16, 16)], 4096), "cannot serve 256 image tokens, "
                                                           "4096 text tokens")):
        with pytest.raises(InputError, match=match):
            caches_for(*request)
    for device in ("gpu", "cuda:99", "nonsense:0", 3.5):
        with pytest.raises(InputError, match="device") as exc:
            caches_for(engine, [(1, 16, 16)], 64, device=device)
        assert "\n" not in str(exc.value)
    assert built == [] and len(caches_mod._build_cached) == 0
    caches_for(engine, [(1, 16, 16)], 64)
    assert len(built) == 1 and len(caches_mod._build_cached) == 1


def test_the_cache_memo_is_bounded_in_bytes(monkeypatch):
    """The memo keeps at most MEMO_BYTES of tensors (least recently used out first), and a
    pair larger than the whole bound is returned without being kept."""
    import qkrope.runtime.caches as caches_mod

    memo = caches_mod._build_cached
    memo.cache_clear()
    monkeypatch.setattr(memo, "limit", 3 * (64 + 8) * 128 * 4)  # three (8x8 image, 8 text) pairs
    pair = lambda n: build_qwen_rope_caches([(1, 8, 8)], n)  # noqa: E731 - 72 rows x 128 fp32
    a = pair(8)
    assert pair(8) is a and memo.nbytes == (64 + 8) * 128 * 4
    pair(9), pair(10)
    assert memo.nbytes <= memo.limit and len(memo) == 2  # 73 + 74 rows: a third does not fit
    assert pair(8) is not a                              # a went first (least recently used)
    big = build_qwen_rope_caches([(1, 64, 64)], 64)      # larger than the whole bound
    assert build_qwen_rope_caches([(1, 64, 64)], 64) is not big and memo.nbytes <= memo.limit
    memo.cache_clear()


def test_load_transformer_and_build_refuse_an_unknown_device_in_one_line(onnx_path):
    from qkrope.runtime.caches import checked_device

    assert checked_device(None) == torch.device("cpu") and checked_device("cpu").type == "cpu"
    for device in ("gpu", "cuda:99", "", True, [0]):
        with pytest.raises(InputError, match="device"):
            build_qwen_rope_caches([(1, 2, 2)], 3, device=device)
        with pytest.raises(QkropeError, match="device"):
            load_transformer(onnx_path, device=device)


def test_an_edited_engine_sidecar_is_refused_by_caches_for_and_triton_repo(onnx_path, tmp_path,
                                                                          capsys):
    """An engine sidecar whose axes_dims_rope was permuted (same sum: the widths still fit)
    would make caches_for and triton-repo compute other caches: the engine file carries the
    tag of its sidecar's facts (its network name, kept by the plan as text; this stand-in plan
    holds it as qkrope build names the network), so the edit is refused before anything runs.
    The unedited pair is served."""
    from qkrope.cli import main
    from qkrope.sidecars import EngineInfoError, facts_tag

    engine = _engine_sidecar(tmp_path, onnx_path)
    info = EngineInfo.load(engine)
    engine.write_bytes(b"PLAN\0" + facts_tag(info).encode() + b"\0weights")
    info.save(engine)
    assert caches_for(engine, [(1, 16, 16)], 64).img.shape == (256, 32)
    side = Path(str(engine) + ".json")
    data = json.loads(side.read_text())
    data["config"]["axes_dims_rope"] = data["config"]["axes_dims_rope"][::-1]  # (12, 12, 8)
    assert data["config"]["axes_dims_rope"] != list(AXES)
    side.write_text(json.dumps(data))
    with pytest.raises(EngineInfoError, match="edited or belongs to another build"):
        caches_for(engine, [(1, 16, 16)], 64)
    capsys.readouterr()
    assert main(["triton-repo", "--engine", str(engine), "-o", str(tmp_path / "repo")]) == 2
    err = capsys.readouterr().err
    assert "edited or belongs to another build" in err and err.count("\n") == 1, err
    assert not (tmp_path / "repo").exists()


def test_caches_for_junk_model_paths_are_one_line(tmp_path):
    """A model path that is no path, or a file without a sidecar that is no ONNX model: one
    InputError-like line (protobuf's DecodeError and TypeError used to escape)."""
    rand = tmp_path / "rand.onnx"
    rand.write_bytes(bytes(range(256)) * 8)
    text = tmp_path / "text.onnx"
    text.write_text("hello\n")
    for path, match in ((rand, "is not a readable ONNX model"),
                        (text, "is not a readable ONNX model"),
                        (5, "model_path must be the path"), (None, "model_path must be the path")):
        with pytest.raises(QkropeError, match=match) as exc:
            caches_for(path, [(1, 2, 2)], 3)
        assert "\n" not in str(exc.value)
