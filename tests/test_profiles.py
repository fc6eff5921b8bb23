"""qkrope.runtime.profiles: shape flags (trtexec's and polygraphy's syntax), profile derivation
from the model's description, validation."""

from __future__ import annotations

import json

import pytest
from _tiny_model import C, model, sidecar_dict  # noqa: F401

from qkrope.runtime import profiles as prof
from qkrope.sidecars import TensorInfo


def test_parse_shape_specs():
    assert prof.parse_shape_spec("hidden_states:1x4096x3072") == ("hidden_states",
                                                                   (1, 4096, 3072))
    assert prof.parse_shape_spec("t:") == ("t", ())
    assert prof.parse_shape_specs(["a:1x2 b:3", "c:4,5"]) == {"a": (1, 2), "b": (3,), "c": (4, 5)}
    with pytest.raises(prof.ProfileError, match="NAME:DIMxDIM"):
        prof.parse_shape_spec("model.onnx")
    with pytest.raises(prof.ProfileError, match="twice"):
        prof.parse_shape_specs(["a:1x2", "a:1x3"])


def test_parse_shape_specs_polygraphy_syntax():
    """polygraphy's --trt-*-shapes NAME:[d0,d1,...] is accepted beside trtexec's NAME:DxD."""
    assert prof.parse_shape_spec("hidden_states:[1,4096,3072]") == ("hidden_states",
                                                                     (1, 4096, 3072))
    assert prof.parse_shape_spec("hidden_states:[1, 4096, 3072]") == ("hidden_states",
                                                                       (1, 4096, 3072))
    assert prof.parse_shape_spec("t:[]") == ("t", ())
    assert prof.parse_shape_specs(["a:[1,2] b:3x4", "c:[5, 6] d:[7]"]) == {
        "a": (1, 2), "b": (3, 4), "c": (5, 6), "d": (7,)}
    assert prof.parse_shape_specs(["a:[1,2]", "a:1x2"]) == {"a": (1, 2)}  # same shape, twice
    for bad in ("a:[1x2]", "a:[1,2", "a:1,2]", "a:[1,,2]", "[1,2]"):
        with pytest.raises(prof.ProfileError, match=r"NAME:DIMxDIM.*trtexec.*NAME:\[DIM,DIM"):
            prof.parse_shape_spec(bad)


def test_derive_profile_defaults_from_sidecar():
    p = prof.derive_profile(model())
    assert p["hidden_states"] == {"min": (1, 1, C), "opt": (2, 16, C), "max": (2, 4096, C)}
    assert p["encoder_hidden_states"] == {"min": (1, 1, C), "opt": (2, 5, C), "max": (2, 512, C)}
    assert p["encoder_hidden_states_mask"]["max"] == (2, 512)
    # cache rows follow the tokens of their stream
    assert p["img_cos_sin_cache"] == {"min": (1, 16), "opt": (16, 16), "max": (4096, 16)}
    assert p["txt_cos_sin_cache"] == {"min": (1, 16), "opt": (5, 16), "max": (512, 16)}
    prof.validate_profile(p, model().inputs)
    assert "hidden_states" in prof.format_profile(p)


def test_derive_profile_max_flags_and_small_max_pulls_opt():
    p = prof.derive_profile(model(), max_batch=4, max_img_tokens=8, max_txt_tokens=64)
    assert p["hidden_states"]["max"] == (4, 8, C)
    assert p["hidden_states"]["opt"] == (2, 8, C)  # export value 16 > max 8
    assert p["txt_cos_sin_cache"]["max"] == (64, 16)
    with pytest.raises(prof.ProfileError, match="--max-batch"):
        prof.derive_profile(model(), max_batch=0)


def test_explicit_shapes_override_and_cache_rows_are_raised():
    p = prof.derive_profile(
        model(),
        max_shapes={"hidden_states": (2, 8192, C), "img_cos_sin_cache": (100, 16)},
        opt_shapes={"img_cos_sin_cache": (3, 16)})
    assert p["hidden_states"]["max"] == (2, 8192, C)
    # cache rows raised to the tokens at each level, whatever was given
    assert p["img_cos_sin_cache"]["max"] == (8192, 16)
    assert p["img_cos_sin_cache"]["opt"] == (16, 16)
    prof.validate_profile(p, model().inputs)


def test_profile_errors():
    inputs = model().inputs
    with pytest.raises(prof.ProfileError, match="does not have"):
        prof.derive_profile(model(), min_shapes={"nope": (1,)})
    with pytest.raises(prof.ProfileError, match="has 2 dimensions but hidden_states has 3"):
        prof.derive_profile(model(), max_shapes={"hidden_states": (1, 2)})
    good = prof.derive_profile(model())

    bad = json.loads(json.dumps(prof.profile_to_json(good)))
    bad["hidden_states"]["min"] = [1, 32, C]  # min > opt (16)
    with pytest.raises(prof.ProfileError, match="min <= opt <= max"):
        prof.validate_profile(bad, inputs)

    bad = json.loads(json.dumps(prof.profile_to_json(good)))
    bad["hidden_states"]["opt"] = [2, 16, 64]
    with pytest.raises(prof.ProfileError, match="static"):
        prof.validate_profile(bad, inputs)

    bad = json.loads(json.dumps(prof.profile_to_json(good)))
    bad["encoder_hidden_states"]["max"] = [3, 512, C]  # batch max 3 vs 2 elsewhere
    with pytest.raises(prof.ProfileError, match="axis 'batch'"):
        prof.validate_profile(bad, inputs)

    bad = json.loads(json.dumps(prof.profile_to_json(good)))
    bad["img_cos_sin_cache"]["max"] = [10, 16]
    bad["img_cos_sin_cache"]["opt"] = [10, 16]
    with pytest.raises(prof.ProfileError, match="one row per token"):
        prof.validate_profile(bad, inputs)

    bad = dict(prof.profile_to_json(good))
    del bad["txt_cos_sin_cache"]
    with pytest.raises(prof.ProfileError, match="no profile shapes"):
        prof.validate_profile(bad, inputs)


def test_unknown_axis_needs_explicit_shapes():
    side = model()
    side.inputs.append(TensorInfo("extra", "float32", ["mystery", 4]))
    with pytest.raises(prof.ProfileError, match="mystery"):
        prof.derive_profile(side)
    p = prof.derive_profile(side, min_shapes={"extra": (1, 4)}, opt_shapes={"extra": (2, 4)},
                            max_shapes={"extra": (3, 4)})
    assert p["extra"] == {"min": (1, 4), "opt": (2, 4), "max": (3, 4)}


# --------------------------------------------------------------------------------------------
# Resolution presets: one profile per preset; the runner's choice
# --------------------------------------------------------------------------------------------

def test_resolutions_and_ranges_parse():
    assert prof.parse_resolutions("512x512,1024x1024, 1328x1328") == [
        (512, 512), (1024, 1024), (1328, 1328)]
    assert prof.image_tokens(1024, 1024) == 4096  # 8x VAE, 2x2 patches: 16 px per token
    assert prof.image_tokens(1328, 1328) == 83 * 83
    assert prof.image_tokens(1664, 928) == 104 * 58
    assert prof.parse_range("1:512", "--txt-tokens") == (1, 512)
    assert prof.parse_range("2", "--batch") == (2, 2)
    for bad in ("1024", "1000x1000", "0x512", "axb"):
        with pytest.raises(prof.ProfileError, match="resolution"):
            prof.parse_resolutions(bad)
    for bad in ("3:1", "0:4", "a:b"):
        with pytest.raises(prof.ProfileError, match="--batch"):
            prof.parse_range(bad, "--batch")


def test_three_presets_make_three_profiles():
    m = model(with_timestep=True)
    out = prof.derive_preset_profiles(m, prof.parse_resolutions("1328x1328,512x512,1024x1024"))
    assert [label for label, _ in out] == ["512x512", "1024x1024", "1328x1328"]  # smallest first
    for (label, p), n in zip(out, (1024, 4096, 83 * 83)):
        assert p["hidden_states"] == {"min": (1, 1, C), "opt": (2, n, C), "max": (2, n, C)}
        assert p["encoder_hidden_states"] == {"min": (1, 1, C), "opt": (2, 512, C),
                                              "max": (2, 512, C)}
        assert p["encoder_hidden_states_mask"]["max"] == (2, 512)
        assert p["img_cos_sin_cache"] == {"min": (1, 16), "opt": (n, 16), "max": (n, 16)}
        assert p["txt_cos_sin_cache"]["max"] == (512, 16)
        prof.validate_profile(p, m.inputs)


def test_presets_take_text_and_batch_ranges():
    out = prof.derive_preset_profiles(model(), [(512, 512)], txt_tokens=(8, 256), batch=(2, 2))
    p = out[0][1]
    assert p["encoder_hidden_states"] == {"min": (2, 8, C), "opt": (2, 256, C),
                                          "max": (2, 256, C)}
    assert p["hidden_states"]["min"] == (2, 1, C)


def test_select_profile_first_covering_and_refusal():
    m = model()
    out = prof.derive_preset_profiles(m, [(512, 512), (1024, 1024), (1328, 1328)])
    ranges = [{n: (lv["min"], lv["max"]) for n, lv in p.items()} for _, p in out]
    labels = [label for label, _ in out]

    def shapes(b, img, txt):
        return {"hidden_states": (b, img, C), "encoder_hidden_states": (b, txt, C),
                "img_cos_sin_cache": (img, 16), "txt_cos_sin_cache": (txt, 16)}

    assert prof.select_profile(ranges, shapes(1, 64, 7)) == 0
    assert prof.select_profile(ranges, shapes(2, 1024, 512)) == 0
    assert prof.select_profile(ranges, shapes(2, 1025, 20)) == 1
    assert prof.select_profile(ranges, shapes(2, 4096, 20)) == 1
    assert prof.select_profile(ranges, shapes(1, 83 * 83, 20)) == 2
    for bad in (shapes(1, 83 * 83 + 1, 20), shapes(3, 64, 7), shapes(1, 64, 513)):
        with pytest.raises(prof.ProfileError, match=r"no optimisation profile.*\n  profile 0 "
                           r"\(512x512\).*\n  profile 1 \(1024x1024\).*\n  profile 2 "
                           r"\(1328x1328\)"):
            prof.select_profile(ranges, bad, labels)


def test_profiles_are_bounded_by_the_rope_tables():
    """Qwen-Image's RoPE tables hold 4096 positions per axis and direction: a preset whose image
    or text does not fit is refused with the limit (no call could use that profile), the
    largest that fits is accepted; a transformer's plain text range too."""
    from qkrope.runtime import engine as E

    m = model(with_timestep=True)
    # 131056 px = 8191 patches: centred 4096 one way, text from 4095: one text token fits;
    # 8192 patches fit the image but leave no text position; 8193 patches need 4097
    prof.check_rope_positions([(131056, 16)], 1)
    with pytest.raises(prof.ProfileError, match="more than the 0 text positions"):
        prof.check_rope_positions([(131072, 16)], 1)
    with pytest.raises(prof.ProfileError, match="needs 4097 RoPE positions.*4096"):
        prof.check_rope_positions([(131088, 16)], 1)
    # 1328x1328 = 83 patches: text starts at 41, 4055 rows left; the tightest preset governs
    prof.check_rope_positions([(512, 512), (1328, 1328)], 4055)
    with pytest.raises(prof.ProfileError, match="4055 text positions.*1328x1328"):
        prof.check_rope_positions([(512, 512), (1328, 1328)], 4056)
    with pytest.raises(prof.ProfileError, match="4064 text positions"):
        E.plan_profiles(m, E.BuildOptions(resolutions=[(1024, 1024)], txt_tokens=(1, 4065)))
    assert E.plan_profiles(m, E.BuildOptions(resolutions=[(1024, 1024)], txt_tokens=(1, 4064)))
    with pytest.raises(prof.ProfileError, match="4096 text positions"):
        E.plan_profiles(m, E.BuildOptions(max_img_tokens=64, max_txt_tokens=4097))
    assert E.plan_profiles(m, E.BuildOptions(max_img_tokens=64, max_txt_tokens=4096))
