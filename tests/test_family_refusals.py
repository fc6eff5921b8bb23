"""Classes a family folder knows it cannot serve (its record module's ``REFUSED``): each one
is a diffusers class, none is also served, the registry refuses it by class in one line with
its reason, and ``qkrope export`` says that line before reading anything but config.json."""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping

import pytest

from qkrope import families
from qkrope.errors import InputError

REFUSED = sorted(families.refused().items())


def test_every_refused_class_is_a_diffusers_class_no_folder_serves():
    diffusers = pytest.importorskip("diffusers")
    served = {r.class_name for r in families.records()}
    declared = []
    for package in families.FAMILY_PACKAGES:
        module = importlib.import_module(f"qkrope.families.{package}")
        table = getattr(module, "REFUSED", {})
        assert isinstance(table, Mapping), package
        declared += list(table)
    assert declared and sorted(declared) == sorted(families.refused())
    for name, why in REFUSED:
        assert name not in served
        assert isinstance(getattr(diffusers, name), type), name
        assert why.strip() == why and "\n" not in why and len(why.split()) >= 8, (name, why)


def test_the_wan_folder_refuses_its_unserved_derivatives():
    wan = importlib.import_module("qkrope.families.wan")
    assert set(wan.REFUSED) == {"SanaVideoTransformer3DModel", "HeliosTransformer3DModel",
                                "WanAnimateTransformer3DModel"}


@pytest.mark.parametrize("name,why", REFUSED, ids=[n for n, _ in REFUSED])
def test_family_of_refuses_the_class_with_its_reason(name, why):
    with pytest.raises(InputError) as caught:
        families.family_of({"_class_name": name})
    message = str(caught.value)
    assert len(message.splitlines()) == 1
    assert name in message and why in message and "Fix: run this model on PyTorch" in message
    assert "give the folder of one of" not in message  # not the unknown-class line


@pytest.mark.parametrize("name,why", REFUSED, ids=[n for n, _ in REFUSED])
def test_export_cli_prints_one_line_with_the_reason(name, why, tmp_path, capsys, monkeypatch):
    """``qkrope export --model transformer --diffusers DIR`` on a folder whose config.json names
    the class: one line with the reason, the exporter never called."""
    from qkrope.cli import main
    from qkrope.export import onnx_export

    called = []
    monkeypatch.setattr(onnx_export, "export_transformer",
                        lambda *a, **k: called.append(k) or (None, []))
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": name}))
    rc = main(["export", "--model", "transformer", "--diffusers", str(tmp_path),
               "--out", str(tmp_path / "m.onnx")])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and not called
    assert len(err.splitlines()) == 1, err
    assert name in err and why in err and "Fix:" in err
