"""The tags an engine keeps as its network name: a hash of its sidecar's facts known before the
build (:func:`facts_tag`; an older build's :func:`config_tag` of the model config) and the
sidecar's write id; read back off the engine file (:func:`engine_file_tags`) or off
``ICudaEngine.name``."""

from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping

from .config import ModelConfig

CONFIG_TAG_PREFIX = "qkrope-config-"
WRITE_ID_SEPARATOR = ".write-"  # network name: <facts tag>.write-<the sidecar's write_id>


def engine_network_name(info: "EngineInfo") -> str:
    """The network name ``qkrope build`` gives an engine (the engine keeps it): the
    :func:`facts_tag` of its sidecar and the write id the sidecar records (checked by
    :meth:`EngineInfo.check_engine_name`; the sidecar records it too, as ``network_name``)."""
    tag = facts_tag(info)
    return tag + WRITE_ID_SEPARATOR + info.write_id if info.write_id else tag


def config_tag(config: "ModelConfig | Mapping[str, Any]") -> str:
    """What ``qkrope build`` names the network (so the engine keeps it): a hash of the model
    config the engine is built from, checked against the engine sidecar's config on load
    (:meth:`EngineInfo.check_engine_name`)."""
    import hashlib

    if isinstance(config, ModelConfig):
        config = config.to_dict()
    text = json.dumps(config, sort_keys=True)
    return CONFIG_TAG_PREFIX + hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


FACTS_TAG_PREFIX = "qkrope-facts-"
#: The tags an engine file may carry (its network name; a plan keeps it as text): a facts tag
#: (this qkrope's builds) or a config tag (older ones).
_TAG_RE = re.compile(rb"qkrope-(?:facts|config)-[0-9a-f]{32}")
#: Engine sidecar fields not in the facts tag: known only after the build (its time, when it
#: was written, the engine's own hash: checked against the file itself), or, inside build_key
#: and config.quantization, the built engine's hash and FP8 layer summary.
_POST_BUILD_FIELDS = ("build_seconds", "created", "engine_sha256", "engine_file", "network_name")


def engine_facts(info: "EngineInfo") -> dict[str, Any]:
    """The engine sidecar's facts that are known before TensorRT builds the engine (every field
    but :data:`_POST_BUILD_FIELDS`, the build key's ``engine_sha256`` and an FP8 config's
    ``quantization.engine``): what :func:`facts_tag` hashes."""
    d = info.to_dict()
    for key in _POST_BUILD_FIELDS:
        d.pop(key, None)
    if isinstance(d.get("build_key"), dict):
        d["build_key"] = {k: v for k, v in d["build_key"].items() if k != "engine_sha256"}
    quant = d["config"].get("quantization")
    if isinstance(quant, dict):
        d["config"] = {**d["config"], "quantization": {k: v for k, v in quant.items()
                                                       if k != "engine"}}
    return d


def facts_tag(info: "EngineInfo") -> str:
    """What ``qkrope build`` names the network (so the engine keeps it): a hash of every fact
    its sidecar states before the build (:func:`engine_facts`: the I/O with roles and axes, the
    profiles, the model config with its RoPE axes, the plugin, the build options and key).
    An engine sidecar edited beside its engine no longer gives its engine's tag: refused on
    load (:meth:`EngineInfo.load` reads the tag off the engine file, the runner off
    ``ICudaEngine.name``)."""
    import hashlib

    text = json.dumps(engine_facts(info), sort_keys=True, default=str)
    return FACTS_TAG_PREFIX + hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def engine_file_tags(engine_path: str | os.PathLike) -> tuple[str, set[str]]:
    """``(sha256 hex, the qkrope tags in it)`` of an engine file, in one read: the tags are the
    network names qkrope builds give (:func:`facts_tag`, :func:`config_tag`) where the plan
    keeps them as text."""
    import hashlib

    digest, tags, tail = hashlib.sha256(), set(), b""
    keep = len(FACTS_TAG_PREFIX) + 32
    with open(engine_path, "rb") as f:
        while True:
            chunk = f.read(1 << 22)
            if not chunk:
                break
            digest.update(chunk)
            window = tail + chunk
            tags.update(m.decode("ascii") for m in _TAG_RE.findall(window))
            tail = window[-keep:]
    return digest.hexdigest(), tags
