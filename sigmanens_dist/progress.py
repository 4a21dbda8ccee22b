"""Progress that reads well both in a terminal and in a Slurm ``.out`` file.

On a TTY: tqdm's bar. Anywhere else (a batch job's log, a pipe): tqdm's ``\\r`` frames would pile up into one
unreadable line (~26 KB per 100 steps), so instead one plain line every ``SIGMANENS_PROGRESS_SECONDS`` (default 30)
and one at the end: ``train: 1200/6250 step (19%) 11.7 step/s ETA 7m12s | task=0.412 img_s=368``.
"""

from __future__ import annotations

import io
import logging
import os
import shlex
import sys
import textwrap
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

__all__ = ["WIDTH", "LineProgress", "near", "progress", "shell_command", "text_console", "wrap"]

WIDTH = 100  # what the project prints fits a 100-column terminal (tests/experiments/test_terminal_output.py)

log = logging.getLogger("sigmanens")


def progress(iterable: Iterable[Any] | None = None, *, total: int | None = None, desc: str = "", unit: str = "it",
             initial: int = 0, disable: bool = False, leave: bool = True) -> Any:
    """A tqdm bar on a terminal, else a :class:`LineProgress`; the same calls (``update``, ``set_postfix``,
    ``close``, iteration, ``with``). ``disable`` (e.g. every rank but 0) shows nothing at all."""
    if disable or sys.stderr.isatty():
        return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, disable=disable, leave=leave,
                    dynamic_ncols=True)
    every = float(os.environ.get("SIGMANENS_PROGRESS_SECONDS", "30"))
    return LineProgress(iterable, total=total, desc=desc, unit=unit, initial=initial, every=every)


class LineProgress:
    """tqdm's interface, printed as a log line at most every ``every`` seconds (and once when closed)."""

    def __init__(self, iterable: Iterable[Any] | None = None, *, total: int | None, desc: str, unit: str,
                 initial: int = 0, every: float = 30.0) -> None:
        self.iterable, self.desc, self.unit, self.every = iterable, desc, unit, every
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.n = self._start = initial
        self._began = self._last = time.monotonic()
        self._postfix = ""
        self._closed = False

    def __iter__(self) -> Iterator[Any]:
        for item in self.iterable or ():
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= self.every:
            self._last = now
            self._emit(now)

    def set_postfix(self, **values: Any) -> None:
        self._postfix = " ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.n > self._start:
                self._emit(time.monotonic())

    def line(self, now: float) -> str:
        done = self.n - self._start
        rate = done / max(now - self._began, 1e-9)
        parts = [f"{self.desc}: {self.n}" + (f"/{self.total}" if self.total else "") + f" {self.unit}"]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        parts.append(f"{rate:.3g} {self.unit}/s")
        if self.total and rate > 0 and self.n < self.total:
            parts.append(f"ETA {_duration((self.total - self.n) / rate)}")
        return " ".join(parts) + (f" | {self._postfix}" if self._postfix else "")

    def _emit(self, now: float) -> None:
        print(self.line(now), file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def wrap(text: str, indent: str = "  ") -> str:
    """A message folded at :data:`WIDTH` columns, continuation lines indented."""
    return textwrap.fill(text, WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def shell_command(words: list[str], prompt: str = "$ ") -> str:
    """A command as a person reads it and a shell takes it back: quoted, folded at :data:`WIDTH` columns with
    backslash continuations (a word longer than a line keeps a line of its own)."""
    lines, line = [], prompt
    for word in map(shlex.quote, words):
        if len(line) + len(word) + 2 > WIDTH and line.strip() not in ("", prompt.strip()):
            lines.append(line.rstrip() + " \\")
            line = "    "
        line += word + " "
    return "\n".join([*lines, line.rstrip()])


def text_console(width: int = WIDTH) -> tuple[Any, io.StringIO]:
    """A rich console that renders plain text into a buffer at ``width`` columns (no colour, no wrapping of its own)."""
    from rich.console import Console  # lazy: only tables need rich; every floor imports this module

    buf = io.StringIO()
    return Console(file=buf, width=width, color_system=None, force_terminal=False, soft_wrap=False,
                   highlight=False, emoji=False), buf


def near(path: Path) -> str:
    """``path`` relative to the working directory when it is below it (shorter to read, same to type), else as is."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
