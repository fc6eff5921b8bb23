"""Progress of the long commands (``qkrope export``, ``qkrope build``): tqdm bars on a terminal,
plain lines in a log.

:class:`Steps` is one command's numbered steps. On a terminal it is one tqdm line
``[elapsed] prefix: [k/N] step``; the elapsed time keeps moving while a step runs (tqdm only
redraws when it is updated, so a ticker thread refreshes it once a second; tracing a 60-block
transformer is one step of a minute with nothing to count) and stays visible when a long step
description is cut at the terminal's width. Steps that can count their work
(bytes written to external data) open a nested bar with :meth:`Steps.counter`. Elsewhere (a
file, CI) every step is one line when it starts, so logs carry no carriage returns, a step still
running after ``heartbeat`` seconds (30) prints a line saying so every ``heartbeat`` seconds
(optimising a 60-block graph is one step of minutes that nothing inside it can count), and a
counter given ``every`` prints a line each time its count passes a multiple of it (each GiB
written) and one when it closes. ``enabled=False`` prints nothing.

The TensorRT build's own phases come from ``trt.IProgressMonitor`` (:func:`make_progress_monitor`,
a subclass of the ``tensorrt`` module it is given: nothing here imports TensorRT), drawn by
:class:`BuildProgress` with the same tqdm bars.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Callable, Iterator, TextIO


def is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or non-file stream
        return False


def tqdm_size() -> dict:
    """tqdm's width and height: the terminal's, or 80 x 24 where it reports none (a pty of zero
    size, on which tqdm's own detection gives -1 rows and draws nothing)."""
    import shutil

    size = shutil.get_terminal_size()
    return {"ncols": size.columns, "nrows": size.lines}


class _Ticker:
    """Refreshes a tqdm bar every ``interval`` seconds from a daemon thread until stopped."""

    def __init__(self, bar, interval: float = 1.0):
        self.bar, self.interval = bar, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="qkrope-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.bar.refresh()
            except Exception:  # noqa: BLE001 - a display problem must never end the command
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval)


class _Counter:
    def __init__(self, bar):
        self.bar = bar

    def update(self, n: int = 1) -> None:
        self.bar.update(n)

    def set_total(self, n: int) -> None:
        if self.bar.total != n:
            self.bar.total = n
            self.bar.refresh()


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``1 h 02 min``: a duration for a log line."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def _amount(n: float, unit: str) -> str:
    return f"{n / 2**30:.2f} GiB" if unit == "B" else f"{int(n)} {unit}"


class _LineCounter:
    """A counter off a terminal: a line each time the count passes a multiple of ``every``,
    and one when it closes (what was counted, in how long)."""

    def __init__(self, say: Callable[[str], None], what: str, total: int | None, unit: str,
                 every: float, clock: Callable[[], float]):
        self.say, self.what, self.total, self.unit = say, what, total, unit
        self.every, self.clock, self.t0 = float(every), clock, clock()
        self.n, self.next = 0, float(every)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n >= self.next:
            self.next = (self.n // self.every + 1) * self.every
            of = ""
            if self.total:
                of = (f" of {_amount(self.total, self.unit)} "
                      f"({100 * min(self.n / self.total, 1):.0f}%)")
            self.say(f"{self.what}: {_amount(self.n, self.unit)}{of}, "
                     f"{duration(self.clock() - self.t0)}")

    def set_total(self, n: int) -> None:
        self.total = n

    def close(self) -> None:
        self.say(f"{self.what}: {_amount(self.n, self.unit)} in "
                 f"{duration(self.clock() - self.t0)}")


class _Heartbeat:
    """Calls ``say(elapsed)`` every ``interval`` seconds from a daemon thread until stopped."""

    def __init__(self, say: Callable[[float], None], interval: float,
                 clock: Callable[[], float]):
        self.say, self.interval, self.clock, self.t0 = say, interval, clock, clock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="qkrope-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.say(self.clock() - self.t0)
            except Exception:  # noqa: BLE001 - a display problem must never end the command
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval)


class _NullCounter:
    def update(self, n: int = 1) -> None:
        pass

    def set_total(self, n: int) -> None:
        pass


class Steps:
    """``with Steps("qkrope export", 6) as steps: with steps.step("tracing"): ...``."""

    def __init__(self, prefix: str, total: int, *, enabled: bool = True,
                 stream: TextIO | None = None, tty: bool | None = None,
                 clock: Callable[[], float] = time.monotonic, heartbeat: float = 30.0):
        self.prefix, self.total, self.enabled = prefix, int(total), enabled
        self.heartbeat = heartbeat
        self.stream = stream if stream is not None else sys.stderr
        self.tty = is_terminal(self.stream) if tty is None else tty
        self.clock = clock
        self.done = 0
        self.t0 = clock()
        self._bar = None
        self._ticker = None
        if enabled and self.tty:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.total, file=self.stream, desc=f"{prefix}: starting",
                             leave=True, bar_format="[{elapsed}] {desc}",
                             **tqdm_size())
            self._ticker = _Ticker(self._bar)

    def __enter__(self) -> "Steps":
        return self

    def __exit__(self, *exc) -> None:
        self.close(ok=exc[0] is None)

    def write(self, text: str) -> None:
        """A line of the command's own output, printed whether or not progress is shown (above
        the bar on a terminal, so the two never share a line)."""
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def note(self, text: str) -> None:
        """A line of its own (above the bar on a terminal)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(f"{self.prefix}: {text}", file=self.stream)
        else:
            print(f"{self.prefix}: {text}", file=self.stream, flush=True)

    @contextlib.contextmanager
    def step(self, text: str) -> Iterator[None]:
        """One numbered step: shown while it runs, counted when it returns."""
        label = f"[{self.done + 1}/{self.total}] {text}"
        beat = None
        if self._bar is not None:
            self._bar.set_description_str(f"{self.prefix}: {label}", refresh=True)
        elif self.enabled:
            print(f"{self.prefix}: {label}", file=self.stream, flush=True)
            if self.heartbeat and self.heartbeat > 0:
                number = label.split("]")[0] + "]"
                beat = _Heartbeat(lambda t: self._line(f"  {number} still running, "
                                                       f"{duration(t)}"),
                                  self.heartbeat, self.clock)
        try:
            yield
        finally:
            if beat is not None:
                beat.stop()
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)

    def _line(self, text: str) -> None:
        print(f"{self.prefix}: {text}", file=self.stream, flush=True)

    @contextlib.contextmanager
    def counter(self, what: str, total: int | None = None, unit: str = "it",
                every: float | None = None):
        """A nested bar for work that can be counted; yields an object with ``update(n=1)`` and
        ``set_total(n)``. ``unit="B"``: bytes (GiB in the lines, scaled on the bar). Off a
        terminal: with ``every``, a line each time the count passes a multiple of it and one
        at the end; else nothing."""
        if self._bar is None:
            if not self.enabled or not every:
                yield _NullCounter()
                return
            lines = _LineCounter(lambda text: self._line(f"  {text}"), what, total, unit, every,
                                 self.clock)
            yield lines
            lines.close()
            return
        from tqdm.auto import tqdm

        scale = dict(unit_scale=True, unit_divisor=1024) if unit == "B" else {}
        bar = tqdm(total=total, file=self.stream, desc=f"  {what}", unit=unit, leave=False,
                   **scale, **tqdm_size())
        try:
            yield _Counter(bar)
        finally:
            bar.close()

    def close(self, *, ok: bool = True) -> None:
        if self._ticker is not None:
            self._ticker.stop()
            self._ticker = None
        if self._bar is not None:
            if ok:
                self._bar.set_description_str(f"{self.prefix}: {self.done} steps done",
                                              refresh=True)
            self._bar.close()
            self._bar = None


class BuildProgress:
    """Renders TensorRT's build phases (``trt.IProgressMonitor`` calls). On a terminal: a tqdm bar
    per active phase down to ``max_depth`` (nested phases below their parent, removed when they
    finish); otherwise: plain lines when phases down to ``max_depth`` start and finish.

    ``step_complete`` returns False after :meth:`cancel` (TensorRT then stops the build).
    """

    def __init__(self, stream: TextIO | None = None, *, tty: bool | None = None,
                 max_depth: int = 1, clock: Callable[[], float] = time.monotonic):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = is_terminal(self.stream) if tty is None else tty
        self.max_depth = max_depth
        self.clock = clock
        self.phases: dict[str, dict] = {}
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        for info in self.phases.values():
            if info.get("bar") is not None:
                info["bar"].close()
                info["bar"] = None

    def _depth(self, name: str) -> int:
        depth, parent = 0, self.phases.get(name, {}).get("parent")
        while parent is not None and parent in self.phases:
            depth += 1
            parent = self.phases[parent].get("parent")
        return depth

    def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
        info = {"parent": parent_phase, "steps": max(int(num_steps), 0), "t0": self.clock(),
                "bar": None}
        self.phases[phase_name] = info
        depth = self._depth(phase_name)
        if depth > self.max_depth:
            return
        if self.tty:
            from tqdm.auto import tqdm

            info["bar"] = tqdm(total=info["steps"] or None, desc=f"[build] {phase_name}",
                               file=self.stream, leave=False, unit="step",
                               **tqdm_size())
        else:
            steps = f" ({info['steps']} steps)" if info["steps"] > 1 else ""
            self._line(f"{'  ' * depth}[build] {phase_name}{steps}")

    def step_complete(self, phase_name: str, step: int) -> bool:
        info = self.phases.get(phase_name)
        if info is not None and info["bar"] is not None:
            bar = info["bar"]
            bar.n = int(step) + 1
            bar.refresh()
        return not self.cancelled

    def phase_finish(self, phase_name: str) -> None:
        depth = self._depth(phase_name)
        info = self.phases.pop(phase_name, None)
        if info is None:
            return
        elapsed = self.clock() - info["t0"]
        if info["bar"] is not None:
            info["bar"].close()
        if depth > self.max_depth or (self.tty and depth > 0):
            return
        self._line(f"{'  ' * depth}[build] {phase_name} done in {elapsed:.1f} s")

    def _line(self, text: str) -> None:
        if self.tty:
            from tqdm.auto import tqdm

            tqdm.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()


def make_progress_monitor(trt, progress: BuildProgress):
    """A ``trt.IProgressMonitor`` forwarding to ``progress`` (exceptions never reach TensorRT)."""

    class _Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)

        def phase_start(self, phase_name, parent_phase, num_steps):
            try:
                progress.phase_start(phase_name, parent_phase, num_steps)
            except Exception:
                pass

        def step_complete(self, phase_name, step):
            try:
                return progress.step_complete(phase_name, step)
            except Exception:
                return True

        def phase_finish(self, phase_name):
            try:
                progress.phase_finish(phase_name)
            except Exception:
                pass

    return _Monitor()


__all__ = ["BuildProgress", "Steps", "duration", "is_terminal", "make_progress_monitor",
           "tqdm_size"]
