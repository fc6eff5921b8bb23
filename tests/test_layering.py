"""The folders show the layers, and the imports agree (parsed with ``ast``, lazy imports in
function bodies included):

    qkrope.apps.demo (the main job)          ->  qkrope.cli (runs the other commands)
    qkrope.cli       (dispatcher)            ->  the apps, by name (importlib)
    qkrope.apps      (command applications)  ->  qkrope.export, qkrope.runtime, the root
    qkrope.export    (PyTorch side)          ->  qkrope.runtime (caches), the root
    qkrope.runtime   (inference/deployment)  ->  the root only: never qkrope.export or the apps
    the root         (contract, dtypes, layout, sidecars, errors, files)  ->  nothing above it

and no two modules import each other through any chain (no cycles).

The model families (qkrope/families/) sit in those layers by module: the registry
(``qkrope.families``, ``qkrope.families._record``) and each family's record
(``qkrope.families.<f>``) are root; ``qkrope.families.<f>.export`` is export layer;
``.reference`` and ``.dropin`` are runtime layer. Two more rules keep a family one folder:
a family folder imports no other family and not the registry (the registry finds the
folders by name, with importlib), and a generic module imports no family module by name. And
generic modules name no family in the identifiers they define or import (FAMILY_NAMED_BY_DESIGN:
the exceptions, each with its reason); runtime/ holds no kernel-analysis code (the SASS reader is
the kernel report's, qkrope.apps.kernel_report.sass).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# installed package -> folder (pyproject.toml's package-dir)
PACKAGES = {"qkrope": ROOT / "qkrope", "qkrope.export": ROOT / "export",
            "qkrope.runtime": ROOT / "runtime"}


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            if name.startswith("qkrope.") and name.split(".")[1] in ("export", "runtime") \
                    and pkg == "qkrope":
                continue
            mods[name] = path
    return mods


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    is_pkg = path.name == "__init__.py"
    base = name if is_pkg else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
            out.update(t for t in targets if t in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                mod = ".".join(parts[:len(parts) - node.level + 1])
                mod = f"{mod}.{node.module}" if node.module else mod
            else:
                mod = node.module or ""
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                if sub in known:
                    out.add(sub)
                elif mod in known:
                    out.add(mod)
    out.discard(name)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def test_the_graph_covers_every_module():
    g = _graph()
    for expected in ("qkrope.contract", "qkrope.dtypes", "qkrope.cli", "qkrope.apps.check",
                     "qkrope.export.onnx_export", "qkrope.runtime.runner",
                     "qkrope.runtime.engine"):
        assert expected in g
    assert "qkrope.contract" in g["qkrope.export.finalize"]
    assert "qkrope.export.transformer_export" in g["qkrope.export.onnx_export"]  # its face
    assert "qkrope.runtime.runner_tensorrt" in g["qkrope.runtime.backends"]  # lazy ones count


FAMILIES = "qkrope.families"
# a family's hook modules by kind -> their layer (the registry and the records are root)
FAMILY_HOOK_LAYER = {"export": 2, "reference": 1, "dropin": 1, "tiny": 3}


def _family_of(mod: str) -> str | None:
    """The family folder a module is in (``qkrope.families.flux`` for
    ``qkrope.families.flux.export``), None for the registry and any generic module."""
    parts = mod.split(".")
    if mod.startswith(FAMILIES + ".") and not parts[2].startswith("_"):
        return ".".join(parts[:3])
    return None


def level(mod: str) -> int:
    layer = {"qkrope.apps": 3, "qkrope.export": 2, "qkrope.runtime": 1}
    if mod == "qkrope.apps.demo":
        return 5  # the main job runs the other commands through the dispatcher
    if mod == "qkrope.cli" or mod == "qkrope.__main__":
        return 4  # the dispatcher sits above the apps (it finds them by name)
    if _family_of(mod) is not None:
        parts = mod.split(".")
        return FAMILY_HOOK_LAYER[parts[3]] if len(parts) > 3 else 0
    return next((v for k, v in layer.items() if mod == k or mod.startswith(k + ".")), 0)


def test_family_modules_are_classified():
    """Every module of a family folder is its record or a hook of a known kind; the registry
    finds every folder (FAMILY_PACKAGES)."""
    from qkrope import families

    mods = [m for m in _graph() if _family_of(m) is not None]
    assert {_family_of(m).rpartition(".")[2] for m in mods} == set(families.FAMILY_PACKAGES)
    assert families.HOOK_KINDS == tuple(FAMILY_HOOK_LAYER)
    for m in mods:
        parts = m.split(".")
        assert len(parts) == 3 or (len(parts) == 4 and parts[3] in FAMILY_HOOK_LAYER), m
    assert level("qkrope.families.flux.export") == 2
    assert level("qkrope.families.flux.reference") == 1 == level("qkrope.runtime.caches")
    assert level("qkrope.families.flux") == 0 == level(FAMILIES)


def test_runtime_never_imports_export_or_the_apps():
    bad = [(m, t) for m, targets in _graph().items() if level(m) == 1
           for t in targets if t.startswith(("qkrope.export", "qkrope.apps"))
           or level(t) > 1]
    assert bad == []


def test_the_root_and_export_do_not_import_upwards():
    bad = [(m, t) for m, targets in _graph().items() for t in targets if level(t) > level(m)]
    assert bad == []


def test_runtime_holds_no_kernel_analysis_code():
    """runtime/ is the inference and deployment library; the kernel-analysis tools (the SASS
    reader) live with their one user, the kernel report, and nothing else imports them."""
    g = _graph()
    tool = "qkrope.apps.kernel_report.sass"
    assert tool in g and level(tool) == 3
    assert [m for m in g if m.startswith("qkrope.runtime.")
            and ("sass" in m.split(".") or "kernel_report" in m.split("."))] == []
    users = {m for m, targets in g.items() if any(t == tool or t.startswith(tool + ".")
                                                  for t in targets)}
    assert users and all(m.startswith("qkrope.apps.kernel_report") for m in users), users


def test_a_family_folder_imports_no_other_family_nor_the_registry():
    bad = [(m, t) for m, targets in _graph().items() if _family_of(m) is not None
           for t in targets
           if t == FAMILIES or (_family_of(t) is not None and _family_of(t) != _family_of(m))]
    assert bad == []


def test_generic_modules_import_no_family_module_by_name():
    """Generic code reaches a family through the registry (records, hooks), never by a module
    name; the records' type (qkrope.families._record) is generic."""
    bad = [(m, t) for m, targets in _graph().items() if _family_of(m) is None
           for t in targets if _family_of(t) is not None]
    assert bad == []


def test_no_import_cycles():
    g = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(g.get(m, ())):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    assert cycles == []


# --- generic modules name no family ----------------------------------------------------------
#
# Generic code (export/, runtime/, qkrope/*.py, qkrope/apps/, qkrope/sidecars/) reaches a family
# through its record; an identifier it defines or imports that names a family is a fact in the
# wrong home. The exceptions are family-specific by design, each with its reason.
FAMILY_NAMED_BY_DESIGN: dict[str, dict[str, str]] = {
    "qkrope.export.attention": {
        "QwenImageAttention": "the `--model attention` block is Qwen-Image's joint attention "
                              "(model_io.ATTENTION_BLOCK), a public name in the README"},
    "qkrope.export.attention_export": {
        "QwenImageAttention": "exports that block (imports the class above)"},
    "qkrope.apps.demo": {
        "QwenImageAttention": "the main job demos the default family's attention block",
        "build_qwen_rope_caches": "the demo builds that family's caches (its dropin's PUBLIC)",
        "qwen": "the demo's handle on diffusers' Qwen-Image module, its parity oracle"},
}
_STEM_SUFFIXES = re.compile(r"(Transformer[23]DModel|Model)$")
_TOKEN = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")


def _words(text: str) -> list[str]:
    """``text`` split into its lower-case words (snake_case, CamelCase, digits):
    ``QwenImageAttention`` -> qwen, image, attention; ``Flux2PosEmbed`` -> flux, 2, pos, embed."""
    return [w.lower() for w in _TOKEN.findall(text)]


def _family_names() -> set[str]:
    """What names a family, as words run together: each record's class name without its
    Transformer2DModel / Transformer3DModel / Model suffix (qwenimage, flux2, zimage,
    hunyuanvideo15), its name and package (flux1, hunyuanimage), and its brand, the stem's
    first word where it is three letters or more (qwen, hunyuan, wan)."""
    from qkrope import families

    out: set[str] = set()
    for r in families.records():
        stem = _STEM_SUFFIXES.sub("", r.class_name)
        out |= {"".join(_words(stem)), "".join(_words(r.name)), "".join(_words(r.package))}
        if len(_words(stem)[0]) >= 3:
            out.add(_words(stem)[0])
    return out


def _names_a_family(identifier: str, names: set[str]) -> bool:
    """Whether a run of ``identifier``'s words spells a family's name (``is_qwen``,
    ``FluxAttnProcessor``, ``build_wan_caches``; not ``wanted``)."""
    words = _words(identifier)
    return any("".join(words[i:j]) in names
               for i in range(len(words)) for j in range(i + 1, len(words) + 1))


def _defined_or_imported(path: Path) -> set[str]:
    """The identifiers a module defines (functions, classes, arguments, names and attributes it
    assigns) or imports (the imported names and their aliases)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.add(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                out.update(part for part in alias.name.split(".")[-1:] + [alias.asname or ""]
                           if part)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            out.add(node.name)
    return out


def _family_named_identifiers() -> dict[str, set[str]]:
    names = _family_names()
    found: dict[str, set[str]] = {}
    for mod, path in _modules().items():
        if mod == FAMILIES or mod.startswith(FAMILIES + "."):
            continue  # the registry and the family folders
        hits = {i for i in _defined_or_imported(path) if _names_a_family(i, names)}
        if hits:
            found[mod] = hits
    return found


def test_the_family_name_matcher():
    names = _family_names()
    assert {"qwenimage", "qwen", "flux", "flux2", "zimage", "wan", "hunyuanvideo15"} <= names
    assert all(_names_a_family(i, names) for i in (
        "QWEN_MATCH", "is_qwen", "FluxAttnProcessor", "build_wan_caches", "ZImageThing",
        "HunyuanVideo15Rope", "flux1_launches", "qwen_image"))
    assert not any(_names_a_family(i, names) for i in (
        "wanted", "want", "reference_match", "influx", "image_cache", "z", "rows"))


def test_generic_modules_name_no_family():
    """No identifier a generic module defines or imports names a family (its records' class-name
    stem, name, package or brand), apart from FAMILY_NAMED_BY_DESIGN; each exception there is
    still used (a module that is gone drops out)."""
    found = _family_named_identifiers()
    bad = {m: sorted(ids - set(FAMILY_NAMED_BY_DESIGN.get(m, {}))) for m, ids in found.items()}
    assert {m: ids for m, ids in bad.items() if ids} == {}
    mods = _modules()
    stale = {m: sorted(set(ids) - found.get(m, set()))
             for m, ids in FAMILY_NAMED_BY_DESIGN.items() if f"{m}" in mods}
    assert {m: ids for m, ids in stale.items() if ids} == {}
