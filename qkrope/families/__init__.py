"""The model families qkrope exports, one folder each, and the registry over them.

A family folder ``qkrope/families/<package>/`` holds:

- ``__init__.py``: ``RECORDS``, its :class:`FamilyRecord` (facts only, no torch);
- ``export.py`` (export layer): the export hooks (config check, attention processors, the
  cache-input wrapper, sample inputs, post-export checks);
- ``reference.py`` (runtime layer): the keyword arguments of its reference (diffusers) forward;
- ``dropin.py`` (runtime layer): the pipeline drop-in;
- ``tiny.py`` (apps layer): its tiny random pipeline built in code,
  ``save_pipeline(record, directory, seed)`` (qkrope.apps.tiny_pipeline).
A dual-stream clone (its record's ``dual_stream`` set) has only ``__init__.py`` and ``tiny.py``:
its other hooks are the shared ones (qkrope.families._dual_stream.SHARED_HOOKS).

:data:`FAMILY_PACKAGES` is the one list a new family is added to. The registry is keyed by the
diffusers class (:func:`by_class`, :func:`family_of`) and by the sidecar's family name
(:func:`by_name`); a folder's record module may also name the classes it cannot serve, with
why (``REFUSED``: :func:`refused`, refused by class in :func:`family_of`). :func:`hooks`
imports a family's hook module on first use (by a string, so ``import qkrope`` and ``--help``
import no torch) and checks it against its kind's Protocol
(qkrope.families._contract: the one list of what each hook module defines). A family folder
imports no other family and not this registry; generic code imports no family module by name
(tests/test_layering.py).
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any, Literal, overload

from qkrope.families._contract import CONTRACTS, checked
from qkrope.families._record import FamilyRecord

if TYPE_CHECKING:
    from qkrope.families._contract import DropinHooks, ExportHooks, ReferenceHooks, TinyHooks

#: The family folders, in registry order (the first is the default of an old sidecar that
#: names no family).
FAMILY_PACKAGES = ("qwen_image", "flux", "chroma", "hunyuan_video", "hunyuan_image", "z_image",
                   "cosmos", "wan", "longcat_image", "ovis_image", "bria",
                   "joyimage", "motif_video", "ernie_image", "kandinsky5", "prx",
                   "flux3", "minimax_h3", "ideogram4")
#: The hook modules a family folder has (each kind's Protocols: qkrope.families._contract).
HOOK_KINDS = tuple(CONTRACTS)


@functools.lru_cache(maxsize=1)
def records() -> tuple[FamilyRecord, ...]:
    """Every family record, in registry order."""
    out: list[FamilyRecord] = []
    for package in FAMILY_PACKAGES:
        module = importlib.import_module(f"{__name__}.{package}")
        for record in module.RECORDS:
            if record.package != package:
                raise RuntimeError(f"{record.name}'s record names package {record.package!r} "
                                   f"but lives in {package!r}")
            out.append(record)
    names = [r.name for r in out]
    classes = [r.class_name for r in out]
    if len(set(names)) != len(names) or len(set(classes)) != len(classes):
        raise RuntimeError(f"family names {names} / classes {classes} must be unique")
    return tuple(out)


@functools.lru_cache(maxsize=1)
def refused() -> dict[str, str]:
    """The diffusers classes a family folder declares it cannot serve (its record module's
    optional ``REFUSED``: class name -> the reason, qkrope.families._contract.RecordExtras), in
    registry order; a class both served and refused, or refused twice, is a folder's bug."""
    out: dict[str, str] = {}
    served = {r.class_name for r in records()}
    for package in FAMILY_PACKAGES:
        for name, why in getattr(importlib.import_module(f"{__name__}.{package}"), "REFUSED",
                                 {}).items():
            if name in served:
                raise RuntimeError(f"{package}: REFUSED names {name!r}, which a record serves. "
                                   f"Fix: drop it from REFUSED or from the records")
            if name in out:
                raise RuntimeError(f"{package}: REFUSED names {name!r}, which another folder "
                                   f"refuses already. Fix: keep one folder's entry")
            if not isinstance(why, str) or not why:
                raise RuntimeError(f"{package}: REFUSED[{name!r}] is {why!r}, not a reason. "
                                   f"Fix: give the one-clause reason the refusal prints")
            out[name] = why
    return out


def names() -> tuple[str, ...]:
    """The sidecar family names, in registry order."""
    return tuple(r.name for r in records())


def default() -> FamilyRecord:
    """The family of a transformer sidecar written before sidecars named one."""
    return records()[0]


def by_class(class_name: str | None) -> FamilyRecord | None:
    """The family of a diffusers class name (config.json ``_class_name``), or None."""
    return next((r for r in records() if r.class_name == class_name), None)


def by_name(name: str | None, *, source: str = "the sidecar") -> FamilyRecord:
    """The family a sidecar names (None: :func:`default`); an InputError listing the known
    ones otherwise."""
    if name is None:
        return default()
    record = next((r for r in records() if r.name == name), None)
    if record is None:
        from qkrope.errors import InputError

        raise InputError(f"{source} names model family {name!r}, which this qkrope does not "
                         f"know (it knows {', '.join(names())}). Fix: re-export the model with "
                         f"this qkrope (qkrope export --model transformer)")
    return record


def describe() -> str:
    """The families as a user reads them: ``Class (label); ...``."""
    return "; ".join(f"{r.class_name} ({r.label})" for r in records())


def family_of(config: Any, *, source: str = "the diffusers config") -> FamilyRecord:
    """The family a diffusers ``config`` (config.json as a mapping) belongs to, from its
    ``_class_name``; an InputError with the reason for a class a folder refuses
    (:func:`refused`), one listing the families otherwise."""
    from qkrope.errors import InputError

    name = config.get("_class_name") if hasattr(config, "get") else None
    family = by_class(name) if isinstance(name, str) else None
    if family is None and isinstance(name, str) and name in refused():
        raise InputError(f"{source} has _class_name {name!r}, which qkrope cannot export: "
                         f"{refused()[name]}. Fix: run this model on PyTorch (diffusers)")
    if family is None:
        raise InputError(f"{source} has _class_name {name!r}, which qkrope does not export. "
                         f"Fix: give the folder of one of {describe()}")
    return family


def check_blocks_option(record: FamilyRecord, flag: str, layers: int | None = None, *,
                        why: str = "export keeps every block",
                        config: Any = None, cut: bool = False) -> None:
    """An option over the blocks (``--layers N``, ``--blocks``) for a model of family
    ``record``: refused in one line where the record has no ``blocks`` (its export keeps every
    block, and nothing marks them), ``layers`` below 1, and above the model's blocks where its
    diffusers ``config`` (config.json as a mapping) is given; with ``cut`` (an export of the
    first ``layers`` blocks), below :meth:`FamilyRecord.least_layers` (the kept blocks' outputs
    would reach nothing the output layer reads, so the graph would hold none of them). Asked
    before any work starts."""
    from qkrope.errors import InputError

    if not record.blocks:
        which = " and ".join(r.short for r in records() if r.blocks) or "no family"
        raise InputError(f"{flag} applies to {which}; a {record.label} {why}. Fix: drop "
                         f"{flag}")
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int)
                               or layers < 1):
        raise InputError(f"{flag} takes a number of blocks >= 1; got {layers!r}. Fix: pass "
                         f"{flag} 1 or more")
    keys = [blocks.key for blocks in record.block_lists] or [record.blocks_key]
    counts = [config.get(key) for key in keys] if hasattr(config, "get") else []
    if counts and all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
        total = sum(counts)
        if layers is not None and layers > total:
            raise InputError(f"{flag} {layers}: the model has {total} blocks "
                             f"({' + '.join(keys)} in its config.json). Fix: pass {flag} 1 to "
                             f"{total}")
        least = record.least_layers(config)
        if cut and layers is not None and layers < least:
            unread = [b.attr for b in record.block_lists if not b.feeds_output]
            raise InputError(f"{flag} {layers} keeps only {record.short}'s "
                             f"{' and '.join(unread)}, whose outputs only later blocks read, so "
                             f"the exported graph would hold none of them. Fix: pass {flag} "
                             f"{least} or more (the first block the output layer reads)")


@overload
def hooks(record: FamilyRecord, kind: Literal["export"]) -> ExportHooks: ...
@overload
def hooks(record: FamilyRecord, kind: Literal["reference"]) -> ReferenceHooks: ...
@overload
def hooks(record: FamilyRecord, kind: Literal["dropin"]) -> DropinHooks: ...
@overload
def hooks(record: FamilyRecord, kind: Literal["tiny"]) -> TinyHooks: ...


def hooks(record: FamilyRecord, kind: str) -> Any:
    """The family's hook module of ``kind`` (:data:`HOOK_KINDS`), imported on first use and
    checked against the kind's required Protocol (qkrope.families._contract): a module that
    lacks a required name is refused in one line naming the family, the kind and the names."""
    if kind not in HOOK_KINDS:
        raise ValueError(f"hook kind {kind!r} is not one of {HOOK_KINDS}")
    return _hooks(record.name, record.package, kind)


@functools.lru_cache(maxsize=None)
def _hooks(name: str, package: str, kind: str) -> Any:
    module_name = f"{__name__}.{package}.{kind}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # a dual-stream clone's folder holds its record and tiny builder: its other hooks are
        # the shared ones, which read the record's dual_stream (qkrope.families._dual_stream)
        from qkrope.families._dual_stream import SHARED_HOOKS

        if exc.name != module_name or by_name(name).dual_stream is None \
                or kind not in SHARED_HOOKS:
            raise
        module = importlib.import_module(SHARED_HOOKS[kind])
    return checked(module, kind, name)


__all__ = ["FAMILY_PACKAGES", "HOOK_KINDS", "FamilyRecord", "records", "refused", "names",
           "default", "by_class", "by_name", "describe", "family_of", "check_blocks_option",
           "hooks"]
