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
