"""The generic drop-in's hooks (issue 44 item 2): every family's drop-in runs the one generic
``forward``; what families differ in is what ``prepare`` returns: the latent layout in (the
Call's tokens) and out (``Call.unpack``), a Split of one diffusers call into several runner
calls reassembled as diffusers' per-sample list, and the return wrapping (``output``).
Cheap: a fake runner, no export."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qkrope import families
from qkrope.runtime._dropin import Call, Split, Transformer

QWEN = families.by_name("qwen-image")
AXES = (4, 6, 6)


@pytest.mark.parametrize("record", families.records(), ids=lambda r: r.name)
def test_no_family_drop_in_overrides_forward(record):
    """The generic forward is the only one: no class between a family's drop-in and
    Transformer defines forward or __call__ itself."""
    cls = families.hooks(record, "dropin").dropin_class(record)
    assert issubclass(cls, Transformer)
    below = cls.__mro__[:cls.__mro__.index(Transformer)]
    assert below, cls
    for klass in below:
        own = sorted(n for n in ("forward", "__call__") if n in klass.__dict__)
        assert not own, f"{klass.__module__}.{klass.__qualname__} defines {own}"


# --------------------------------------------------------------------------------------------
# The hooks on a fake runner
# --------------------------------------------------------------------------------------------

class _Runner:
    """What the drop-in uses of a runner; returns its tokens plus each row's timestep (so a
    row's origin shows in the sample) and records each call."""

    device = torch.device("cpu")
    copy_outputs = True
    backend = "fake"

    def __init__(self):
        cfg = {"_class_name": QWEN.class_name, "joint_attention_dim": 8, "num_layers": 1}
        self.io = SimpleNamespace(
            config=SimpleNamespace(diffusers_config=cfg, num_layers_exported=None,
                                   family=QWEN.name, axes_dims_rope=list(AXES), rope_theta=None),
            roles={r: r for r in ("hidden_states", "encoder_hidden_states", "timestep",
                                  "img_cache", "txt_cache")},
            source="fake.onnx", head_dim=sum(AXES),
            input=lambda name: SimpleNamespace(dtype="float32"))
        self.calls = []

    def __call__(self, hidden_states, encoder_hidden_states, caches, mask, timestep,
                 conditioning=None):
        self.calls.append(dict(tokens=tuple(hidden_states.shape), img_rows=caches.img.shape[0],
                               txt_rows=caches.txt.shape[0]))
        return hidden_states + timestep[:, None, None]


def _call(grid, txt, values, **fields):
    """A Call of one batch row per value: [n, h * w, 4] tokens, the row's value as timestep."""
    h, w = grid
    n = len(values)
    return Call(torch.zeros(n, h * w, 4), torch.zeros(n, txt, 8),
                {"img_shapes": [(1, h, w)], "txt_seq_len": txt},
                timestep=torch.tensor(values, dtype=torch.float32), **fields)


class _Family(Transformer):
    """A family part made of the hooks alone: ``prepare`` returns what the test gives."""

    FORWARD_ARGS = ("prepared",)

    def prepare(self, prepared=None):
        return prepared


def _model():
    runner = _Runner()
    return _Family(runner, QWEN), runner


def test_a_call_returns_the_batch_tensor_in_diffusers_output():
    model, runner = _model()
    out = model(_call((2, 3), 5, [1.0, 2.0]))
    assert type(out).__name__ == "Transformer2DModelOutput"
    assert out.sample.shape == (2, 6, 4) and torch.equal(out.sample[1], torch.full((6, 4), 2.0))
    (tup,) = model(_call((2, 3), 5, [1.0, 2.0], return_dict=False))
    assert torch.equal(tup, out.sample)
    assert runner.calls == [dict(tokens=(2, 6, 4), img_rows=6, txt_rows=5)] * 2


def test_unpack_gives_the_pipelines_latent_layout():
    """Call.unpack maps the runner's tokens to the pipeline's layout (here [B, C, h, w])."""
    model, _ = _model()
    seen = []

    def unpack(sample):
        seen.append(sample.shape)
        return sample.transpose(1, 2).reshape(sample.shape[0], 4, 2, 3)

    (out,) = model(_call((2, 3), 5, [3.0], unpack=unpack, return_dict=False))
    assert seen == [(1, 6, 4)] and out.shape == (1, 4, 2, 3)
    assert torch.equal(out, torch.full((1, 4, 2, 3), 3.0))


def test_a_split_runs_each_group_and_returns_the_per_sample_list_in_batch_order():
    """Three items in two groups of other grids and texts, given out of order: one runner call
    per group with its own caches; item i's sample comes back at i (its value i shows it),
    unpacked by its group's unpack."""
    model, runner = _model()
    grids = {0: (2, 2), 1: (1, 3)}

    def unpack(grid):
        return lambda sample: sample.reshape(sample.shape[0], *grid, 4)

    split = Split([_call(grids[0], 3, [2.0, 0.0], items=(2, 0), unpack=unpack(grids[0])),
                   _call(grids[1], 7, [1.0], items=(1,), unpack=unpack(grids[1]))], batch=3,
                  return_dict=False)
    (out,) = model(split)
    assert isinstance(out, list) and len(out) == 3
    assert [tuple(s.shape) for s in out] == [(2, 2, 4), (1, 3, 4), (2, 2, 4)]
    assert all(torch.equal(s, torch.full_like(s, float(i))) for i, s in enumerate(out))
    assert runner.calls == [dict(tokens=(2, 4, 4), img_rows=4, txt_rows=3),
                            dict(tokens=(1, 3, 4), img_rows=3, txt_rows=7)]
    wrapped = model(Split(split.calls, batch=3))
    assert isinstance(wrapped.sample, list) and len(wrapped.sample) == 3


def test_a_stacked_split_returns_one_batch_tensor_in_batch_order():
    """Split.stack: groups of equal shapes (items whose positions differ) come back as one
    [batch, ...] tensor, item i at row i (a forward that returns batch tensors)."""
    model, runner = _model()
    split = Split([_call((2, 2), 3, [2.0, 0.0], items=(2, 0)), _call((2, 2), 5, [1.0], items=(1,))],
                  batch=3, return_dict=False, stack=True)
    (out,) = model(split)
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (3, 4, 4)
    assert all(torch.equal(out[i], torch.full_like(out[i], float(i))) for i in range(3))
    assert [c["txt_rows"] for c in runner.calls] == [3, 5]


@pytest.mark.parametrize("items, batch, match", [
    ([(0,), (0,)], 2, "badly"),        # an item in two groups
    ([(0,), (2,)], 2, "badly"),        # past the batch
    ([(0, 0), (1,)], 2, "badly"),      # twice in one group
    ([(1,)], 2, r"left batch items \[0\]"),
])
def test_a_bad_split_is_a_programming_error_naming_the_items(items, batch, match):
    model, _ = _model()
    calls = [_call((1, 2), 3, [0.0] * len(i), items=i) for i in items]
    with pytest.raises(RuntimeError, match=match):
        model(Split(calls, batch=batch))


def test_output_is_the_one_place_of_the_return_wrapping():
    """A family whose diffusers forward returns something else overrides output alone."""
    class Other(_Family):
        def output(self, sample, return_dict):
            return {"sample": sample, "return_dict": return_dict}

    model = Other(_Runner(), QWEN)
    got = model(_call((1, 2), 3, [4.0], return_dict=False))
    assert got["return_dict"] is False and torch.equal(got["sample"],
                                                       torch.full((1, 2, 4), 4.0))
