"""QKROPE_VERIFY (issue 34, class 5): a security setting accepts its documented values only
("full": every load hashes; "stat" or unset: the stat record, then the hash when it differs)
and refuses anything else in one line naming them; it never falls back to the fast check."""

from __future__ import annotations

import pytest

from qkrope import file_record
from qkrope.errors import InputError


@pytest.mark.parametrize("value, full", [(None, False), ("", False), ("stat", False),
                                         ("full", True)])
def test_documented_values(monkeypatch, value, full):
    if value is None:
        monkeypatch.delenv(file_record.VERIFY_ENV, raising=False)
    else:
        monkeypatch.setenv(file_record.VERIFY_ENV, value)
    assert file_record.full_by_default() is full


@pytest.mark.parametrize("value", ["1", "yes", "true", "on", "ful", "FULL ", "Full", "0", "fast"])
def test_anything_else_is_refused_in_one_line(monkeypatch, value):
    monkeypatch.setenv(file_record.VERIFY_ENV, value)
    with pytest.raises(InputError) as info:
        file_record.full_by_default()
    msg = str(info.value)
    assert "\n" not in msg
    assert repr(value) in msg and "full" in msg and "stat" in msg and "QKROPE_VERIFY" in msg


def test_a_load_with_a_bad_value_is_refused_not_fast(tmp_path, monkeypatch):
    """verify() through a sidecar load path: the value is read by the loaders (qkrope/sidecars/)
    through full_by_default, so a typo stops the load instead of taking the stat check."""
    from qkrope import sidecars

    assert sidecars.full_by_default is file_record.full_by_default
    monkeypatch.setenv(file_record.VERIFY_ENV, "yes")
    with pytest.raises(InputError):
        sidecars.full_by_default()
