#!/usr/bin/env python3
"""Fetch the TensorRT 10.14 headers that the PyPI wheel kernel-lens==2.0.1 vendors.

CI machines have no TensorRT install, yet the plugin must compile there. NVIDIA ships its headers
(Apache-2.0) inside that wheel; this script downloads it with `pip download --no-deps`, checks the
pinned sha256, and unpacks only the NvInfer*.h headers into
``third_party/tensorrt-headers/include`` (ignored by git). The unpacking goes to a temporary
directory that is renamed into place, so an interrupted run never leaves a half-filled folder.
Running it again when the headers are present does nothing (use --force to refetch).

Usage: python scripts/fetch_trt_headers.py [--dest DIR] [--force] [--wheel PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "kernel-lens"
VERSION = "2.0.1"
WHEEL_NAME = "kernel_lens-2.0.1-py3-none-any.whl"
SHA256 = "07cc714e8b5e7f34b672f7c7fad93febe7c747be5837ba276b1527370134ffe0"
MEMBER_PREFIX = "kernel_lens/include/tensorrt/"
REQUIRED = ("NvInfer.h", "NvInferRuntime.h", "NvInferPluginBase.h", "NvInferVersion.h")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DEST = REPO_ROOT / "third_party" / "tensorrt-headers" / "include"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def headers_present(dest: Path) -> bool:
    return all((dest / name).is_file() for name in REQUIRED)


def _download(tmp: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(tmp), f"{PACKAGE}=={VERSION}"]
    print("fetch_trt_headers: " + " ".join(cmd), flush=True)
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(
            f"fetch_trt_headers: pip download of {PACKAGE}=={VERSION} failed "
            f"(exit {res.returncode}):\n{res.stdout}{res.stderr}\n"
            "Fix: check network access to PyPI, or pass --wheel PATH to a downloaded copy, or "
            "point the build at a TensorRT install (--tensorrt-root DIR / TensorRT_ROOT).")
    wheel = tmp / WHEEL_NAME
    if not wheel.is_file():
        found = sorted(p.name for p in tmp.iterdir())
        raise SystemExit(f"fetch_trt_headers: expected {WHEEL_NAME} after pip download, found {found}")
    return wheel


def fetch(dest: Path = DEFAULT_DEST, *, force: bool = False, wheel: Path | None = None) -> Path:
    dest = dest.resolve()
    if headers_present(dest) and not force:
        print(f"fetch_trt_headers: headers already present in {dest}")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="trt-headers-", dir=dest.parent) as tmpdir:
        tmp = Path(tmpdir)
        wheel_path = wheel if wheel is not None else _download(tmp)
        digest = _sha256(wheel_path)
        if digest != SHA256:
            raise SystemExit(
                f"fetch_trt_headers: sha256 mismatch for {wheel_path.name}: got {digest}, "
                f"expected {SHA256}. Refusing to use it.")
        staging = tmp / "include"
        staging.mkdir()
        n = 0
        with zipfile.ZipFile(wheel_path) as zf:
            for info in zf.infolist():
                name = info.filename
                if not name.startswith(MEMBER_PREFIX) or info.is_dir():
                    continue
                base = name[len(MEMBER_PREFIX):]
                # Only flat NvInfer*.h headers; never follow paths out of the folder.
                if "/" in base or not (base.startswith("NvInfer") and base.endswith(".h")):
                    continue
                (staging / base).write_bytes(zf.read(info))
                n += 1
        if not headers_present(staging):
            raise SystemExit(f"fetch_trt_headers: the wheel lacks some of {REQUIRED}")
        old = None
        if dest.exists():
            old = tmp / "old"
            os.replace(dest, old)
        os.replace(staging, dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    print(f"fetch_trt_headers: {n} TensorRT headers ({PACKAGE} {VERSION}, sha256 ok) -> {dest}")
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=DEFAULT_DEST, help=f"default: {DEFAULT_DEST}")
    ap.add_argument("--force", action="store_true", help="refetch even when present")
    ap.add_argument("--wheel", type=Path, help="use this already-downloaded wheel (hash still checked)")
    args = ap.parse_args(argv)
    fetch(args.dest, force=args.force, wheel=args.wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
