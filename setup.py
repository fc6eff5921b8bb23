"""The package list of the wheel, read from the source tree (pyproject.toml holds the rest).

The product layout keeps export/ and runtime/ at the top level; they are installed as
qkrope.export and qkrope.runtime, never under their generic names. Every folder with an
``__init__.py`` below a root is a package, so a new family folder (qkrope/families/<pkg>/) or a
moved subpackage needs no edit here nor in pyproject.toml (tests/test_package.py builds the
wheel and checks it holds every one).
"""

from setuptools import find_packages, setup

#: The installed name of each top-level source folder.
PACKAGE_DIRS = {"qkrope": "qkrope", "qkrope.export": "export", "qkrope.runtime": "runtime"}


def packages() -> list[str]:
    """Every package below the roots of :data:`PACKAGE_DIRS`, by its installed name."""
    out: list[str] = []
    for name, folder in PACKAGE_DIRS.items():
        out.append(name)
        out.extend(f"{name}.{sub}" for sub in find_packages(where=folder))
    # qkrope's own walk must not list export/runtime twice (they are not below qkrope/)
    return sorted(set(out))


if __name__ == "__main__":  # setuptools' build backend runs this file as __main__
    setup(packages=packages(), package_dir=PACKAGE_DIRS)
