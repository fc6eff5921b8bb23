"""The family registry (qkrope/families): records, lookups, hooks, and the checks every
family's options get before any work (issue 34 class 6), over the tiny builders
(tests/_families.py); the smoke test every family runs (a clone family's share of the heavy
per-builder matrices, which run over the representatives: tests/_families.py FULL_PARAMS)."""

from __future__ import annotations

import pytest

from qkrope import families
from qkrope.errors import InputError
from qkrope.families import _record

from _families import BUILDERS, FULL_PARAMS, PARAMS, SMOKE_PARAMS  # noqa: E402


def test_every_family_has_a_tiny_builder_and_its_records_are_consistent():
    assert set(BUILDERS) == set(families.names())
    for record in families.records():
        assert families.by_name(record.name) is record
        assert families.by_class(record.class_name) is record
        assert families.family_of({"_class_name": record.class_name}) is record
        assert record.scheme in _record.SCHEMES and sum(record.axes) > 0
    assert families.by_name(None) is families.default()
    assert families.by_class("NoSuchModel") is None
    with pytest.raises(InputError, match="model family 'no-such-family'.*re-export"):
        families.by_name("no-such-family")
    with pytest.raises(InputError, match="NoSuchModel.*Fix: give the folder of one of"):
        families.family_of({"_class_name": "NoSuchModel"})
    with pytest.raises(ValueError, match="hook kind"):
        families.hooks(families.default(), "nothing")


@pytest.mark.parametrize("builder", PARAMS)
def test_the_record_is_the_model_diffusers_builds(builder):
    """The record's facts against the tiny model: its class, its RoPE axis count, the FP8
    default exclusions are top-level modules of it, and the hooks import."""
    record = builder.record
    model = builder.build(0)
    assert type(model).__name__ == record.class_name
    axes = model.config.get("axes_dims_rope", model.config.get("rope_axes_dim")) \
        if builder.axes_key == "axes_dims_rope" else model.config[builder.axes_key]
    if axes is not None:  # else the family derives them from the head width (Wan, Cosmos)
        assert len(axes) == len(record.axes)
    assert set(record.fp8_excluded) <= {n for n, _ in model.named_children()}
    assert len(getattr(model, builder.main_blocks)) == builder.blocks == \
        model.config[record.blocks_key]
    from qkrope.families._dual_stream import SHARED_HOOKS

    for kind in families.HOOK_KINDS[:2]:  # export, reference (dropin: the runtime side's)
        # a dual-stream clone's are the shared ones (its record's dual_stream)
        assert families.hooks(record, kind).__name__ == (
            SHARED_HOOKS[kind] if record.dual_stream is not None
            else f"qkrope.families.{record.package}.{kind}")


@pytest.mark.parametrize("builder", PARAMS)
@pytest.mark.parametrize("layers", [-3, 0, 1, 999])
def test_export_layers_is_decided_from_the_record_before_any_work(builder, layers, tmp_path,
                                                                  tiny_root, capsys,
                                                                  monkeypatch):
    """``qkrope export --layers``: refused in one line for a family without ``blocks``, for
    a count below 1 (or below the first block the output layer reads:
    FamilyRecord.least_layers) and for one above the model's blocks, before the export starts
    (the exporter is never called)."""
    import json

    from qkrope.cli import main
    from qkrope.export import onnx_export

    called = []
    monkeypatch.setattr(onnx_export, "export_transformer",
                        lambda *a, **k: called.append(k) or (None, []))
    folder = builder.saved(tiny_root)
    least = builder.record.least_layers(json.loads((folder / "config.json").read_text()))
    rc = main(["export", "--model", "transformer", "--diffusers", str(folder), "--layers",
               str(layers), "--out", str(tmp_path / "m.onnx")])
    err = capsys.readouterr().err.strip()
    if builder.record.blocks and max(1, least) <= layers <= builder.blocks:
        assert rc == 0 and called and called[0]["layers"] == layers
    else:
        assert rc != 0 and not called and len(err.splitlines()) == 1, err
        assert "--layers" in err and "Fix:" in err


def _transformer_info(record, *, quantized=False):
    from _tiny_model import model as attention_info

    info = attention_info()
    info.model = "transformer"
    info.config.family = record.name
    info.config.num_layers_exported = 3
    if quantized:
        info.config.quantization = {"mode": "fp8"}
    return info


@pytest.mark.parametrize("record", families.records(), ids=families.names())
@pytest.mark.parametrize("quantized", [False, True], ids=["float", "fp8"])
@pytest.mark.parametrize("flags", [dict(blocks=True, layers=None), dict(blocks=False, layers=-3),
                                   dict(blocks=False, layers=999), dict(blocks=False, layers=2)],
                         ids=["blocks", "layers-3", "layers999", "layers2"])
def test_check_block_flags_are_decided_for_every_family(record, quantized, flags):
    """``qkrope check --blocks`` / ``--layers K`` before any work, for every family and FP8:
    only a float export of a family with ``blocks`` takes them, and K within its blocks."""
    from qkrope.apps import check

    info = _transformer_info(record, quantized=quantized)
    ok = record.blocks and not quantized and flags["layers"] in (None, 2)
    if ok:
        assert check._check_block_arguments("a.onnx", info, engine=None, onnxrt=True,
                                            **flags) is None
    else:
        with pytest.raises(InputError, match="Fix|pass 1 to 3") as e:
            check._check_block_arguments("a.onnx", info, engine=None, onnxrt=True, **flags)
        assert "\n" not in str(e.value)


def test_a_record_without_blocks_refuses_the_block_options_in_one_line():
    """Every family has blocks today; a record without them (a future family whose export
    keeps every block) is refused before any work, naming those that take the options."""
    import dataclasses

    record = dataclasses.replace(families.default(), name="no-blocks", blocks=False)
    with pytest.raises(InputError, match=r"--layers applies to .*Qwen-Image.*Fix: drop --layers") \
            as e:
        families.check_blocks_option(record, "--layers", 1)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="need the record's block_lists"):
        dataclasses.replace(families.default(), name="none", blocks=True, block_lists=())


def test_the_heavy_matrices_run_the_representatives_and_the_clones_the_smoke_test():
    """PARAMS is every family once, in registry order; FULL_PARAMS (the heavy matrices) and
    SMOKE_PARAMS split it by ``smoke``, the default family is a representative, and so is the
    first record of each folder, its later records the clones (one representative per folder)."""
    ids = [p.id for p in PARAMS]
    assert ids == [n for n in families.names() if n in BUILDERS] and len(set(ids)) == len(ids)
    assert sorted([p.id for p in FULL_PARAMS] + [p.id for p in SMOKE_PARAMS]) == sorted(ids)
    assert all(not p.values[0].smoke for p in FULL_PARAMS)
    assert all(p.values[0].smoke for p in SMOKE_PARAMS)
    assert families.default().name in [p.id for p in FULL_PARAMS]
    folders = {}
    for r in families.records():
        folders.setdefault(r.package, []).append(r.name)
    for first, *later in folders.values():
        assert all(BUILDERS[n].smoke for n in later if n in BUILDERS), (first, later)


def test_a_builder_is_one_line_or_derived_from_the_tiny_hook(monkeypatch):
    """``from_tiny`` names a tiny hook's builder function; a tiny hook's ``build_transformer``
    gives the builder itself (the folder rule makes it a clone: the test above)."""
    import _families

    chroma = families.by_name("chroma")
    one = _families.from_tiny("chroma", "chroma_transformer", smoke=True)
    assert one.smoke and one.record is chroma and one.main_blocks == "transformer_blocks"
    assert type(one.build(0)).__name__ == chroma.class_name and one.blocks == 1
    tiny = families.hooks(chroma, "tiny")
    assert _families._derived(chroma) is None  # no build_transformer: an entry in BUILDERS
    monkeypatch.setattr(tiny, "build_transformer",
                        lambda record, seed=0: tiny.chroma_transformer(seed), raising=False)
    derived = _families._derived(chroma)
    assert derived.family == "chroma" and not derived.smoke and derived.blocks == 1


@pytest.mark.slow
@pytest.mark.parametrize("builder", PARAMS)
def test_smoke_export_check_and_dropin(builder, tmp_path, tiny_root, capsys):
    """Every family, clones included: the fp32 export passes ``qkrope check`` (diffusers'
    forward against the graph at the family's default sizes, its derived bounds), and the
    drop-in loaded from it runs the family's base input form (tests/_input_forms.py) to
    diffusers' output shape, finite."""
    import torch
    from _input_forms import FORMS

    from qkrope.cli import main
    from qkrope.runtime import load_transformer

    out = builder.exported(tiny_root)  # the session's (the check writes into its --workdir)
    assert main(["check", str(out), "--workdir", str(tmp_path / "check")]) == 0
    assert "PASSED" in capsys.readouterr().out
    model = builder.build(0).eval()
    base = FORMS[builder.family](model, 1, torch.Generator().manual_seed(1))["base"]
    dropin = load_transformer(out)

    def sample(result):
        got = result[0] if isinstance(result, tuple) else result.sample
        return torch.stack(got) if isinstance(got, list) else got

    with torch.no_grad():
        stock, ours = sample(model(**base)), sample(dropin(**base))
    assert ours.shape == stock.shape and torch.isfinite(ours).all()
