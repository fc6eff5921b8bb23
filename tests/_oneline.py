"""The one-line error of a command, read from its stderr (one home for the robustness tests).

A command prints its progress on stderr before any error: the step lines
("qkrope export: [1/6] ..."), their heartbeats on a slow machine
("qkrope export:   [2/6] still running, 30 s") and the export's dtype choice
("qkrope export: dtype fp32: ... the checkpoint's dtype"). What is left must be exactly one line,
with no traceback.
"""

from __future__ import annotations

import re

PROGRESS = re.compile(r"qkrope [\w-]+: +(\[\d+/\d+\]|dtype \w+: )")


def error_lines(err: str) -> list[str]:
    """``err`` without its progress lines."""
    return [ln for ln in err.strip().splitlines() if not PROGRESS.match(ln)]


def error_line(capsys) -> str:
    """The one error line of the captured stderr (asserted: one line, no traceback)."""
    err = capsys.readouterr().err
    lines = error_lines(err)
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]
