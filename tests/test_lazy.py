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
