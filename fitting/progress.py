"""Progress that reads well in a terminal and in a log: a tqdm bar on a TTY, otherwise one line every
``every`` seconds (and a last one), so that CI logs and ``… > log.txt`` show how far a long run got."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable

__all__ = ["heartbeat", "progress"]


class _Lines:
    def __init__(self, total: int | None, desc: str, every: float):
        self.total, self.desc, self.every = total, desc, every
        self.n, self.t0, self.last = 0, time.perf_counter(), time.perf_counter()

    def update(self, k: int = 1) -> None:
        self.n += k
        now = time.perf_counter()
        if now - self.last >= self.every or (self.total is not None and self.n >= self.total):
            self.last = now
            of = f"/{self.total}" if self.total is not None else ""
            spent = now - self.t0
            eta = (f", about {spent / self.n * (self.total - self.n):.0f} s left"
                   if self.total is not None and 0 < self.n < self.total else "")
            print(f"{self.desc}: {self.n}{of} ({spent:.0f} s{eta})", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def progress(iterable: Iterable | None = None, total: int | None = None, desc: str = "", enabled: bool = True,
             every: float = 10.0, unit: str = "it"):
    """Wrap ``iterable`` (or return an object with ``update``/``close`` when it is None)."""
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)
    if not enabled:
        bar = _Lines(total, desc, float("inf"))
        bar.update = lambda k=1: None
    elif sys.stderr.isatty():
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr)
    else:
        bar = _Lines(total, desc, every)
    if iterable is None:
        return bar

    def gen():
        for item in iterable:
            yield item
            bar.update()
        bar.close()

    return gen()


def heartbeat(say, what: str, every: float = 10.0):
    """tick(text) that says ``what: text (N s)`` through ``say`` at most once every ``every`` seconds: a long
    search (a branch and bound) tells a log how far it got. ``say`` None: a tick that says nothing."""
    if say is None:
        return lambda text: None
    t0 = last = time.perf_counter()

    def tick(text) -> None:
        nonlocal last
        now = time.perf_counter()
        if now - last >= every:
            last = now
            say(f"{what}: {text() if callable(text) else text} ({now - t0:.0f} s)")
    return tick
