"""tests/fake_tensorrt.py against the real TensorRT Python bindings, and the failure modes the fake
makes reachable.

The real bindings (the PyPI wheel ``tensorrt-cu12-bindings``, the newest of TensorRT 10 and of
11, each against the fake of its version) import on a machine without TensorRT's libraries once
the nine C entry points they link against (``createInferBuilder_INTERNAL`` ...) exist: a stub
library defining them (returning null) is compiled here. The wheel is taken from
``build/trt-wheel/`` (ignored), downloaded there with pip when missing; without the wheel, a C
compiler or the network the comparison is skipped with the reason. A subprocess imports the
bindings and reports every class's members and each method's parameter names (from pybind11's
signatures); every name the fake defines must exist there, and every method the fake defines
must take the real parameter names (one of its overloads), so code written against the fake
calls the real API.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
import textwrap
import types
import zipfile
from pathlib import Path

import fake_tensorrt as ft
import pytest

REPO = Path(__file__).resolve().parent.parent
WHEEL_DIR = REPO / "build" / "trt-wheel"
WHEEL = "tensorrt-cu12-bindings"

# What the real bindings report for the names asked: {class: {member: [[param, ...] per
# overload] | None (not callable)}}, enums included; parsed from pybind11's signature lines.
_DUMP = textwrap.dedent(r'''
    import json, re, sys
    import tensorrt_bindings as trt

    def params(doc, name):
        out = []
        for line in (doc or "").splitlines():
            m = re.match(r"\s*(?:\d+\.\s*)?" + re.escape(name) + r"\((.*)\)\s*(->.*)?$", line)
            if not m or m.group(1) == "*args, **kwargs":
                continue
            names, depth, cur = [], 0, ""
            for ch in m.group(1) + ",":
                if ch in "[(<{":
                    depth += 1
                elif ch in "])>}":
                    depth -= 1
                if ch == "," and depth == 0:
                    names.append(cur.split(":")[0].split("=")[0].strip())
                    cur = ""
                else:
                    cur += ch
            out.append([n for n in names if n and n != "self"])
        return out

    report = {"__version__": trt.__version__, "__names__": dir(trt)}
    for cls in json.loads(sys.argv[1]):
        k = getattr(trt, cls, None)
        if k is None:
            continue
        members = {}
        for n in dir(k):
            if n.startswith("_") and n != "__init__":
                continue
            v = getattr(k, n)
            doc = getattr(v, "__doc__", None)
            members[n] = params(doc, n) if callable(v) and not isinstance(v, k.__class__) \
                and "No constructor defined" not in (doc or "") else None
        report[cls] = members
    print(json.dumps(report))
''')


def _stub_libraries(so: Path, out: Path) -> Path:
    """Stub libnvinfer/libnvonnxparser/libnvinfer_plugin defining the C symbols the bindings
    import (each a function returning null); the bindings only call them to create objects."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler to build the stub TensorRT libraries")
    nm = subprocess.run(["nm", "-D", "--undefined-only", str(so)], capture_output=True,
                        text=True)
    if nm.returncode != 0:
        pytest.skip(f"nm cannot read {so.name}: {nm.stderr[-200:]}")
    symbols = sorted({line.split()[-1].split("@")[0] for line in nm.stdout.splitlines()
                      if line.split()[-1].split("@")[0].endswith(("_INTERNAL", "Registry",
                                                                   "Plugins", "Version"))
                      and "@" not in line.split()[-1]})
    out.mkdir(parents=True, exist_ok=True)
    src = out / "stub.c"
    src.write_text("".join(f"void *{s}(void) {{ return 0; }}\n" for s in symbols))
    for lib in ("libnvinfer.so", "libnvonnxparser.so", "libnvinfer_plugin.so"):
        for major in ("10", "11"):
            name = f"{lib}.{major}"
            res = subprocess.run([cc, "-shared", "-fPIC", "-o", str(out / name), str(src),
                                  f"-Wl,-soname,{name}"], capture_output=True, text=True)
            if res.returncode != 0:
                pytest.skip(f"cannot build the stub {name}: {res.stderr[-300:]}")
    return out


@pytest.fixture(scope="module", params=["10", "11"])
def real_bindings(request):
    """(version, the unpacked wheel, the stub library folder) of the newest bindings of one
    TensorRT major version; skips without them."""
    major = request.param
    pattern = f"tensorrt_cu12_bindings-{major}.*.whl"
    wheels = sorted(WHEEL_DIR.glob(pattern))
    if not wheels:
        WHEEL_DIR.mkdir(parents=True, exist_ok=True)
        spec = f"{WHEEL}>={major},<{int(major) + 1}"
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                              "--only-binary=:all:", "-d", str(WHEEL_DIR), spec],
                             capture_output=True, text=True, timeout=600)
        wheels = sorted(WHEEL_DIR.glob(pattern))
        if res.returncode != 0 or not wheels:
            pytest.skip(f"no {spec} wheel in {WHEEL_DIR} and pip could not download one: "
                        f"{(res.stdout + res.stderr)[-300:]}")
    wheel = wheels[-1]
    version = wheel.name.split("-")[1]
    root = WHEEL_DIR / wheel.stem
    if not (root / "tensorrt_bindings").is_dir():
        with zipfile.ZipFile(wheel) as z:
            z.extractall(root)
    so = next((root / "tensorrt_bindings").glob("tensorrt*.so"), None)
    if so is None:
        pytest.skip(f"{wheel.name} has no tensorrt extension for this platform")
    return version, root, _stub_libraries(so, root / "stub-libs")


def _fake_classes(trt) -> list[tuple[str, type | types.SimpleNamespace]]:
    """(real name, fake) for the fake module's public names that stand for a real class or
    enum, and for the helper classes of fake_tensorrt that play one (ft.PLAYS)."""
    out = [(n, v) for n, v in vars(trt).items()
           if not n.startswith("_") and (isinstance(v, (type, types.SimpleNamespace)))]
    return out + [(real, cls) for cls, real in ft.PLAYS.items()]


def _fake_members(obj) -> dict[str, list[str] | None]:
    """Public members the fake defines (its own class bodies, not object's): methods with their
    parameter names (without self), other attributes as None."""
    if isinstance(obj, types.SimpleNamespace):
        return {n: None for n in vars(obj) if not n.startswith("_")}
    out: dict[str, list[str] | None] = {}
    for klass in obj.__mro__:
        if klass.__module__ != ft.__name__:
            continue  # object, bytes: what the fake builds on, not what it defines
        for n, v in vars(klass).items():
            if n in out or (n.startswith("_") and n != "__init__"):
                continue
            if isinstance(v, (staticmethod, classmethod)):
                v = v.__func__
            if inspect.isfunction(v):
                ps = [p.name for p in inspect.signature(v).parameters.values()
                      if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
                out[n] = ps[1:] if not isinstance(vars(klass)[n], staticmethod) else ps
            else:
                out[n] = None
    return out


def test_the_fake_has_the_real_bindings_names_and_keywords(real_bindings):
    version, root, stubs = real_bindings
    trt, _ = ft.make_fake_trt(version)  # the fake of that version: its flags and enums
    fakes = _fake_classes(trt)
    env = {**os.environ, "PYTHONPATH": str(root),
           "LD_LIBRARY_PATH": f"{stubs}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    res = subprocess.run([sys.executable, "-c", _DUMP,
                          json.dumps(sorted({n for n, _ in fakes}))],
                         capture_output=True, text=True, env=env, timeout=300)
    if res.returncode != 0:
        pytest.skip(f"the real bindings do not import over the stub libraries: "
                    f"{res.stderr[-400:]}")
    real = json.loads(res.stdout)
    problems = []
    for name in sorted(vars(trt)):
        if not name.startswith("_") and name not in real["__names__"]:
            problems.append(f"trt.{name}: no such name in TensorRT {real['__version__']}")
    for name, fake in fakes:
        members = real.get(name)
        if members is None:
            continue  # reported above
        for member, params in sorted(_fake_members(fake).items()):
            if member == "__init__" and fake in ft.PLAYS:
                continue  # a helper the tests construct, not the product
            if member not in members:
                if member == "__init__":
                    continue  # the real one has no public constructor: fakes make their own
                problems.append(f"{name}.{member}: not in the real {name}")
                continue
            overloads = members[member]
            if params is None or not overloads:
                continue
            if member == "__init__" and not overloads:
                continue
            if not any(params == o[:len(params)] and all("=" not in p for p in o[len(params):])
                       for o in overloads):
                problems.append(f"{name}.{member}({', '.join(params)}): the real one takes "
                                f"{' | '.join('(' + ', '.join(o) + ')' for o in overloads)}")
    assert not problems, "\n".join(problems)

