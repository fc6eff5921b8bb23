"""qkrope/sidecars/config.py: the config as a typed record (a field of the wrong type named),
written back as it was read; the node attributes stored once and read from older sidecars."""

from __future__ import annotations

import pytest

from _tiny_model import sidecar_dict

from qkrope.sidecars import FORMAT_VERSION, ModelInfo, ModelInfoError


def test_config_is_a_checked_record():
    from qkrope.sidecars import ModelConfig

    side = sidecar_dict()
    info = ModelInfo.from_dict(side)
    assert isinstance(info.config, ModelConfig) and info.config.head_dim == 16
    assert info.config.parameters == ["w"] and info.config.axes_dims_rope is None
    for key, value, expected in (("head_dim", "sixteen", "a positive int"),
                                 ("heads", True, "a positive int"),
                                 # an axis count no family has (each family's count listed)
                                 ("axes_dims_rope", [16] * 7, r"a list of (\d \([^)]*\)(, | or ))*"
                                  r"3 \(Qwen-Image, FLUX.1[^)]*\) or 4 \(FLUX.2[^)]*\) "
                                  r"(or \d+ \([^)]*\) )*non-negative ints"),
                                 ("family", "sd3", r"one of \[.*'flux1', 'flux2'.*'qwen-image'.*\]"),
                                 ("rope_theta", 0, "a positive number"),
                                 ("parameters", "w", "a list of str"),
                                 ("dtype", "float32", "one of")):
        bad = sidecar_dict()
        bad["config"][key] = value
        with pytest.raises(ModelInfoError, match=rf"<dict>: config field '{key}' must be "
                                                 rf"{expected}"):
            ModelInfo.from_dict(bad)


def test_config_reads_and_writes_back_the_same_json():
    """An old config (explicit nulls, keys this qkrope does not type, format 1's node values)
    is written back unchanged, so the engine's config tag of an older build still matches."""
    from qkrope.sidecars import ModelConfig, config_tag

    raw = {"dim": 32, "heads": 2, "head_dim": 16, "eps": 1e-6, "interleaved": True,
           "rounding": 0, "weights": None, "weights_sha256": None, "future_field": {"a": [1]},
           "axes_dims_rope": [2, 6, 8]}
    config = ModelConfig.from_dict(raw)
    assert config.to_dict() == raw and config_tag(config) == config_tag(raw)
    assert config.extra == {"eps": 1e-6, "interleaved": True, "rounding": 0,
                            "future_field": {"a": [1]}}


def test_node_attributes_are_stored_once_and_read_from_old_sidecars():
    from qkrope.contract import NodeAttributes

    side = sidecar_dict()
    side["format_version"] = FORMAT_VERSION
    side["node_attributes"] = NodeAttributes(1e-5, False, 1).to_node()
    info = ModelInfo.from_dict(side)
    assert info.node_attributes == NodeAttributes(1e-5, False, 1)
    assert ModelInfo.from_dict(info.to_dict()).node_attributes == info.node_attributes
    # format 1 wrote them into config too, and a sidecar may lack node_attributes: config's
    old = sidecar_dict()
    old["config"].update(eps=1e-5, interleaved=False, rounding=1)
    assert ModelInfo.from_dict(old).attributes == NodeAttributes(1e-5, False, 1)
    assert ModelInfo.from_dict(sidecar_dict()).attributes == NodeAttributes()  # the defaults
    bad = sidecar_dict()
    bad["node_attributes"] = {"epsilon": 0.0, "interleaved": 1, "rounding": 0}
    with pytest.raises(ModelInfoError, match="node_attributes' is invalid: eps must be"):
        ModelInfo.from_dict(bad)
