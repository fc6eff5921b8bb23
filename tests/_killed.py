"""A child Python process SIGKILLed at a chosen point, for the crash-safety tests of the file
writers (tests/test_fileio.py, tests/test_fileio_stale.py)."""

from __future__ import annotations

import signal
import subprocess
import sys


def kill_at(script: str, *args: str, line: str = "moved") -> None:
    """Run ``script`` (``python -c``) with ``args`` and SIGKILL it once it prints ``line`` (the
    point it has reached); the process must have died of that kill."""
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == line
        proc.kill()
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        proc.kill() if proc.poll() is None else None
