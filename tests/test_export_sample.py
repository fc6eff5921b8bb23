"""The traced sample of a one-grid family (qkrope.export.sample.one_grid): the video families'
export hooks (HunyuanVideo, Motif-Video, JoyImage, Cosmos, Kandinsky 5) take one latent grid,
trace an image's one frame with two, and refuse a grid torch.export cannot trace in one line
that names the sample and the fix, before anything is written."""

from __future__ import annotations

import pytest

from qkrope.errors import InputError
from qkrope.export.sample import Sample, one_grid


def test_one_frame_is_traced_with_two_and_the_rest_is_kept():
    sample = Sample([(1, 4, 6)], txt_len=8, batch=2)
    assert one_grid(sample, "X") == (2, 4, 6) and sample.img_shapes == [(2, 4, 6)]
    sample = Sample([(3, 2, 5)], txt_len=8, batch=2)
    assert one_grid(sample, "X") == (3, 2, 5) and sample.img_shapes == [(3, 2, 5)]


@pytest.mark.parametrize("shapes, match", [
    ([(2, 4, 4), (2, 4, 4)], r"a X sample is one latent grid .*got 2"),
    ([(2, 1, 4)], r"--img-shape 2 1 4: a X export traces a latent of at least 2 tokens per axis"),
    ([(2, 4, 1)], r"--img-shape 2 4 1: .*Fix: pass --img-shape 2 8 8 or larger"),
])
def test_an_untraceable_grid_is_one_line(shapes, match):
    sample = Sample(list(shapes), txt_len=8, batch=2)
    with pytest.raises(InputError, match=match) as e:
        one_grid(sample, "X")
    assert "\n" not in str(e.value) and sample.img_shapes == list(shapes)


def test_a_video_family_export_refuses_it_before_writing(tiny_root, tmp_path):
    """Through the real export of a one-grid family (Cosmos' tiny model): one line naming the
    family, nothing written."""
    pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
    from _families import BUILDERS

    from qkrope.export.api import export_transformer

    builder = BUILDERS["cosmos-predict2"]
    out = tmp_path / "x.onnx"
    with pytest.raises(InputError, match=rf"a {builder.record.short} export traces a latent") as e:
        export_transformer(builder.saved(tiny_root), out, dtype="fp32", img_shapes=[(1, 1, 4)],
                           progress=False)
    assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []
