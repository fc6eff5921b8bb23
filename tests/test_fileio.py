"""qkrope._fileio: atomic writes."""

from __future__ import annotations

import pytest

from qkrope._fileio import write_atomic


def test_write_atomic_replaces_and_cleans_up(tmp_path):
    target = tmp_path / "sub" / "m.engine"
    write_atomic(target, b"one")
    write_atomic(target, memoryview(b"two"))
    assert target.read_bytes() == b"two"

    class Boom:
        def __len__(self):
            raise RuntimeError("boom")

    with pytest.raises(TypeError):
        write_atomic(target, Boom())
    assert target.read_bytes() == b"two"
    assert sorted(p.name for p in target.parent.iterdir()) == ["m.engine"]
