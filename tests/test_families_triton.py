"""``qkrope triton-repo`` on every family (issue 30 item 6, issue 32 item 4), over the tiny
builders of tests/_families.py: a family gets this test by adding its builder.

For each family's fp32 export, the ONNX Runtime repository is written, and:

- the ensemble takes what a client has: the model's inputs without the caches, plus the fields
  of the family's position scheme (its ``triton_inputs``);
- the rope model (the repository's own ``model.py``, initialised from its ``config.pbtxt`` with
  the stand-in of Triton's Python-backend utilities) answers a request of the position fields
  the family's pipelines pass for the family's default check sizes (its drop-in's
  ``sample_request``), with the other inputs as ``make_inputs`` gives them, and its caches are
  ``make_inputs``' caches bit for bit (those ``qkrope check`` compares with diffusers);
- the repository's model step, run on ONNX Runtime with the served caches, gives the export's
  output on ``make_inputs``' feeds bit for bit.
"""

from __future__ import annotations

import contextlib
import io

import pytest

# Every family's repository written and its rope model served:
# a heavy matrix, run in the slow step (`bash scripts/test.sh -m slow`)
pytestmark = pytest.mark.slow

pytest.importorskip("torch", reason="requires torch (pip install -e '.[test]')")
pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
pytest.importorskip("onnxruntime", reason="requires onnxruntime (pip install -e '.[test]')")
pytest.importorskip("tritonclient", reason="requires tritonclient (pip install -e '.[test]')")

# the representatives; a clone family (smoke=True) runs the smoke test (tests/test_families.py)
from _families import FULL_PARAMS  # noqa: E402
from _triton_helpers import Tensor, load_rope_model, parse, serves_the_same_step  # noqa: E402
from _triton_helpers import io as tensors  # noqa: E402

from qkrope.cli import main  # noqa: E402
from qkrope.sidecars import ModelInfo  # noqa: E402

@pytest.fixture(scope="module", params=FULL_PARAMS)
def repository(request, tmp_path_factory, tiny_root):
    """(builder, export, repository, model name) of one family: the export is the session's
    (triton-repo copies it into this module's repository, the default --copy)."""
    builder = request.param
    root = tmp_path_factory.mktemp(f"triton-{builder.variant}")
    out = builder.exported(tiny_root)
    name = builder.variant.replace("-", "_")
    repo = root / "repo"
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        rc = main(["triton-repo", "--backend", "onnxruntime", "--onnx", str(out), "-o",
                   str(repo), "--name", name])
    assert rc == 0, text.getvalue()
    return builder, out, repo, name


def _scheme(info):
    """(the model's position scheme, its RoPE setting)."""
    from qkrope.runtime import schemes
    from qkrope.runtime.caches import model_setting, record_of

    record = record_of(info.config, "the sidecar")
    return schemes.scheme(record.scheme), model_setting(info.config, record, "the sidecar")


def test_the_ensemble_takes_the_inputs_without_the_caches_and_the_position_fields(repository):
    from qkrope import model_io

    builder, out, repo, name = repository
    info = ModelInfo.load(out)
    caches = {t.name for t in model_io.CACHE_INPUTS}
    ensemble = parse(repo / name / "config.pbtxt")
    sent = [n for n, _, _ in tensors(ensemble, "input")]
    scheme, setting = _scheme(info)
    assert sent == [n for n in info.input_names if n not in caches] + [
        n for n, _, _ in scheme.triton_inputs(setting)]


def test_the_rope_model_serves_the_checked_caches_and_the_model_step_the_checked_output(
        repository, monkeypatch):
    from qkrope import model_io
    from qkrope.apps.check import _default_sample
    from qkrope.runtime.inputs import joined_text_sizes, make_inputs, sample_request

    builder, out, repo, name = repository
    info = ModelInfo.load(out)
    sample = _default_sample(info)
    feeds = make_inputs(info, sample["img_shapes"], sample["txt_len"], sample["batch"])
    # the text stream's positions cover the conditions joined to it (as make_inputs's)
    joined = sum(joined_text_sizes(info).values())
    _, fields = sample_request(info, sample["img_shapes"], sample["txt_len"] + joined)
    caches = {t.name for t in model_io.CACHE_INPUTS} & set(feeds)
    scheme, setting = _scheme(info)
    sent = [Tensor(n, a) for n, a in scheme.triton_request(fields, setting).items()]
    sent += [Tensor(k, v) for k, v in feeds.items() if k not in caches]
    serves_the_same_step(repo, name, monkeypatch, sent, feeds, caches, out)


def test_a_latent_that_is_not_the_positions_grid_is_refused_in_one_line(repository,
                                                                        monkeypatch):
    """The rope model reads the image tokens off the latent (packed tokens, or a 5-D latent's
    patches) and refuses position fields of another grid as the client's error (INVALID_ARG),
    in one line, rather than serving caches the model step would misread."""
    from qkrope import model_io
    from qkrope.apps.check import _default_sample
    from qkrope.runtime.inputs import make_inputs, sample_request

    builder, out, repo, name = repository
    info = ModelInfo.load(out)
    sample = _default_sample(info)
    other = [(1, 4, 4)]  # another grid than the sample's first (1, 6, 5)
    assert tuple(sample["img_shapes"][0]) != other[0]
    feeds = make_inputs(info, other, sample["txt_len"], 1)
    _, fields = sample_request(info, sample["img_shapes"], sample["txt_len"])
    scheme, setting = _scheme(info)
    caches = {t.name for t in model_io.CACHE_INPUTS}
    sent = [Tensor(n, a) for n, a in scheme.triton_request(fields, setting).items()]
    sent += [Tensor(k, v) for k, v in feeds.items() if k not in caches]
    model, pb = load_rope_model(repo / f"{name}_rope", monkeypatch)
    resp = model.execute([pb.InferenceRequest(sent)])[0]
    assert resp.error is not None and resp.error.code() == pb.TritonError.INVALID_ARG
    assert "\n" not in resp.error.message() and "token" in resp.error.message(), \
        resp.error.message()
