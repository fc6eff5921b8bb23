"""HunyuanVideo FramePack (diffusers' HunyuanVideoFramepackTransformer3DModel) on the
hunyuan_video folder's code (qkrope/families/hunyuan_video): the "ids" caches of the history
and latent grids against diffusers' RoPE tables, the in-graph pooling of the 2x / 4x history
rows against diffusers', the patched forward bit for bit against diffusers' own in fp32, bf16 and
fp16, the check's sample request and reference arguments, one export (qkrope's own, shared by
the slow tests) run through the drop-in at shapes it never traced against diffusers' forward,
the drop-in's mapping of a pipeline call and the refusals. The tiny model is diffusers' own
FramePack test config (qkrope/families/hunyuan_video/tiny.py)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

import _hunyuan_video_models as hvm  # noqa: E402

from qkrope import contract  # noqa: E402
from qkrope.errors import InputError  # noqa: E402
from qkrope.families.hunyuan_video import HUNYUAN_VIDEO_FRAMEPACK as RECORD  # noqa: E402
from qkrope.families.hunyuan_video import dropin as hd  # noqa: E402
from qkrope.families.hunyuan_video import export as hx  # noqa: E402
from qkrope.families.hunyuan_video import tiny  # noqa: E402

VARIANT = RECORD.name
#: The index arguments of the parts in sequence order (4x history, 2x history, clean, latent).
INDICES = hvm.FRAMEPACK_INDICES
inputs = hvm.framepack_inputs


@pytest.fixture(scope="module")
def model():
    return tiny.transformer(VARIANT)


def _compact(cos, sin) -> torch.Tensor:
    """diffusers' (cos, sin) tables (repeated per pair) as the node's cache rows."""
    return torch.cat([cos[:, ::2], sin[:, ::2]], dim=1).float().contiguous()


def diffusers_cache(model, kw) -> torch.Tensor:
    """diffusers' own RoPE tables of every part's full-resolution grid, in sequence order."""
    height, width = kw["hidden_states"].shape[3:]
    return torch.cat([_compact(*model.rope(frame_indices=kw[n], height=height, width=width,
                                           device="cpu")) for n in INDICES])


def ids_cache(kw) -> torch.Tensor:
    """qkrope's "ids" scheme cache of the call's positions (framepack_ids)."""
    from qkrope.runtime.schemes import ids

    height, width = kw["hidden_states"].shape[3:]
    pos = hd.framepack_ids(height // 2, width // 2, [kw[n] for n in INDICES]).numpy()
    return torch.from_numpy(ids.cache(pos, axes_dim=(2, 4, 4), theta=256.0))


def text_cache(kw) -> torch.Tensor:
    rows = kw["image_embeds"].shape[1] + kw["encoder_hidden_states"].shape[1]
    return torch.cat([torch.ones(rows, 5), torch.zeros(rows, 5)], dim=1)


def graph_args(kw, img) -> tuple:
    names = RECORD.graph.input_names[:-2]
    return tuple((kw["hidden_states"] if n == "latent" else
                  kw[n].to(torch.int64) if n == "encoder_attention_mask" else kw[n])
                 for n in names) + (img, text_cache(kw))


# --------------------------------------------------------------------------------------------
# The caches
# --------------------------------------------------------------------------------------------

def test_ids_caches_are_diffusers_tables_within_the_float32_angle_rounding(model):
    """diffusers computes the angles in float32 (the frequencies rounded, then their products
    with the positions: two roundings of 2^-24 relative each) and rounds cos and sin to
    float32; the ids scheme computes them in float64 and rounds once. An entry of angle a may
    therefore differ by |a| * 2^-23 (the angle's error through a slope of at most 1) plus the
    two final roundings (2^-24 each): that bound, entry by entry, and no more."""
    kw = inputs()
    ref, ours = diffusers_cache(model, kw), ids_cache(kw)
    assert ours.shape == ref.shape == (sum(len(kw[n]) for n in INDICES) * 3 * 4, 10)
    height, width = kw["hidden_states"].shape[3:]
    pos = hd.framepack_ids(height // 2, width // 2, [kw[n] for n in INDICES])
    freqs = [1.0 / 256.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d) for d in (2, 4, 4)]
    angle = torch.cat([pos[:, i:i + 1].double() * f for i, f in enumerate(freqs)], dim=1)
    bound = angle.abs() * 2.0 ** -23 + 2.0 ** -23
    diff = (ours.double() - ref.double()).abs()
    assert (diff <= torch.cat([bound, bound], dim=1)).all()
    assert diff.max() > 0  # the two computations do differ: the bound is exercised


@pytest.mark.parametrize("part,kernel", [("indices_latents_history_2x", (2, 2, 2)),
                                         ("indices_latents_history_4x", (4, 4, 4))])
def test_history_rows_are_pooled_as_diffusers_pools_its_tables(model, part, kernel):
    """The export's pooling of a history part's full-resolution rows (padded by repetition,
    averaged per patch) is diffusers' on its cos and sin tables, bit for bit, at a grid that
    needs padding on every axis."""
    kw = inputs(height=6, width=10, h2=3, h4=5)
    h, w = 3, 5
    cos, sin = model.rope(frame_indices=kw[part], height=6, width=10, device="cpu")
    want = _compact(*model._pad_rotary_emb((cos, sin), h, w, kernel))
    got = hx.pooled_rows(_compact(cos, sin), len(kw[part]), h, w, kernel)
    assert got.shape == want.shape and torch.equal(got, want)
    # an average of rotations: not the rotation of any one position (cos^2 + sin^2 < 1)
    assert float((got[:, :5] ** 2 + got[:, 5:] ** 2).min()) < 0.999


# --------------------------------------------------------------------------------------------
# The patched forward against diffusers'
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_patched_forward_is_bit_exact(model, dtype):
    """The cache-input wrapper (the history patchified at 1x / 2x / 4x before the latent, the
    pooled history rows, the image projection before the text, one fused node per stream per
    attention with rounding 1, the key mask) against diffusers' forward, both given diffusers'
    own RoPE tables: equal bit for bit in fp32, bf16 and fp16 (padded text in one batch item,
    history frame counts that need padding)."""
    m = copy.deepcopy(model).to(dtype)
    kw = inputs(dtype=dtype)
    wrapper = hx.cache_input_hunyuan(copy.deepcopy(m), RECORD)
    assert wrapper.rounding == 1
    with torch.no_grad():
        want = m(**kw, return_dict=False)[0]
        got = wrapper(*graph_args(kw, diffusers_cache(model, kw)))
    assert got.dtype == want.dtype == dtype and got.shape == want.shape == (2, 4, 3, 6, 8)
    assert torch.equal(got, want)


@pytest.mark.parametrize("overrides,match", [
    (dict(has_image_proj=False), r"\['has_image_proj'\] false"),
    (dict(has_clean_x_embedder=False), r"\['has_clean_x_embedder'\] false"),
    (dict(patch_size=1), "patch_size 1 / patch_size_t 1"),
    (dict(qk_norm="layer_norm"), "qk_norm='layer_norm'")])
def test_unsupported_configs_are_refused_in_one_line(overrides, match):
    with pytest.raises(InputError, match=match) as err:
        hx.cache_input_hunyuan(tiny.transformer(VARIANT, **overrides), RECORD)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------
# The ONNX graph, run by ONNX Runtime at untraced shapes
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(tiny_root):
    """The tiny model's fp32 export by qkrope's own exporter (traced at batch 2, a 2 x 3 x 4
    token grid behind 2 / 3 / 5 history frames, 6 text and 3 image tokens): the session's
    shared one (tests/_families.py), which the family matrices read too."""
    from _families import BUILDERS

    return BUILDERS[VARIANT].exported(tiny_root)


@pytest.mark.slow
def test_dropin_runs_the_export_at_untraced_shapes_as_diffusers_does(model, exported):
    """``load_transformer(export)`` (ONNX Runtime; every frame, size and token axis dynamic)
    called as the pipeline calls ``pipe.transformer`` at batches, frame counts of every part,
    sizes and text lengths the export never traced: its prediction is ONNX Runtime's run of the
    graph on the call's inputs and ids caches bit for bit (the drop-in adds no arithmetic), and
    diffusers' forward within ``qkrope check``'s float32 bound (1e-4 x max|output| + 1e-3
    relative: the two runtimes' fp32 summation orders; the caches' angles, float64 rounded once
    against diffusers' float32 tables, add |angle| x 2^-23, far below it); three nodes (two in
    the double-stream block, one in the single-stream block)."""
    import onnx
    import onnxruntime as ort

    from qkrope.apps.check import tolerances
    from qkrope.runtime import load_transformer

    graph = onnx.load(str(exported), load_external_data=False)
    shapes = {v.name: [d.dim_param or str(d.dim_value) for d in v.type.tensor_type.shape.dim]
              for v in graph.graph.input}
    assert shapes["latents_history_4x"] == ["batch", "4", "history_4x_frames",
                                            "latent_height", "latent_width"]
    assert shapes["img_cos_sin_cache"] == ["img_cache_rows", "10"]
    assert sum(n.op_type == contract.OP_TYPE for n in graph.graph.node) == 3
    dropin = load_transformer(exported)
    session = ort.InferenceSession(str(exported), providers=["CPUExecutionProvider"])
    for size in [dict(batch=1, frames=2, height=4, width=4, clean=2, h2=2, h4=16, txt=9,
                      image=3),
                 dict(batch=3, frames=4, height=10, width=6, clean=3, h2=1, h4=6, txt=4,
                      image=2)]:
        kw = inputs(**size)
        ours = dropin(**kw, return_dict=False)[0]
        feeds = {n: v.numpy() for n, v in zip(RECORD.graph.input_names,
                                              graph_args(kw, ids_cache(kw)))}
        assert torch.equal(ours, torch.from_numpy(session.run(None, feeds)[0]))
        with torch.no_grad():
            want = model(**kw, return_dict=False)[0]
        assert ours.shape == want.shape == tuple(kw["hidden_states"].shape)
        (atol, rtol), = tolerances("fp32", {"out": want.numpy()}, model="transformer").values()
        assert torch.allclose(ours, want, atol=atol, rtol=rtol)
        assert not torch.equal(ours, want)  # two runtimes: the bound is exercised


# --------------------------------------------------------------------------------------------
# The drop-in: the mapping of a pipeline call (on a stand-in runner)
# --------------------------------------------------------------------------------------------

def _dropin():
    cfg = tiny.VARIANTS[VARIANT][1]
    config = SimpleNamespace(diffusers_config={**cfg, "_class_name": RECORD.class_name},
                             num_layers_exported=None, axes_dims_rope=list(cfg["rope_axes_dim"]),
                             rope_theta=256, family=RECORD.name)
    spec = SimpleNamespace(dtype="fp32")
    io = SimpleNamespace(config=config, roles={"timestep": "timestep",
                                               "hidden_states": "hidden_states"},
                         input=lambda name: spec, head_dim=cfg["attention_head_dim"],
                         source="stand-in.onnx")
    runner = SimpleNamespace(io=io, device=torch.device("cpu"), backend="stand-in")
    return hd.dropin_class(RECORD)(runner, RECORD)


def test_dropin_maps_a_pipeline_call_onto_the_graph(model):
    """HunyuanVideoFramepackPipeline's call (keywords) becomes the graph's inputs: the history
    latents by their role, the ids request whose caches (the scheme's, the text rows identity)
    are the ids cache of the call's positions, in the graph's row order."""
    transformer = _dropin()
    kw = inputs(batch=1, frames=2, height=4, width=4, clean=2, h2=2, h4=16, txt=9, image=3)
    call = transformer.prepare(**kw)
    assert set(call.conditioning) == {"pooled_projections", "image_embeds", "guidance",
                                      "latents_clean", "latents_history_2x",
                                      "latents_history_4x"}
    caches = transformer.rope_caches(call)
    assert torch.equal(caches.img, ids_cache(kw))
    assert torch.equal(caches.txt, text_cache(kw))


@pytest.mark.parametrize("change,match", [
    (dict(latents_history_2x=None), "needs latents_history_2x; got None"),
    (dict(indices_latents_clean=torch.arange(3)),
     "indices_latents_clean has 3 frame indices but latents_clean has 2 frames"),
    (dict(latents_clean=torch.zeros(2, 4, 2, 6, 4)), "must have the batch, height and width"),
    (dict(guidance=None), "needs guidance=\\[batch\\]"),
    (dict(attention_kwargs={"scale": 0.5}), "attention_kwargs")])
def test_dropin_refuses_what_the_graph_cannot_take_in_one_line(change, match):
    with pytest.raises(InputError, match=match) as err:
        _dropin().prepare(**{**inputs(), **change})
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------
# The export plan (export_transformer's hook) and the check's sample and reference
# --------------------------------------------------------------------------------------------

def test_export_plan_traces_the_graph_inputs_in_order(model):
    """``plan`` of a sample grid: the wrapper, the sample in the record's graph order (the
    history latents at frame counts that need padding), the ids caches of the sample's frame
    indices (diffusers' tables of those indices within the float32 angle rounding), the axis
    values of the image tokens, the history frames and the caches, three nodes."""
    sample = SimpleNamespace(img_shapes=[(3, 3, 4)], txt_len=6, batch=2)
    plan = hx.plan(RECORD, copy.deepcopy(model), sample=sample, dtype=torch.float32)
    assert plan.decl is RECORD.graph and plan.nodes == 3 == hx.node_count(model)
    by_name = dict(zip(RECORD.graph.input_names, plan.args))
    assert [len(a.shape) for a in plan.args] == [len(t.axes) for t in RECORD.graph.inputs]
    assert [by_name[n].shape[2] for n in ("latents_clean", "latents_history_2x",
                                          "latents_history_4x")] == [2, 3, 5]
    assert tuple(by_name["latent"].shape) == (2, 4, 3, 6, 8)
    indices = hd.framepack_sample_indices(3)
    kw = {**dict(zip(INDICES, indices)), "hidden_states": by_name["latent"]}
    assert torch.allclose(by_name["img_cos_sin_cache"], diffusers_cache(model, kw), rtol=0,
                          atol=2.0 ** -18)
    assert plan.axis_values == {"image_embed_tokens": 3, "img_cache_rows": (5 + 3 + 2 + 3) * 3 * 4,
                                "txt_cache_rows": 3 + 6, "clean_frames": 2,
                                "history_2x_frames": 3, "history_4x_frames": 5}
    with torch.no_grad():
        out = plan.wrapper(*plan.args)
    assert out.shape == by_name["latent"].shape and torch.isfinite(out).all()


def test_check_sample_and_reference_are_the_traced_layout(model):
    """``qkrope check``'s sample of a FramePack export: the drop-in hook's sample request of a
    latent grid is the traced sample's ids (its caches equal the plan's bit for bit), and the
    reference hook gives diffusers the frame indices of that layout, read from the latent's and
    the history latents' frames: diffusers' forward on them is the wrapper's on the request's
    caches within the check's own float32 bound (the caches' angles float64 rounded once
    against diffusers' float32 tables)."""
    from qkrope.apps.check import tolerances
    from qkrope.families.hunyuan_video import reference
    from qkrope.runtime.caches import build_rope_caches, checked_setting

    sample = SimpleNamespace(img_shapes=[(3, 3, 4)], txt_len=6, batch=2)
    plan = hx.plan(RECORD, copy.deepcopy(model), sample=sample, dtype=torch.float32)
    by_name = dict(zip(RECORD.graph.input_names, plan.args))
    request = hd.sample_request(RECORD, sample.img_shapes, 3 + sample.txt_len)
    caches = build_rope_caches("ids", request, checked_setting(
        "ids", *hx.rope_setting(model), rotated=RECORD.rotated))
    assert torch.equal(caches.img, by_name["img_cos_sin_cache"])
    assert torch.equal(caches.txt, by_name["txt_cos_sin_cache"])
    by_role = {t.role: by_name[t.name] for t in RECORD.graph.inputs}
    info = SimpleNamespace(config=SimpleNamespace(diffusers_config=dict(model.config)))
    kw = reference.forward_kwargs(info, by_role, sample.img_shapes)
    for name, want in zip(INDICES, hd.framepack_sample_indices(3)):
        assert torch.equal(kw[name], want), name
    with torch.no_grad():
        want = model(**kw)[0]
        got = plan.wrapper(*plan.args)
    (atol, rtol), = tolerances("fp32", {"out": want.numpy()}, model="transformer").values()
    assert torch.allclose(got, want, atol=atol, rtol=rtol)
    assert not torch.equal(got, want)  # the caches' angles differ: the bound is exercised


@pytest.mark.slow
def test_triton_repo_refuses_the_history_latents_in_one_line(exported, tmp_path, capsys):
    """The rope model counts the latent's tokens alone, so a repository for a model that joins
    history latents before its latent is refused before anything is written."""
    from qkrope.cli import main

    repo = tmp_path / "repo"
    rc = main(["triton-repo", "--backend", "onnxruntime", "--onnx", str(exported),
               "-o", str(repo)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and not repo.exists()
    assert len(err) == 1 and "history latents" in err[0] and "Fix:" in err[0], err
