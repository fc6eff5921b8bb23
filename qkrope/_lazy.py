"""Names a module offers but imports on first use (PEP 562): the one implementation behind the
package faces (``qkrope.runtime``, ``qkrope.export``) and the commands that keep heavy names
reachable as attributes while their ``--help`` imports nothing heavy.

    __getattr__, __dir__ = lazy_names(__name__, {"load": ".backends"}, globals())

``names`` maps each public name to the module that defines it, absolute (``qkrope.sidecars``)
or relative to the package of ``module`` (``.backends``). With ``submodules=True`` (a package)
any other attribute that is a plain identifier is tried as a submodule
(``qkrope.runtime.caches``); every other name is an AttributeError, so ``getattr(face, "a.b",
None)`` and ``hasattr`` answer the default / False. A name, once imported,
is stored in the module's namespace, so ``__getattr__`` runs once per name.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_names(module: str, names: Mapping[str, str], namespace: dict[str, Any], *,
               submodules: bool = False) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``module`` offering ``names`` (see the module docstring)."""
    package = module if submodules else module.rpartition(".")[0]

    def __getattr__(name: str) -> Any:
        source = names.get(name)
        if source is None:
            # only a plain name can be a submodule: "a.b", "" or "../x" is no attribute (an
            # import of it would raise ModuleNotFoundError for its first part, or ValueError)
            if submodules and name.isidentifier():
                try:
                    return importlib.import_module(f"{module}.{name}")
                except ModuleNotFoundError as exc:
                    if exc.name != f"{module}.{name}":
                        raise  # the submodule exists; something it imports does not
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source, package=package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
