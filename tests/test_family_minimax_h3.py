"""MiniMax-H3 (MiniMaxH3Transformer3DModel, qkrope/families/minimax_h3): the cache-input wrapper
bit for bit diffusers' forward in fp32 on diffusers' own cos / sin (and, in bf16 with the float32
modules the class keeps, the rotation's rounding bounded: see below); the node against the
model's own norm_q + partial NeoX rotation (96 of 128 channels): bit for bit in fp32, within the
bound derived in docs/spec.md section 6f in bf16 / fp16 in the record's rounding (2), the
pass-through channels bit for bit; the "ids-float32" caches within one float32 ulp of diffusers'
float32 cos / sin (not bit-equal: torch's vectorised cos / sin against the C library's); the
export in ONNX Runtime at untraced shapes and shuffled packings through the drop-in (called as
the transformer is called) within the per-call bound of the other families (5e-4 x max|out|,
fp32); the refusals, one line each. The tiny transformer is the family's tiny hook's (2 blocks,
1 refiner block, 2 heads x 32, rope_freq_dim 4: 24 of 32 channels rotated)."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from qkrope import contract, families  # noqa: E402
from qkrope.errors import InputError  # noqa: E402

MINIMAX = families.by_name("minimax-h3")
TINY = families.hooks(MINIMAX, "tiny")
#: the per-call bound of an fp32 export relative to max|output| (tests/_flux_models.py)
PARITY = 5e-4
#: unit roundoff of each 16-bit dtype (half its machine epsilon)
UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
STREAMS = ("timestep_indices", "token_tags", "video_indices", "audio_indices", "text_indices")


def _model(dtype=torch.float32, seed=0):
    """The tiny model; in a 16-bit dtype with the class's _keep_in_fp32_modules in float32, as
    from_pretrained(torch_dtype=...) loads it."""
    model = TINY.build_transformer(MINIMAX, seed)
    if dtype == torch.float32:
        return model
    model.to(dtype)
    keep = tuple(type(model)._keep_in_fp32_modules)
    for name, module in model.named_modules():
        if name.split(".")[-1] in keep:
            module.to(torch.float32)
    return model


def _call(grid=(2, 4, 6), txt=5, audio=7, batch=2, dtype=torch.float32, seed=3, shuffle=False):
    """diffusers' forward arguments of a packed sequence (the family's sample layout, its rows
    shuffled where asked), three noise levels."""
    from qkrope.families.minimax_h3.dropin import packed_layout

    g = torch.Generator().manual_seed(seed)
    lay = packed_layout(grid, txt, audio)
    rows = lay["position_ids"].shape[0]
    perm = torch.randperm(rows, generator=g) if shuffle else torch.arange(rows)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(rows)
    f, h, w = grid
    return dict(hidden_states=torch.randn(batch, f * h * w, 16, generator=g).to(dtype),
                audio_hidden_states=torch.randn(batch, audio, 8, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(batch, txt, 16, generator=g).to(dtype),
                timestep=torch.tensor([0.3, 1.0, 0.85]),
                timestep_indices=torch.randint(0, 3, (rows,), generator=g),
                token_tags=lay["token_tags"][perm], position_ids=lay["position_ids"][perm],
                video_indices=inv[lay["video_indices"]], audio_indices=inv[lay["audio_indices"]],
                text_indices=inv[lay["text_indices"]])


def _diffusers_caches(model, kw):
    """The two graph caches from diffusers' own float32 cos / sin of the packed rows."""
    cos, sin = model.rope(kw["position_ids"])
    half = cos.shape[1] // 2
    packed = torch.cat([cos[:, :half], sin[:, :half]], dim=1)
    return (packed[kw["video_indices"]].contiguous(),
            torch.cat([packed[kw["text_indices"]], packed[kw["audio_indices"]]]).contiguous())


def _wrapper_args(kw, caches):
    return (kw["hidden_states"], kw["audio_hidden_states"], kw["encoder_hidden_states"],
            kw["timestep"], *(kw[k] for k in STREAMS), *caches)


@pytest.mark.parametrize("shuffle", [False, True], ids=["sample-layout", "shuffled"])
def test_wrapper_is_bit_exact_with_diffusers_in_fp32(shuffle):
    from qkrope.families.minimax_h3 import export

    model = _model()
    kw = _call(shuffle=shuffle)
    wrapper = export.MiniMaxH3CacheInputTransformer(copy.deepcopy(model), MINIMAX,
                                                    MINIMAX.rounding)
    with torch.no_grad():
        want = model(**kw, return_dict=False)
        got = wrapper(*_wrapper_args(kw, _diffusers_caches(model, kw)))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # the refiner's attentions keep diffusers' processor, the blocks' take the node
    assert type(model.token_refiner.refiner_blocks[0].attn.processor).__module__.startswith(
        "diffusers")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_wrapper_in_16_bits_keeps_the_fp32_modules_and_stays_near_diffusers(dtype):
    """No node mode is the eager 16-bit rotation (docs/spec.md 6f), so the 16-bit wrapper is
    not bit-exact; with the only difference the rotation's rounding, the wrapper is no farther
    from the float32 model than diffusers' own 16-bit forward is, within a factor 2."""
    from qkrope.families.minimax_h3 import export

    model = _model(dtype)
    assert model.proj_in.weight.dtype == torch.float32
    assert model.transformer_blocks[0].attn.to_q.weight.dtype == dtype
    kw = _call(dtype=dtype)
    wrapper = export.MiniMaxH3CacheInputTransformer(copy.deepcopy(model), MINIMAX,
                                                    MINIMAX.rounding)
    truth = _model()
    kw32 = dict(kw, hidden_states=kw["hidden_states"].float(),
                audio_hidden_states=kw["audio_hidden_states"].float(),
                encoder_hidden_states=kw["encoder_hidden_states"].float())
    with torch.no_grad():
        exact = truth(**kw32, return_dict=False)
        eager = model(**kw, return_dict=False)
        got = wrapper(*_wrapper_args(kw, _diffusers_caches(model, kw)))
    for g, e, t in zip(got, eager, exact):
        assert g.dtype == e.dtype == torch.float32  # the float32 output heads
        assert not torch.equal(g, e)
        assert float((g - t).abs().max()) <= 2 * float((e - t).abs().max())


def _node_vs_eager(dtype, rounding, seed=0):
    """diffusers' norm_q / norm_k then _apply_rotary_emb (its cos / sin cast to the activation
    dtype), and the node on the same q / k with the same float32 cos / sin as the cache, at the
    real head (128 wide, rope_freq_dim 16: 96 channels rotated)."""
    from diffusers.models.transformers.transformer_minimax_h3 import (MiniMaxH3RotaryPosEmbed,
                                                                      _apply_rotary_emb)

    from qkrope.export.ops import qk_norm_rope

    g = torch.Generator().manual_seed(seed)
    rope = MiniMaxH3RotaryPosEmbed(16, 10000.0)
    cos, sin = rope(torch.randint(0, 600, (257, 3), generator=g).float())
    cache = torch.cat([cos[:, :48], sin[:, :48]], dim=1).contiguous()
    norms = []
    for _ in range(2):
        norm = torch.nn.RMSNorm(128, eps=1e-5)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.3 * torch.randn(128, generator=g))
        norms.append(norm.to(dtype))
    q = (torch.randn(2, 257, 3, 128, generator=g) * 3).to(dtype)
    k = torch.randn(2, 257, 3, 128, generator=g).to(dtype)
    with torch.no_grad():
        normed = (norms[0](q), norms[1](k))
        eager = tuple(_apply_rotary_emb(y, cos, sin) for y in normed)
        node = qk_norm_rope(q, k, norms[0].weight, norms[1].weight, cache, eps=1e-5,
                            interleaved=False, rounding=rounding)
    return normed, eager, node


def test_the_node_is_the_models_norm_and_partial_rope_in_fp32():
    _, eager, node = _node_vs_eager(torch.float32, MINIMAX.rounding)
    assert all(torch.equal(a, b) for a, b in zip(eager, node))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_node_is_within_the_derived_bound_of_the_16_bit_rotation(dtype):
    """docs/spec.md section 6f: in the record's rounding (2) the pass-through channels are
    bit-exact and each rotated element within (4u + 5u^2) |(a, b)| of the eager rotation (u the
    dtype's unit roundoff, (a, b) the normalised pair); the rounding is the closest mode (the
    smallest largest difference), and no mode is bit-exact."""
    u = UNIT[dtype]
    worst = {}
    for mode in contract.ROUNDING_MODES:
        normed, eager, node = _node_vs_eager(dtype, mode)
        ratio = 0.0
        for y, e, o in zip(normed, eager, node):
            assert not torch.equal(e, o)
            if mode == MINIMAX.rounding:
                assert torch.equal(e[..., 96:], o[..., 96:])
            a, b = y.float()[..., :48], y.float()[..., 48:96]
            pair = torch.hypot(a, b).repeat(1, 1, 1, 2)
            diff = (e.float() - o.float())[..., :96].abs()
            if mode == MINIMAX.rounding:
                assert bool((diff <= (4 * u + 5 * u * u) * pair).all()), float(
                    (diff / pair.clamp_min(1e-30)).max() / u)
            ratio = max(ratio, float((diff / pair.clamp_min(1e-30)).max()))
        worst[mode] = ratio
    assert min(worst, key=worst.get) == MINIMAX.rounding, worst


def test_caches_are_within_one_float32_ulp_of_diffusers():
    """The "ids-float32" caches of a packed sequence against MiniMaxH3RotaryPosEmbed's float32
    cos / sin (the real rope_freq_dim 16): every entry within one ulp, and not bit-equal (torch
    evaluates cos / sin vectorised, the scheme with the C library's cosf / sinf)."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3RotaryPosEmbed

    from qkrope.families.minimax_h3.dropin import packed_layout, stream_request
    from qkrope.runtime.caches import build_rope_caches, checked_setting

    lay = packed_layout((8, 30, 52), 300, 200)
    cos, sin = MiniMaxH3RotaryPosEmbed(16, 10000.0)(lay["position_ids"])
    want = torch.cat([cos[:, :48], sin[:, :48]], dim=1)
    caches = build_rope_caches("ids-float32", stream_request(lay),
                               checked_setting("ids-float32", (32, 32, 32), 10000))
    for got, rows in ((caches.img, lay["video_indices"]),
                      (caches.txt, torch.cat([lay["text_indices"], lay["audio_indices"]]))):
        a = got.numpy().view(np.int32).astype(np.int64)
        b = want[rows].numpy().view(np.int32).astype(np.int64)
        assert np.abs(a - b).max() <= 1
    assert not torch.equal(caches.img, want[lay["video_indices"]])


def test_the_tiny_pipeline_is_refused_in_one_line(tmp_path):
    with pytest.raises(InputError, match="no MiniMax-H3 pipeline") as e:
        TINY.save_pipeline(MINIMAX, tmp_path)
    assert "\n" not in str(e.value)


def test_a_rope_wider_than_the_head_is_refused_in_one_line():
    from qkrope.families.minimax_h3 import export

    model = TINY.build_transformer(MINIMAX, 0, rope_freq_dim=6)  # 36 channels of 32
    with pytest.raises(InputError, match="rope_freq_dim") as e:
        export.check_supported(model)
    assert "\n" not in str(e.value)


@pytest.mark.slow  # a bf16 export (~10 s on 2 cores)
def test_a_bf16_export_keeps_the_fp32_modules_in_float32(tmp_path):
    """The class's _keep_in_fp32_modules stay float32 initializers in a bf16 graph (the output
    heads too: the outputs are float32, as diffusers'); the blocks' weights, norm_q / norm_k
    included, are bf16; the nodes take the record's rounding and NeoX pairs."""
    import onnx
    from onnx import TensorProto

    from qkrope.export.api import export_transformer
    from qkrope.sidecars import ModelInfo

    TINY.build_transformer(MINIMAX, 0).save_pretrained(str(tmp_path / "d"))
    out = tmp_path / "m.onnx"
    export_transformer(tmp_path / "d", out, dtype="bf16", progress=False)
    graph = onnx.load(str(out)).graph
    types = {t.name: t.data_type for t in graph.initializer}
    for name in ("proj_in.weight", "audio_proj_in.weight", "proj_out.weight",
                 "audio_proj_out.weight", "time_embedder.linear_1.weight"):
        assert types[name] == TensorProto.FLOAT, name
    for name in ("transformer_blocks.0.attn.to_q.weight", "transformer_blocks.0.attn.norm_q.weight",
                 "context_embedder.weight"):
        assert types[name] == TensorProto.BFLOAT16, name
    assert [t.dtype for t in ModelInfo.load(out).outputs] == ["float32", "float32"]
    nodes = [n for n in graph.node if n.op_type == "QKNormRoPE"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert len(nodes) == 2 and attrs["interleaved"] == 0 and attrs["rounding"] == MINIMAX.rounding


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from qkrope.export.api import export_transformer

    root = tmp_path_factory.mktemp("minimax-h3")
    TINY.build_transformer(MINIMAX, 0).save_pretrained(str(root / "diffusers"))
    export_transformer(root / "diffusers", root / "minimax.onnx", dtype="fp32", progress=False)
    return root / "minimax.onnx"


@pytest.mark.slow  # the module's export (~6 s on 2 cores)
def test_onnxruntime_at_untraced_shapes_through_the_dropin(exported):
    import onnx
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerOutput

    from qkrope.runtime import load_transformer

    graph = onnx.load(str(exported)).graph
    assert sum(n.op_type == "QKNormRoPE" for n in graph.node) == 2  # one per block
    assert [o.name for o in graph.output] == ["sample", "audio_sample"]
    model = _model()
    dropin = load_transformer(exported)
    for grid, txt, audio, batch in (((3, 6, 4), 9, 5, 1), ((2, 4, 8), 3, 11, 3)):
        kw = _call(grid, txt, audio, batch, seed=11, shuffle=True)
        with torch.no_grad():
            want = model(**kw)
        got = dropin(**kw)
        assert isinstance(got, MiniMaxH3TransformerOutput)
        pair = dropin(**kw, return_dict=False)
        assert isinstance(pair, tuple) and len(pair) == 2
        for g, w in ((got.sample, want.sample), (got.audio_sample, want.audio_sample)):
            err, scale = float((g - w).abs().max()), float(w.abs().max())
            assert g.shape == w.shape and 0 < err <= PARITY * scale, (grid, err, scale)


def _holes(kw):
    """A packed row no stream fills (the text's last row dropped)."""
    n = kw["encoder_hidden_states"].shape[1] - 1
    return dict(encoder_hidden_states=kw["encoder_hidden_states"][:, :n],
                text_indices=kw["text_indices"][:n])


REFUSED = [(lambda kw: dict(attention_kwargs={"scale": 0.5}), "attention_kwargs"),
           (_holes, "exactly once"),
           (lambda kw: dict(video_indices=kw["audio_indices"][:1].repeat(
               kw["video_indices"].shape[0])), "exactly once"),
           (lambda kw: dict(timestep=kw["timestep"][:1]), "timestep_indices"),
           (lambda kw: dict(token_tags=kw["token_tags"][:-1]), "token_tags"),
           (lambda kw: dict(position_ids=kw["position_ids"][:, :2]), r"position_ids must be"),
           (lambda kw: dict(audio_hidden_states=kw["audio_hidden_states"][:1]), "batch"),
           (lambda kw: dict(img_ids=kw["position_ids"]), "img_ids"),
           (lambda kw: dict(position_ids=None), "needs position_ids")]


@pytest.mark.slow  # the module's export
@pytest.mark.parametrize("change, match", REFUSED, ids=[m for _, m in REFUSED])
def test_refusals(exported, change, match):
    from qkrope.runtime import load_transformer

    dropin = load_transformer(exported)
    kw = _call()
    kw.update(change(kw))
    with pytest.raises(InputError, match=match) as e:
        dropin(**kw)
    assert "\n" not in str(e.value)


@pytest.mark.slow  # the module's export
def test_the_engine_profile_spans_the_packed_rows(exported):
    """A TensorRT profile derived from the sidecar: the packed rows range over the sum of the
    text, video and audio rows, and the text cache covers the text rows plus the audio rows."""
    from qkrope.runtime.profiles import derive_profile, validate_profile
    from qkrope.sidecars import ModelInfo

    info = ModelInfo.load(exported)
    profile = derive_profile(info)
    validate_profile(profile, info.inputs)
    for level in ("min", "opt", "max"):
        rows = (profile["text_indices"][level][0] + profile["video_indices"][level][0]
                + profile["audio_indices"][level][0])
        assert profile["timestep_indices"][level] == profile["token_tags"][level] == (rows,)
        assert profile["txt_cos_sin_cache"][level][0] == (
            profile["text_indices"][level][0] + profile["audio_indices"][level][0])
