"""The family contract (qkrope/families/_contract.py) held against the registry: every family's
every hook module imports and meets its kind's Protocols (names, call shapes, constants), the
names generic code reads off a hook module are the Protocols' (read from the code with
``ast``), every record's fields are values the runtime has, and the lists that two layers
keep (schemes, latent layouts) agree."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import sys
import types
from collections.abc import Mapping
from pathlib import Path

import pytest

from qkrope import contract, families
from qkrope.families import _contract, _record
from qkrope.model_io import ModelDecl

ROOT = Path(__file__).resolve().parent.parent
HOOKS = [pytest.param(record, kind, id=f"{record.name}-{kind}")
         for record in families.records() for kind in families.HOOK_KINDS]


def test_the_hook_kinds_are_the_contracts():
    assert families.HOOK_KINDS == tuple(_contract.CONTRACTS) == (
        "export", "reference", "dropin", "tiny")
    for kind, c in _contract.CONTRACTS.items():
        names = _contract.members(c.required)
        assert names, kind  # a kind with nothing required is no contract
        assert not set(names) & set(_contract.members(c.optional)), kind


@pytest.mark.parametrize("record, kind", HOOKS)
def test_every_hook_module_meets_its_contract(record, kind):
    """Imported through the registry (the check on its required names), its functions callable
    as the Protocols declare, the optional constants of the declared kinds."""
    from qkrope.families._dual_stream import SHARED_HOOKS

    module = families.hooks(record, kind)
    own = f"qkrope.families.{record.package}.{kind}"
    if record.dual_stream is not None and kind in SHARED_HOOKS and not (
            Path(families.__file__).parent / record.package / f"{kind}.py").is_file():
        assert module.__name__ == SHARED_HOOKS[kind]  # a clone's shared hook
    else:
        assert module.__name__ == own
    assert _contract.missing(module, kind) == ()
    assert _contract.signature_problems(module, kind) == [], module.__name__
    if kind == "reference":
        from qkrope.apps.check import DEFAULT_CHECK_SAMPLE

        images = getattr(module, "IMAGES", 1)
        assert isinstance(images, int) and not isinstance(images, bool) and images >= 1
        sample = getattr(module, "CHECK_SAMPLE", {})
        assert isinstance(sample, Mapping) and set(sample) <= set(DEFAULT_CHECK_SAMPLE)
    if kind == "dropin":
        from qkrope.runtime._dropin import Transformer

        cls = module.dropin_class(record)
        assert isinstance(cls, type) and issubclass(cls, Transformer), cls
        args = getattr(cls, "FORWARD_ARGS", ())
        assert isinstance(args, tuple) and all(isinstance(a, str) for a in args)
        public = getattr(module, "PUBLIC", {})
        assert isinstance(public, Mapping) and all(callable(v) for v in public.values())
    if kind == "tiny" and hasattr(module, "build_transformer"):
        assert type(module.build_transformer(record, 0)).__name__ == record.class_name


def test_a_hook_module_without_a_required_name_is_refused_in_one_line(monkeypatch):
    record = dataclasses.replace(families.default(), name="probe", package="probe_family")
    stub = types.ModuleType("qkrope.families.probe_family.dropin")
    stub.dropin_class = lambda record: None  # sample_request left out
    monkeypatch.setitem(sys.modules, stub.__name__, stub)
    with pytest.raises(_contract.FamilyContractError) as err:
        families.hooks(record, "dropin")
    text = str(err.value)
    assert "\n" not in text and "'probe'" in text and "dropin" in text, text
    assert "sample_request" in text and "dropin_class" not in text, text
    assert "DropinHooks" in text and "_contract.py" in text and "Fix:" in text, text
    stub.sample_request = lambda record, img_shapes, txt_len: {}
    stub.CONTRACT = _contract.ExportHooks  # declares another kind's contract
    families._hooks.cache_clear()
    with pytest.raises(_contract.FamilyContractError,
                       match=r"^family 'probe': .* declares CONTRACT = ExportHooks, not "
                             r"DropinHooks\. Fix: import DropinHooks as CONTRACT"):
        families.hooks(record, "dropin")
    stub.CONTRACT = _contract.DropinHooks
    families._hooks.cache_clear()
    assert families.hooks(record, "dropin") is stub
    families._hooks.cache_clear()


def test_call_shapes_are_checked():
    """A function that cannot be called as its Protocol declares is named."""
    bad = types.SimpleNamespace(
        dropin_class=lambda: None,  # takes no record
        sample_request=lambda record, img_shapes, txt_len, extra: {},  # requires more
        PUBLIC=lambda: None)  # a function where a mapping is declared
    problems = _contract.signature_problems(bad, "dropin")
    assert len(problems) == 3, problems
    good = types.SimpleNamespace(check_config=lambda d, c, t, *, memory=True: None,
                                 prepare=lambda r, t, **kw: None, post_export=lambda m: None)
    assert _contract.signature_problems(good, "export") == []
    assert _contract.signature_problems(
        types.SimpleNamespace(check_config=lambda d, c, t: None), "export") == [
        "check_config: takes no keyword argument 'memory'"]


# --------------------------------------------------------------------------------------------
# What generic code reads off a hook module: the Protocols' names, and no other
# --------------------------------------------------------------------------------------------

GENERIC = {"qkrope": ROOT / "qkrope", "export": ROOT / "export", "runtime": ROOT / "runtime"}


def _hooks_call_kind(node) -> str | None:
    """``kind`` of a call ``families.hooks(record, "kind")`` (or ``hooks(...)``), else None."""
    if isinstance(node, ast.Call) and len(node.args) == 2 and isinstance(
            node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
        f = node.func
        if (isinstance(f, ast.Attribute) and f.attr == "hooks"
                and isinstance(f.value, ast.Name) and f.value.id == "families"):
            return node.args[1].value
    return None


def _scope_nodes(scope):
    """The nodes of one function (or the module) body, nested functions left out."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


def _names_read(scope, bound=None, out=None) -> dict[str, set[str]]:
    """kind -> the names read off a hook module: ``families.hooks(r, k).name``, a variable
    assigned from it ``.name`` (in its function and the functions nested in it),
    ``getattr`` / ``hasattr`` with a constant name."""
    out = {} if out is None else out
    bound = dict(bound or {})
    nodes = list(_scope_nodes(scope))
    for node in nodes:
        if isinstance(node, ast.Assign) and (kind := _hooks_call_kind(node.value)):
            bound.update({t.id: kind for t in node.targets if isinstance(t, ast.Name)})
    for node in nodes:
        target = kind = None
        if isinstance(node, ast.Attribute):
            kind = _hooks_call_kind(node.value) or (
                bound.get(node.value.id) if isinstance(node.value, ast.Name) else None)
            target = node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant)):
            obj = node.args[0]
            kind = _hooks_call_kind(obj) or (
                bound.get(obj.id) if isinstance(obj, ast.Name) else None)
            target = node.args[1].value
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            _names_read(node, bound, out)
        if kind and target != "__name__":
            out.setdefault(kind, set()).add(target)
    return out


def test_generic_code_reads_only_the_contracts_names_and_uses_every_required_one():
    read: dict[str, set[str]] = {}
    for folder in GENERIC.values():
        for path in folder.rglob("*.py"):
            if "families" in path.relative_to(ROOT).parts[1:2]:
                continue  # the registry and the family folders themselves
            for kind, names in _names_read(ast.parse(path.read_text(), str(path))).items():
                read.setdefault(kind, set()).update(names)
    assert set(read) <= set(families.HOOK_KINDS), read
    for kind, c in _contract.CONTRACTS.items():
        declared = set(_contract.members(c.required)) | set(_contract.members(c.optional))
        assert read.get(kind, set()) <= declared, (kind, read.get(kind, set()) - declared)
        assert set(_contract.members(c.required)) <= read.get(kind, set()), kind
    # and the parser finds them (the reading above is not vacuous)
    assert {"prepare", "post_export", "check_config"} <= read["export"]
    assert {"IMAGES", "graph_output", "forward_kwargs"} <= read["reference"]


# --------------------------------------------------------------------------------------------
# The records: every field a value the layers that read it have
# --------------------------------------------------------------------------------------------

def test_the_schemes_and_latent_kinds_are_the_runtimes():
    """One list each: the records' names (root, no torch) and the runtime's registries agree."""
    from qkrope.runtime import latents, schemes

    assert set(_record.SCHEMES) == set(schemes.SCHEMES)
    assert all(schemes.scheme(name).NAME == name for name in _record.SCHEMES)
    assert set(_record.LATENT_KINDS) == {latents.PACKED_TOKENS, latents.VIDEO_5D}


@pytest.mark.parametrize("record", families.records(), ids=families.names())
def test_every_record_names_what_the_runtime_has(record):
    from qkrope.runtime import schemes

    module = importlib.import_module(f"qkrope.families.{record.package}")
    assert record in module.RECORDS and record.package in families.FAMILY_PACKAGES
    assert record.scheme in schemes.SCHEMES
    assert record.rope_precision in schemes.PRECISIONS
    assert record.rotated and set(record.rotated) <= set(schemes.STREAMS)
    assert record.rounding in contract.ROUNDING_MODES
    assert isinstance(record.graph, ModelDecl)
    assert record.axes and all(isinstance(a, int) and a > 0 for a in record.axes)
    assert record.theta > 0 and record.pixels_per_token > 0
    assert all(isinstance(k, (str, type(None))) for k in (record.theta_key,
                                                           record.max_positions_key))
    assert record.fp8_excluded and all(isinstance(n, str) and n for n in record.fp8_excluded)
    if record.rope_rule is not None:
        assert callable(getattr(module, record.rope_rule, None)), record.rope_rule
    for launch in record.launches:
        assert set(launch.roundings) <= set(contract.ROUNDING_MODES)
        assert launch.norm_scope in contract.NORM_SCOPES
    if record.blocks:
        assert record.block_lists and all(b.attr and b.key for b in record.block_lists)
