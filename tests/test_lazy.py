"""qkrope._lazy: the one PEP 562 helper behind the package faces and the commands' lazy names."""

from __future__ import annotations

import sys

import pytest

from qkrope._lazy import lazy_names


@pytest.fixture()
def package(tmp_path, monkeypatch):
    """A throwaway package ``lazypkg`` with a light module, a module whose import fails, and a
    face that offers ``VALUE`` (relative) and ``dumps`` (absolute) lazily."""
    root = tmp_path / "lazypkg"
    root.mkdir()
    (root / "light.py").write_text("IMPORTS = []\nIMPORTS.append(1)\nVALUE = 42\n")
    (root / "broken.py").write_text("import lazypkg_no_such_dependency\n")
    (root / "__init__.py").write_text(
        "from qkrope._lazy import lazy_names\n"
        "__getattr__, __dir__ = lazy_names(__name__, {'VALUE': '.light', 'dumps': 'json'},\n"
        "                                  globals(), submodules=True)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in [n for n in sys.modules if n == "lazypkg" or n.startswith("lazypkg.")]:
        del sys.modules[name]


def test_names_import_on_first_use_and_once(package):
    import lazypkg

    assert "lazypkg.light" not in sys.modules
    assert lazypkg.VALUE == 42 and "lazypkg.light" in sys.modules
    assert "VALUE" in vars(lazypkg)            # stored: __getattr__ does not run again
    import json
    assert lazypkg.dumps is json.dumps         # an absolute source
    assert {"VALUE", "dumps"} <= set(dir(lazypkg))


def test_submodules_missing_names_and_broken_imports(package):
    import lazypkg

    assert lazypkg.light.VALUE == 42           # a submodule as an attribute
    with pytest.raises(AttributeError, match="'lazypkg' has no attribute 'nothing'"):
        lazypkg.nothing
    # a submodule that exists but cannot import says why, not "no attribute"
    with pytest.raises(ModuleNotFoundError, match="lazypkg_no_such_dependency"):
        lazypkg.broken


def test_without_submodules_only_the_names_are_offered():
    namespace: dict = {}
    getattr_, _ = lazy_names("qkrope.fake_module", {"dumps": "json"}, namespace)
    assert getattr_("dumps").__module__ == "json" and "dumps" in namespace
    with pytest.raises(AttributeError):
        getattr_("dtypes")                     # qkrope.dtypes exists but is not offered


BAD_NAMES = ("a.b", "caches.x", "", "..caches", "a b", "1x", "no_such_submodule")


@pytest.mark.parametrize("face", ["qkrope.runtime", "qkrope.export", "qkrope.apps.check",
                                  "qkrope.apps.bench", "qkrope.dtypes"])
def test_every_face_answers_the_default_for_names_it_does_not_offer(face):
    """getattr with a default and hasattr never raise for a name a face does not offer (a
    dotted name used to import its first part and raise ModuleNotFoundError)."""
    import importlib

    module = importlib.import_module(face)
    marker = object()
    for name in BAD_NAMES:
        assert getattr(module, name, marker) is marker, (face, name)
        assert not hasattr(module, name), (face, name)
        with pytest.raises(AttributeError):
            getattr(module, name)


def test_dotted_names_on_a_package_face(package):
    import lazypkg

    assert getattr(lazypkg, "light.VALUE", None) is None
    assert not hasattr(lazypkg, "broken.x")       # not imported: the dotted name is no attribute
    assert "lazypkg.broken" not in sys.modules
