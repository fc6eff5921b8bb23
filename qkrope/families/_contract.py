"""The family hook contract: what each hook module of a family folder defines, as
:class:`typing.Protocol` classes (the one list of the names; docs/ARCHITECTURE.md "Adding a
model family" points here).

A family folder ``qkrope/families/<package>/`` has one module per hook kind; each kind has a
Protocol of the names generic code calls on it (required: :func:`qkrope.families.hooks` refuses
a module without one) and a Protocol of the names it reads where the module has them
(optional). A module meets a Protocol the way mypy checks a module against one: its functions
are the Protocol's methods without ``self``, its constants the Protocol's attributes.

========== =============== ================ ===================================================
kind       layer           required         optional
========== =============== ================ ===================================================
export     export          :class:`ExportHooks`     none
reference  runtime         :class:`ReferenceHooks`  :class:`ReferenceExtras`
dropin     runtime         :class:`DropinHooks`     :class:`DropinExtras`
tiny       apps            :class:`TinyHooks`       :class:`TinyExtras`
========== =============== ================ ===================================================

Root layer, no torch: the types generic code passes (torch modules, the export's
``TransformerPlan``, the sidecar's ``ModelInfo``) are named in strings, never imported, so
``import qkrope`` stays light and the root imports nothing above it (tests/test_layering.py).
A hook module says which contract it meets by importing its Protocol under the name
``CONTRACT`` (``from qkrope.families._contract import DropinHooks as CONTRACT``): the import
shows the dependency to import analysis, and :func:`checked` refuses a module that declares
another kind's Protocol.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping, NamedTuple, Protocol, Sequence

from qkrope.errors import QkropeError


class ExportHooks(Protocol):
    """``qkrope.families.<package>.export`` (export layer), called by qkrope.export."""

    def check_config(self, directory: str, model_class: type, dtype: "torch.dtype", *,
                     memory: bool = True) -> Any:
        """Refuse, in one line and before any weight is read, a config.json (of the diffusers
        folder ``directory``, class ``model_class``) this export does not support; ``memory``
        False: the weights stream from disk (skip the in-memory size check)."""

    def prepare(self, record: "FamilyRecord", transformer: "torch.nn.Module", *, sample: Any,
                dtype: "torch.dtype", layers: int | None,
                rounding: int) -> "qkrope.export.onnx_export.TransformerPlan":
        """Patch ``transformer`` (attention processors with the fused node) and return the
        plan of its export: the cache-input wrapper, its sample arguments, the graph, the
        node count and the RoPE numbers, for the first ``layers`` blocks (None: all)."""

    def post_export(self, model: Any) -> None:
        """Check the exported graph (an onnx_ir model) before it is finalised; raise the
        export's error where a node the family needs is missing."""


class ReferenceHooks(Protocol):
    """``qkrope.families.<package>.reference`` (runtime layer), called by ``qkrope check``
    (qkrope.apps.check, qkrope.apps.check_fp8)."""

    def forward_kwargs(self, info: "qkrope.sidecars.ModelInfo", by_role: Mapping[str, Any],
                       img_shapes: Sequence[Sequence[int]]) -> dict:
        """The keyword arguments of diffusers' forward for the graph inputs ``by_role``
        (torch tensors by graph input name) of a sample of ``img_shapes``."""


class ReferenceExtras(Protocol):
    """Optional names of a reference hook, read where the module defines them."""

    #: the most images a check sample of this family holds (else its scheme's IMAGES)
    IMAGES: int
    #: the check's default sizes updated with these (``img_shapes``, ``txt_len``, ``batch``)
    CHECK_SAMPLE: Mapping[str, Any]

    def check_sample(self, info: "qkrope.sidecars.ModelInfo") -> Mapping[str, Any]:
        """The check's default sizes for this model (after CHECK_SAMPLE)."""

    def graph_output(self, info: "qkrope.sidecars.ModelInfo", sample: Any,
                     img_shapes: Sequence[Sequence[int]]) -> Any:
        """diffusers' output in the graph's layout, where the two differ."""

    def sample_inputs(self, info: "qkrope.sidecars.ModelInfo",
                      sizes: Mapping[str, int]) -> Mapping[str, Any]:
        """Graph inputs whose values a sample cannot draw at random (a packed sequence's index
        tensors: each row filled once), by input name as numpy arrays, for the sample's axis
        sizes ``sizes`` (batch, img_tokens, txt_tokens, the joined text axes)."""


class DropinHooks(Protocol):
    """``qkrope.families.<package>.dropin`` (runtime layer), called by qkrope.runtime
    (load_transformer, the sample inputs and caches, the public names)."""

    def dropin_class(self, record: "FamilyRecord") -> type:
        """The pipeline drop-in class of ``record`` (a qkrope.runtime._dropin.Transformer;
        its ``FORWARD_ARGS``, where it has them, name the arguments its forward takes: a call
        with another family's arguments is told which family takes them)."""

    def sample_request(self, record: "FamilyRecord", img_shapes: Sequence[Sequence[int]],
                       txt_len: int) -> dict:
        """The position request of the family's scheme for a sample of these sizes (grids
        and a text length, or ids laid out as the pipelines lay them out)."""


class DropinExtras(Protocol):
    """Optional names of a drop-in hook."""

    #: names qkrope.runtime offers (``qkrope.runtime.<name>``): builders of the family's caches
    PUBLIC: Mapping[str, Any]

    def model_request(self, record: "FamilyRecord", config: Mapping[str, Any],
                      img_shapes: Sequence[Sequence[int]], txt_len: int) -> dict:
        """``sample_request`` for a model of this diffusers ``config`` (config.json's values),
        where the request depends on it (positions given as RoPE angles computed from the
        config's head width, theta and axis layout); called in its place by the sample inputs
        (qkrope.runtime.inputs.sample_request)."""


class TinyHooks(Protocol):
    """``qkrope.families.<package>.tiny`` (apps layer), called by qkrope.apps.tiny_pipeline."""

    def save_pipeline(self, record: "FamilyRecord", directory: Any, seed: int = 0) -> Any:
        """Save the family's tiny random diffusers pipeline (built in code) into
        ``directory``."""


class TinyExtras(Protocol):
    """Optional names of a tiny hook."""

    def build_transformer(self, record: "FamilyRecord", seed: int = 0) -> "torch.nn.Module":
        """``record``'s tiny random transformer (the tests' builder: a family that defines it
        needs no entry in tests/_families.py)."""

    def pipeline_parts(self, record: "FamilyRecord", pipeline: str,
                       seed: int = 0) -> Mapping[str, Any]:
        """The components of the diffusers pipeline class ``pipeline`` (one the record's stages
        serve) that differ from the saved tiny pipeline's (another text encoder, tokenizer or
        transformer), by component name; {} where none differ. The stage tests save the tiny
        pipeline under ``pipeline`` with these in place."""


class RecordExtras(Protocol):
    """Optional names of a family's record module ``qkrope.families.<package>`` itself (root
    layer, no torch; its ``RECORDS`` are required), read by the registry where defined."""

    #: diffusers class name -> why qkrope cannot serve it (one clause, facts only): the classes
    #: built like the folder's that it knows it cannot export, refused by class in one line
    #: (:func:`qkrope.families.family_of`)
    REFUSED: Mapping[str, str]


class Contract(NamedTuple):
    """One hook kind's Protocols: the names it must define and those read where defined."""

    required: type
    optional: type | None = None


#: hook kind -> its contract, in the order a family is exported, checked, run and built
CONTRACTS: dict[str, Contract] = {
    "export": Contract(ExportHooks),
    "reference": Contract(ReferenceHooks, ReferenceExtras),
    "dropin": Contract(DropinHooks, DropinExtras),
    "tiny": Contract(TinyHooks, TinyExtras),
}


class FamilyContractError(QkropeError, TypeError):
    """A family's hook module lacks a name its contract requires (a family folder's bug)."""


def members(protocol: type | None) -> tuple[str, ...]:
    """The names a Protocol declares (functions and annotated attributes), in order."""
    if protocol is None:
        return ()
    names = list(protocol.__dict__.get("__annotations__", {}))
    names += [n for n, v in protocol.__dict__.items()
              if inspect.isfunction(v) and not n.startswith("_")]
    return tuple(dict.fromkeys(names))


def missing(module: Any, kind: str) -> tuple[str, ...]:
    """The required names of ``kind`` that ``module`` does not define."""
    return tuple(n for n in members(CONTRACTS[kind].required) if not hasattr(module, n))


def checked(module: Any, kind: str, family: str) -> Any:
    """``module`` where it defines every required name of ``kind`` (and declares no other
    kind's Protocol as ``CONTRACT``); else a one-line :class:`FamilyContractError` naming the
    family, the kind and the missing names."""
    declared = getattr(module, "CONTRACT", None)
    protocol = CONTRACTS[kind].required
    if declared is not None and declared is not protocol:
        raise FamilyContractError(
            f"family {family!r}: its {kind} hook {module.__name__} declares CONTRACT = "
            f"{getattr(declared, '__name__', declared)!s}, not {protocol.__name__}. Fix: import "
            f"{protocol.__name__} as CONTRACT there (qkrope/families/_contract.py)")
    lacking = missing(module, kind)
    if lacking:
        protocol = CONTRACTS[kind].required
        raise FamilyContractError(
            f"family {family!r}: its {kind} hook {module.__name__} lacks "
            f"{', '.join(lacking)} (the {protocol.__name__} Protocol in "
            f"qkrope/families/_contract.py lists what a {kind} hook defines; "
            f"docs/ARCHITECTURE.md 'Adding a model family'). Fix: define them there")
    return module


def signature_problems(module: Any, kind: str) -> list[str]:
    """How the functions ``module`` defines for ``kind`` (required and optional) could not be
    called as their Protocol declares (positional arguments by position, keyword-only ones by
    name), and constants that are callables or functions that are not; [] where none."""
    contract = CONTRACTS[kind]
    out: list[str] = []
    for protocol in (contract.required, contract.optional):
        for name in members(protocol):
            if not hasattr(module, name):
                continue
            value = getattr(module, name)
            declared = protocol.__dict__.get(name)
            if not inspect.isfunction(declared):
                if callable(value) and not isinstance(value, type):
                    out.append(f"{name} is a function; {protocol.__name__} declares a value")
                continue
            if not callable(value):
                out.append(f"{name} is {type(value).__name__}; {protocol.__name__} declares a "
                           f"function")
                continue
            out += [f"{name}: {p}" for p in _call_problems(declared, value)]
    return out


def _call_problems(declared, function) -> list[str]:
    want = list(inspect.signature(declared).parameters.values())[1:]  # without self
    have = inspect.signature(function).parameters
    P = inspect.Parameter
    var_pos = any(p.kind is P.VAR_POSITIONAL for p in have.values())
    var_kw = any(p.kind is P.VAR_KEYWORD for p in have.values())
    positional = [p for p in have.values() if p.kind in (P.POSITIONAL_ONLY,
                                                         P.POSITIONAL_OR_KEYWORD)]
    problems, used = [], set()
    given = [p for p in want if p.kind is P.POSITIONAL_OR_KEYWORD]
    for i, p in enumerate(given):
        if i < len(positional):
            used.add(positional[i].name)
        elif not var_pos:
            problems.append(f"takes {len(positional)} positional arguments; the call passes "
                            f"{len(given)} ({', '.join(q.name for q in given)})")
            break
    for p in want:
        if p.kind is P.KEYWORD_ONLY:
            q = have.get(p.name)
            if q is not None and q.kind in (P.KEYWORD_ONLY, P.POSITIONAL_OR_KEYWORD):
                used.add(q.name)
            elif not var_kw:
                problems.append(f"takes no keyword argument {p.name!r}")
    extra = [q.name for q in have.values() if q.name not in used and q.default is P.empty
             and q.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)]
    if extra:
        problems.append(f"requires {', '.join(extra)}, which the call does not pass")
    return problems


__all__ = ["ExportHooks", "ReferenceHooks", "ReferenceExtras", "DropinHooks", "DropinExtras",
           "TinyHooks", "TinyExtras", "RecordExtras", "Contract", "CONTRACTS",
           "FamilyContractError", "members",
           "missing", "checked", "signature_problems"]
