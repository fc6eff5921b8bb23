"""HunyuanVideo FramePack (diffusers' HunyuanVideoFramepackTransformer3DModel) on the
hunyuan_video folder's code (qkrope/families/hunyuan_video): the "ids" caches of the history
and latent grids against diffusers' RoPE tables, the in-graph pooling of the 2x / 4x history
rows against diffusers', the patched forward bit for bit against diffusers' own in fp32, bf16 and
fp16, the export run by ONNX Runtime at shapes it never traced, the drop-in's mapping of a
pipeline call and the refusals. The tiny model is diffusers' own FramePack test config
(qkrope/families/hunyuan_video/tiny.py).

The record is not registered yet: its history latents need TensorDecls, roles and frame axes in
qkrope.model_io (the export test adds the record's declarations to model_io's tables for its
duration, which is what registering them would do)."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

import qkrope.families.hunyuan_video as hv  # noqa: E402
from qkrope.errors import InputError  # noqa: E402
from qkrope.families.hunyuan_video import HUNYUAN_VIDEO_FRAMEPACK as RECORD  # noqa: E402
from qkrope.families.hunyuan_video import dropin as hd  # noqa: E402
from qkrope.families.hunyuan_video import export as hx  # noqa: E402
from qkrope.families.hunyuan_video import tiny  # noqa: E402

VARIANT = RECORD.name
#: The index arguments of the parts in sequence order (4x history, 2x history, clean, latent).
INDICES = ("indices_latents_history_4x", "indices_latents_history_2x", "indices_latents_clean",
           "indices_latents")


@pytest.fixture(scope="module")
def model():
    return tiny.transformer(VARIANT)


def inputs(*, batch=2, frames=3, height=6, width=8, clean=2, h2=3, h4=5, txt=7, image=5,
           seed=3, dtype=torch.float32) -> dict:
    """diffusers' forward keywords (the pipeline's call) for a ``frames x height x width``
    latent behind ``clean`` / ``h2`` / ``h4`` history frames, with padded text in the last batch
    item; frame indices as the inverted anti-drifting sampling lays them out (the clean part is
    the first frame and the newest history frame: not contiguous)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    mask = torch.ones(batch, txt)
    mask[-1, txt // 2:] = 0
    start = 1 + frames
    return dict(
        hidden_states=rand(batch, 4, frames, height, width),
        timestep=torch.linspace(900.0, 100.0, batch).to(dtype),
        encoder_hidden_states=rand(batch, txt, 16), encoder_attention_mask=mask,
        pooled_projections=rand(batch, 8), image_embeds=rand(batch, image, 16),
        indices_latents=torch.arange(1, start), guidance=torch.full((batch,), 6.0).to(dtype),
        latents_clean=rand(batch, 4, clean, height, width),
        indices_latents_clean=torch.cat([torch.zeros(1, dtype=torch.int64),
                                         torch.arange(start, start + clean - 1)]),
        latents_history_2x=rand(batch, 4, h2, height, width),
        indices_latents_history_2x=torch.arange(start + clean - 1, start + clean - 1 + h2),
        latents_history_4x=rand(batch, 4, h4, height, width),
        indices_latents_history_4x=torch.arange(start + clean - 1 + h2,
                                                start + clean - 1 + h2 + h4))


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

def _export(model, path, fused: bool):
    """The wrapper traced as qkrope's export traces it (export.trace._torch_export: dynamic
    named axes, the node translated, the function body added), with the record's history
    declarations in model_io's tables."""
    import onnx_ir as ir

    from qkrope import model_io
    from qkrope.export.finalize import finalize_model
    from qkrope.export.trace import _torch_export

    new = {t.name: t for t in (hv.LATENTS_CLEAN, hv.LATENTS_HISTORY_2X, hv.LATENTS_HISTORY_4X)}
    axes = model_io.AXES + (hv.CLEAN_FRAMES, hv.HISTORY_2X_FRAMES, hv.HISTORY_4X_FRAMES)
    wrapper = hx.cache_input_hunyuan(copy.deepcopy(model), RECORD, fused=fused)
    kw = inputs()
    decl = RECORD.graph
    with mock.patch.dict(model_io.TENSORS, new), mock.patch.object(model_io, "AXES", axes):
        graph = _torch_export(wrapper, graph_args(kw, ids_cache(kw)), decl.input_names,
                              decl.output_names, 20, parameters_of="transformer",
                              patch=(1, 2, 2))
    finalize_model(graph, opset=20, head_dim=10, rotary_dim=10,
                   expected_nodes=hx.node_count(model) if fused else 0)
    ir.save(graph, str(path))
    return graph


@pytest.mark.slow
def test_onnx_runtime_at_untraced_shapes(model, tmp_path):
    """The export (traced at batch 2, a 3 x 6 x 8 latent behind 2 / 3 / 5 history frames, 7
    text and 5 image tokens; every frame, size and token axis dynamic) run by ONNX Runtime at
    other batches, frame counts of every part, sizes and text lengths, with qkrope's ids caches,
    against diffusers' forward in float64: the error is at most twice that of the reference
    graph (the same export with diffusers' norm and rotation in place of the nodes) on the same
    caches; three nodes (two in the double-stream block, one in the single-stream block)."""
    import onnxruntime as ort

    graph = _export(model, tmp_path / "fused.onnx", True)
    _export(model, tmp_path / "reference.onnx", False)
    shapes = {v.name: [str(d) for d in v.shape] for v in graph.graph.inputs}
    assert shapes["latents_history_4x"] == ["batch", "4", "history_4x_frames",
                                            "latent_height", "latent_width"]
    assert shapes["img_cos_sin_cache"] == ["img_cache_rows", "10"]
    sessions = [ort.InferenceSession(str(tmp_path / f"{n}.onnx"),
                                     providers=["CPUExecutionProvider"])
                for n in ("fused", "reference")]
    double = copy.deepcopy(model).double()
    for size in [dict(batch=1, frames=2, height=4, width=4, clean=2, h2=2, h4=16, txt=9,
                      image=3),
                 dict(batch=3, frames=4, height=10, width=6, clean=3, h2=1, h4=6, txt=4,
                      image=2)]:
        kw = inputs(**size)
        feeds = {n: v.numpy() for n, v in zip(RECORD.graph.input_names,
                                              graph_args(kw, ids_cache(kw)))}
        ours, reference = (s.run(None, feeds)[0] for s in sessions)
        with torch.no_grad():
            ref64 = double(**{k: (v.double() if v.is_floating_point() and k not in INDICES
                                  else v) for k, v in kw.items()}, return_dict=False)[0].numpy()
        assert ours.shape == ref64.shape == tuple(kw["hidden_states"].shape)
        reference_err = float(np.abs(reference - ref64).max())
        ours_err = float(np.abs(ours - ref64).max())
        assert 0 < reference_err and ours_err <= 2 * reference_err, (ours_err, reference_err)


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
# The export plan (export_transformer's hook; the record registers once model_io declares its
# history inputs)
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
    indices = hx.framepack_sample_indices(3)
    kw = {**dict(zip(INDICES, indices)), "hidden_states": by_name["latent"]}
    assert torch.allclose(by_name["img_cos_sin_cache"], diffusers_cache(model, kw), rtol=0,
                          atol=2.0 ** -18)
    assert plan.axis_values == {"image_embed_tokens": 3, "img_cache_rows": (5 + 3 + 2 + 3) * 3 * 4,
                                "txt_cache_rows": 3 + 6, "clean_frames": 2,
                                "history_2x_frames": 3, "history_4x_frames": 5}
    with torch.no_grad():
        out = plan.wrapper(*plan.args)
    assert out.shape == by_name["latent"].shape and torch.isfinite(out).all()
