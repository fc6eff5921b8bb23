"""Motif-Video (qkrope/families/motif_video): the caches against diffusers' RoPE, the patched
forward bit for bit against diffusers' own in fp32, bf16 and fp16 (the node's rounding 2:
torch.nn.RMSNorm, then the fp32 rotation), qkrope's export run by ONNX Runtime at shapes it
never traced, the drop-in (and MotifVideoPipeline on it end to end) and the refusals. The tiny
transformer is diffusers' own test config (qkrope/families/motif_video/tiny.py)."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

from qkrope import contract  # noqa: E402
from qkrope.errors import InputError  # noqa: E402
from qkrope.families.motif_video import MOTIF_VIDEO  # noqa: E402
from qkrope.families.motif_video import export as mx  # noqa: E402
from qkrope.families.motif_video import tiny  # noqa: E402

RECORD = MOTIF_VIDEO


def _model(**overrides):
    return tiny.build_transformer(RECORD, 0, **overrides)


def inputs(*, batch: int = 2, frames: int = 3, height: int = 4, width: int = 6, txt: int = 7,
           seed: int = 3, dtype: torch.dtype = torch.float32) -> dict:
    """diffusers' forward keywords for a latent of ``frames x height x width`` (patch 1), the
    last batch item's text half padded."""
    cfg = tiny.CONFIG
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, txt, dtype=torch.int64)
    mask[-1, txt // 2:] = 0
    return dict(hidden_states=torch.randn(batch, cfg["in_channels"], frames, height, width,
                                          generator=g).to(dtype),
                timestep=torch.linspace(900.0, 100.0, batch).to(dtype),
                encoder_hidden_states=torch.randn(batch, txt, cfg["text_embed_dim"],
                                                  generator=g).to(dtype),
                encoder_attention_mask=mask)


def _diffusers_cache(model, latent) -> torch.Tensor:
    """diffusers' own RoPE tables of this latent as the node's cache (its pairs are repeated in
    place: every second column is the cos / sin half)."""
    cos, sin = model.rope(latent)
    return torch.cat([cos[:, ::2], sin[:, ::2]], dim=1).float().contiguous()


def _graph_args(kw, img, txt) -> list:
    return [kw["hidden_states"], kw["timestep"], kw["encoder_hidden_states"],
            kw["encoder_attention_mask"], img, txt]


def test_caches_are_diffusers_tables_bit_for_bit():
    """The float64 frequencies and their cos / sin rounded to float32 (the grid scheme's
    float64 tables): diffusers' own, bit for bit; the text rows are the identity."""
    model = _model()
    axes, theta = mx.rope_setting(model)
    assert axes == (4, 4, 4) and theta == 256
    for f, h, w in [(1, 8, 8), (3, 4, 6), (31, 46, 80)]:
        ref = _diffusers_cache(model, torch.zeros(1, 1, f, h, w))
        img, txt = mx.sample_caches(RECORD, (f, h, w), 5, axes, theta)
        assert torch.equal(img, ref)
        half = sum(axes) // 2
        assert (txt[:, :half] == 1).all() and (txt[:, half:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_patched_forward_is_bit_exact(dtype):
    """The cache-input wrapper (fused nodes, identity text rows, the int64 mask) against
    diffusers' forward: equal bit for bit in fp32, and in bf16 and fp16 with the record's
    rounding 2 (ROUNDING_TWO_STEPS: torch.nn.RMSNorm rounds the normalised value times the
    weight once, apply_rotary_emb rotates in fp32 and rounds)."""
    model = _model().to(dtype)
    kw = inputs(dtype=dtype)
    wrapper = mx.cache_input_motif(copy.deepcopy(model), RECORD)
    assert wrapper.rounding == contract.ROUNDING_TWO_STEPS
    img, txt = mx.sample_caches(RECORD, (3, 4, 6), 7, *mx.rope_setting(model))
    with torch.no_grad():
        want = model(**kw, return_dict=False)[0]
        got = wrapper(*_graph_args(kw, img, txt))
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_q_is_the_models_own_norm_and_rope_bit_for_bit(dtype):
    """One attention's q and k from the node's reference at the record's rounding equal the
    model's own norm_q / norm_k (torch.nn.RMSNorm) and diffusers' apply_rotary_emb on
    diffusers' tables, bit for bit; another rounding mode differs (so the test can fail)."""
    from diffusers.models.embeddings import apply_rotary_emb

    from qkrope.export.reference import qk_norm_rope_reference

    model = _model().to(dtype)
    attn = model.transformer_blocks[0].attn
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(2, 24, 2, 12, generator=g).mul(3).to(dtype) for _ in range(2))
    latent = torch.zeros(1, 1, 2, 3, 4)
    cos, sin = model.rope(latent)
    want_q = apply_rotary_emb(attn.norm_q(q), (cos, sin), sequence_dim=1)
    want_k = apply_rotary_emb(attn.norm_k(k), (cos, sin), sequence_dim=1)
    cache = _diffusers_cache(model, latent)
    same = {}
    for rounding in contract.ROUNDING_MODES:
        got_q, got_k = qk_norm_rope_reference(q, k, attn.norm_q.weight, attn.norm_k.weight,
                                              cache, eps=attn.norm_q.eps, interleaved=True,
                                              rounding=rounding)
        same[rounding] = torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert same[RECORD.rounding] and not all(same.values()), same


@pytest.mark.parametrize("overrides,match", [
    (dict(qk_norm="layer_norm"), "qk_norm='layer_norm'"),
    (dict(enable_text_cross_attention_dual=True), "cross-attention"),
    (dict(num_single_layers=2, num_decoder_layers=1), "num_decoder_layers=1"),
])
def test_unsupported_configs_are_refused_in_one_line(overrides, match):
    with pytest.raises(InputError, match=match) as e:
        mx.cache_input_motif(_model(**overrides), RECORD)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------------------
# The ONNX graph, run by ONNX Runtime at untraced shapes
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("motif-onnx")
    done: dict = {}

    def get(fused=True):
        """qkrope's export of the saved tiny model (its default sample); ``fused=False``: the
        same export with diffusers' norm and rotation in place of the nodes."""
        from unittest import mock

        from qkrope.export.onnx_export import export_transformer

        if fused not in done:
            path = root / f"{'fused' if fused else 'reference'}.onnx"
            folder = root / "model"
            if not folder.exists():
                _model().save_pretrained(str(folder))
            plan = mx.plan if fused else functools.partial(mx.plan, fused=False)
            with mock.patch.object(mx, "plan", plan):
                info, _ = export_transformer(path, folder, dtype="fp32", progress=False)
            done[fused] = (_model(), path, info)
        return done[fused]
    return get


@pytest.mark.slow
def test_qkrope_export_writes_the_5d_graph(exported):
    model, path, info = exported()
    shapes = {t.name: t.shape for t in info.inputs + info.outputs}
    video = ["batch", 33, "latent_frames", "latent_height", "latent_width"]
    assert [t.name for t in info.inputs] == list(RECORD.graph.input_names)
    assert shapes["latent"] == video
    assert shapes["latent_sample"] == ["batch", 16] + video[2:]
    assert shapes["encoder_attention_mask"] == ["batch", "txt_tokens"]
    assert info.config.family == RECORD.name
    assert info.config.axes_dims_rope == [4, 4, 4]


@pytest.mark.slow
def test_onnx_runtime_at_untraced_shapes(exported):
    """The export (traced at its default sample) run by ONNX Runtime at other batches, frame
    counts, sizes and text lengths against diffusers' forward in float64: the error is at most
    twice that of the reference graph (the same export with diffusers' norm and rotation in
    place of the nodes, equal to them in fp32 eager: the bit-exact test above), so the node's
    function body adds at most ONNX Runtime's own rounding again. Two nodes per double-stream
    block, one per single-stream block."""
    import onnx
    import onnxruntime as ort

    model, path, _ = exported()
    _, ref_path, _ = exported(fused=False)
    nodes = [n for n in onnx.load(str(path)).graph.node if n.op_type == "QKNormRoPE"]
    assert len(nodes) == mx.node_count((1, 1)) == 3
    assert not [n for n in onnx.load(str(ref_path)).graph.node if n.op_type == "QKNormRoPE"]
    sessions = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"])
                for p in (path, ref_path)]
    axes, theta = mx.rope_setting(model)
    model64 = copy.deepcopy(model).double()
    # diffusers casts the float32 timestep sinusoid to the embedder's dtype for fp16 / bf16
    # only; in float64 the sinusoid is cast here, the rest is diffusers' forward
    model64.time_text_embed.timestep_embedder.register_forward_pre_hook(
        lambda module, args: (args[0].double(),))
    for batch, f, h, w, txt in [(1, 2, 6, 4, 9), (3, 5, 3, 5, 4)]:
        kw = inputs(batch=batch, frames=f, height=h, width=w, txt=txt)
        img, txt_cache = mx.sample_caches(RECORD, (f, h, w), txt, axes, theta)
        feeds = dict(zip(RECORD.graph.input_names, _graph_args(kw, img, txt_cache)))
        feeds = {n: v.numpy() for n, v in feeds.items()}
        ours, reference = (s.run(None, feeds)[0] for s in sessions)
        with torch.no_grad():
            kw64 = {k: (v.double() if v.is_floating_point() else v) for k, v in kw.items()}
            ref64 = model64(**kw64, return_dict=False)[0].numpy()
        assert ours.shape == ref64.shape == (batch, 16, f, h, w)
        reference_err = float(np.abs(reference - ref64).max())
        ours_err = float(np.abs(ours - ref64).max())
        assert 0 < reference_err and ours_err <= 2 * reference_err, (ours_err, reference_err)


# --------------------------------------------------------------------------------------------
# The drop-in
# --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_dropin_runs_the_export_at_untraced_shapes(exported):
    """``load_transformer(export)`` called as MotifVideoPipeline calls ``pipe.transformer`` at a
    batch, frame count, size and text length the export was not traced at: ONNX Runtime's run
    of the graph on the same inputs and the call grid's caches, bit for bit; diffusers'
    prediction's shape; ``return_dict`` honoured."""
    import onnxruntime as ort

    from qkrope.runtime import load_transformer

    model, path, _ = exported()
    dropin = load_transformer(path)
    kw = inputs(batch=3, frames=5, height=3, width=5, txt=9)
    ours = dropin(**kw, attention_kwargs=None, return_dict=False)[0]
    assert torch.equal(dropin(**kw).sample, ours)
    img, txt = mx.sample_caches(RECORD, (5, 3, 5), 9, *mx.rope_setting(model))
    feeds = {n: v.numpy() for n, v in zip(RECORD.graph.input_names, _graph_args(kw, img, txt))}
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert torch.equal(ours, torch.from_numpy(session.run(None, feeds)[0]))
    with torch.no_grad():
        assert ours.shape == model(**kw, return_dict=False)[0].shape == (3, 16, 5, 3, 5)
    for change, match in [(dict(image_embeds=torch.zeros(3, 2, 4)), "image_embeds"),
                          (dict(attention_kwargs={"scale": 0.5}), "attention_kwargs"),
                          (dict(hidden_states=torch.zeros(3, 72, 33)), "5-D|hidden_states")]:
        with pytest.raises(InputError, match=match) as e:
            dropin(**{**kw, **change})
        assert "\n" not in str(e.value)


@pytest.mark.slow
def test_motif_video_pipeline_end_to_end(tmp_path):
    """``pipe.transformer = load_transformer(export)`` in the tiny MotifVideoPipeline (a random
    T5Gemma2 encoder over real prompts, adaptive projected guidance, two steps,
    output_type="latent") at 9 frames of 24 x 40 pixels (a 3 x 3 x 5 latent; the export is
    traced at 2 x 8 x 8), against the stock pipeline: the stock run's calls replayed on the
    drop-in differ by at most E; the guider's prediction by at most (1 + 2 s) E (APG adds
    s - 1 times the guided difference, 2 E apart at most, projected and norm-capped), the Euler steps add it times |d sigma|
    (summing to 1), a factor 2 for the feedback through the second step."""
    from qkrope.export.onnx_export import export_transformer
    from qkrope.runtime import load_transformer

    pipe = tiny.build_pipeline(RECORD)
    stock = pipe.transformer
    stock.save_pretrained(str(tmp_path / "t"))
    export_transformer(tmp_path / "t.onnx", tmp_path / "t", dtype="fp32", progress=False)
    dropin = load_transformer(tmp_path / "t.onnx")
    calls = []
    hook = stock.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(dict(kwargs)), with_kwargs=True)

    def run():
        return pipe(prompt="a red bird on a branch", negative_prompt="blurry",
                    num_inference_steps=2, height=24, width=40, num_frames=9,
                    max_sequence_length=16, output_type="latent",
                    generator=torch.Generator().manual_seed(0)).frames

    with torch.no_grad():
        ref = run()
    hook.remove()
    pipe.transformer = dropin
    ours = run()
    assert len(calls) == 4  # two steps, conditional and unconditional
    with torch.no_grad():
        per_call = max(float((dropin(**kw)[0] - stock(**kw)[0]).abs().max()) for kw in calls)
    scale = float(pipe.guider.guidance_scale)
    assert ours.shape == ref.shape and per_call > 0
    diff, bound = float((ours - ref).abs().max()), 2 * (1 + 2 * scale) * per_call
    assert diff <= bound, (diff, per_call, bound)  # measured: 4.3e-4, 1.3e-4, 4.2e-3
