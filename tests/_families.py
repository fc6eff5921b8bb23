"""Tiny test builders, one per model family, keyed by the family record's name
(:func:`qkrope.families.names`): the registry the family-parametrised tests run over
(tests/test_famil*.py, test_check_blocks_families.py, test_input_forms.py,
test_dropin_component_families.py).

A new family gets a builder in one of two ways:

- its tiny hook defines ``build_transformer(record, seed)`` (the optional name of
  qkrope.families._contract.TinyExtras): nothing to add here (:func:`_derived`);
- else one line in :data:`BUILDERS` naming its tiny hook's builder function, e.g.
  ``"ovis-image": from_tiny("ovis-image", "ovis_transformer", smoke=True),``.

A clone family shares its representative's helpers: every record that shares its folder with
an earlier record (FLUX.2 of FLUX.1's folder, HunyuanVideo and FramePack of HunyuanVideo-1.5's,
the Wan derivatives), and the builders marked ``smoke=True`` (a FLUX-like class on the shared
dual-stream helper). The heavy matrices run over :data:`FULL_PARAMS` (one representative per
shared helper), the smoke test (tests/test_families.py) and the cheap per-family tests over
:data:`PARAMS` (every family).

Sizes: FLUX.1 / FLUX.2 and HunyuanVideo-1.5 / HunyuanVideo are diffusers' own test configs
(tests/_flux_models.py, tests/_hunyuan_video_models.py); Z-Image is diffusers' test config;
Chroma is diffusers' pipeline-test transformer (tests/pipelines/chroma: 1 double + 1 single
block, 2 heads x 16, RoPE axes (4, 4, 8), an approximator of 1 layer x 32); Qwen-Image is
the project's tiny pipeline transformer (qkrope.apps.tiny_pipeline: 2 blocks x 2 heads x 32,
RoPE axes (8, 12, 12), the sizes its export and pipeline tests were tuned on); Z-Image is
diffusers' own test config (tests/pipelines/z_image: 2 + 1 + 1 blocks x 2 heads x 16, RoPE axes
(8, 4, 4), tables (256, 32, 32)). Each builder's model is random with weights of a non-trivial
scale (diffusers' init zeroes some layers).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import pytest

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

import _flux_models as fm  # noqa: E402
import _hunyuan_video_models as hvm  # noqa: E402

from qkrope import families  # noqa: E402
from qkrope.apps import tiny_pipeline as tp  # noqa: E402
# the tiny configs and builders live in the family folders (their tiny pipeline recipes)
from qkrope.families.chroma import tiny as chroma_tiny  # noqa: E402
from qkrope.families.cosmos import tiny as cosmos_tiny  # noqa: E402
from qkrope.families.hunyuan_image import tiny as hi_tiny  # noqa: E402
from qkrope.families.wan import tiny as wan_tiny  # noqa: E402
from qkrope.families.z_image import tiny as z_tiny  # noqa: E402


@dataclass(frozen=True)
class TinyBuilder:
    """One family's tiny transformer: ``build(seed)`` makes it; ``blocks`` its number of main
    blocks (``block_count``, else its config's ``record.blocks_key``)."""

    family: str  # the record's name
    variant: str  # what it is, in test ids
    build: Callable[[int], object]
    block_count: int | None = None  # None: the built model's config[record.blocks_key]
    axes_key: str = "axes_dims_rope"  # the config key of its RoPE axes
    blocks_attr: str | None = None  # None: the attribute of the record's blocks_key list
    smoke: bool = False  # a clone family: the smoke subset of the heavy matrices only

    @property
    def record(self):
        return families.by_name(self.family)

    @property
    def blocks(self) -> int:
        if self.block_count is not None:
            return self.block_count
        if self.variant not in _BLOCKS:
            _BLOCKS[self.variant] = int(self.build(0).config[self.record.blocks_key])
        return _BLOCKS[self.variant]

    @property
    def main_blocks(self) -> str:
        """The model attribute of its main block list."""
        if self.blocks_attr is not None:
            return self.blocks_attr
        record = self.record
        return next((b.attr for b in record.block_lists if b.key == record.blocks_key),
                    "transformer_blocks")

    def saved(self, root: Path) -> Path:
        """The model's folder (save_pretrained), once per session and root. The tests that only
        read it pass the session's ``tiny_root`` (tests/conftest.py) and share one."""
        key = (self.variant, str(root))
        if key not in _SAVED:
            folder = root / f"{self.variant}-diffusers"
            self.build(0).save_pretrained(str(folder))
            _SAVED[key] = folder
        return _SAVED[key]

    def exported(self, root: Path, dtype: str = "fp32") -> Path:
        """The model's export in ``dtype`` (``export_transformer`` of :meth:`saved`), once per
        session and root: ``root/<variant>-<dtype>/<variant>.onnx``. The matrices that only
        read it pass ``tiny_root`` and share one; a test that writes next to an export, moves
        or re-exports it exports its own. A failed export fails every test that asks for it
        with the same error (never a retry over its leftovers)."""
        key = (self.variant, dtype, str(root))
        if key not in _EXPORTED:
            from qkrope.export.api import export_transformer

            out = root / f"{self.variant}-{dtype}" / f"{self.variant}.onnx"
            out.parent.mkdir(parents=True, exist_ok=True)
            try:
                export_transformer(self.saved(root), out, dtype=dtype, progress=False)
            except Exception as exc:
                _EXPORTED[key] = exc
                raise
            _EXPORTED[key] = out
        if isinstance(_EXPORTED[key], Exception):
            raise _EXPORTED[key]
        return _EXPORTED[key]


_BLOCKS: dict[str, int] = {}
_SAVED: dict[tuple[str, str], Path] = {}
_EXPORTED: dict[tuple[str, str, str], Path | Exception] = {}


def _flux(variant: str) -> TinyBuilder:
    family, _, config = fm.VARIANTS[variant]
    return TinyBuilder(family.name, variant, lambda seed: fm.transformer(variant, seed),
                       int(config["num_layers"]))


#: diffusers' Z-Image test config, and its tiny transformer (the pad tokens random too)
Z_IMAGE_CONFIG, z_image_transformer = z_tiny.Z_IMAGE_CONFIG, z_tiny.z_image_transformer


#: Chroma: diffusers' pipeline-test sizes, and its tiny random ChromaTransformer2DModel
CHROMA_CONFIG, chroma_transformer = chroma_tiny.CHROMA_CONFIG, chroma_tiny.chroma_transformer


#: Wan: diffusers' own test config, and its tiny transformer (RMSNorm weights random)
WAN_CONFIG, wan_transformer = wan_tiny.WAN_CONFIG, wan_tiny.wan_transformer


#: diffusers' own test config of HunyuanImage-2.1 (its tiny pipeline recipe's transformer)
_hunyuan_image = hi_tiny.hunyuan_image_transformer


#: diffusers' Cosmos-Predict2 Video2World test config (a condition-mask channel)
COSMOS_CONFIG = cosmos_tiny.COSMOS_CONFIG


def cosmos_torchvision_standin() -> None:
    """diffusers' Cosmos forward resizes the padding mask with torchvision, which the test
    environment may lack: its tensor path (``F.interpolate(mode="nearest")``) stands in for
    it then (what the drop-in does too)."""
    import types

    import diffusers.models.transformers.transformer_cosmos as tc
    import torch.nn.functional as nnf

    if not hasattr(tc, "transforms"):
        tc.transforms = types.SimpleNamespace(
            functional=types.SimpleNamespace(
                resize=lambda t, size, interpolation=None: nnf.interpolate(t, size=size,
                                                                           mode="nearest")),
            InterpolationMode=types.SimpleNamespace(NEAREST="nearest"))


def cosmos_transformer(seed: int = 0, **overrides):
    """The tiny Cosmos-Predict2 transformer (qkrope.families.cosmos.tiny), diffusers' forward
    made to run without torchvision."""
    cosmos_torchvision_standin()
    return cosmos_tiny.cosmos_transformer(seed, **overrides)


def from_tiny(name: str, function: str, **fields) -> TinyBuilder:
    """The builder of family ``name`` that calls ``function(seed)`` of its tiny hook
    (qkrope/families/<package>/tiny.py), with :class:`TinyBuilder`'s other fields."""
    build = getattr(families.hooks(families.by_name(name), "tiny"), function)
    return TinyBuilder(name, fields.pop("variant", name), build, **fields)


def _derived(record) -> TinyBuilder | None:
    """The builder of a family whose tiny hook defines ``build_transformer(record, seed)``."""
    build = getattr(families.hooks(record, "tiny"), "build_transformer", None)
    if build is None:
        return None
    return TinyBuilder(record.name, record.name, functools.partial(build, record))


#: family name -> its tiny builder (the families whose tiny hook offers no build_transformer)
BUILDERS: dict[str, TinyBuilder] = {
    "qwen-image": TinyBuilder("qwen-image", "qwen-image", tp.tiny_transformer,
                              int(tp.TRANSFORMER_CONFIG["num_layers"])),
    "flux1": _flux("flux1-schnell"),
    "flux2": _flux("flux2-klein"),
    **{v: TinyBuilder(v, v, (lambda seed, v=v: hvm.transformer(v, seed)),
                      int(hvm.VARIANTS[v][1]["num_layers"]))
       for v in hvm.VARIANTS},
    "z-image": TinyBuilder("z-image", "z-image", z_image_transformer,
                           int(Z_IMAGE_CONFIG["n_layers"]), axes_key="axes_dims"),
    "chroma": TinyBuilder("chroma", "chroma", chroma_transformer,
                          int(CHROMA_CONFIG["num_layers"])),
    "wan": TinyBuilder("wan", "wan", wan_transformer, WAN_CONFIG["num_layers"]),
    "hunyuan-image": TinyBuilder("hunyuan-image", "hunyuan-image", _hunyuan_image, 1),
    "cosmos-predict2": TinyBuilder("cosmos-predict2", "cosmos-predict2", cosmos_transformer,
                                   int(COSMOS_CONFIG["num_layers"])),
    # clone families (smoke=True): one line each, e.g.
    # "ovis-image": from_tiny("ovis-image", "ovis_transformer", smoke=True),
    "longcat-image": from_tiny("longcat-image", "longcat_transformer", smoke=True),
    "ovis-image": from_tiny("ovis-image", "ovis_transformer", smoke=True),
    "bria": from_tiny("bria", "bria_transformer", smoke=True),
}
BUILDERS.update({r.name: b for r in families.records() if r.name not in BUILDERS
                 for b in [_derived(r)] if b is not None})
#: FLUX.3 (derived): no transformer_blocks; its per-mode lists hold num_layers blocks each
BUILDERS["flux3"] = replace(BUILDERS["flux3"], blocks_attr="txt_mode_blocks")


def _clones() -> set[str]:
    """The records that share their folder with an earlier record (registry order)."""
    folders, out = set(), set()
    for r in families.records():
        if r.package in folders:
            out.add(r.name)
        folders.add(r.package)
    return out


BUILDERS.update({name: replace(b, smoke=True) for name, b in BUILDERS.items()
                 if name in _clones()})

#: pytest parameters: one per family, in registry order (the cheap tests and the smoke test)
PARAMS = [pytest.param(BUILDERS[name], id=name) for name in families.names() if name in BUILDERS]
#: the representatives (smoke=False): the heavy per-builder matrices
FULL_PARAMS = [p for p in PARAMS if not p.values[0].smoke]
#: the clone families (smoke=True)
SMOKE_PARAMS = [p for p in PARAMS if p.values[0].smoke]
