"""Whether a dependency (database, log broker) is up, remembered between calls (docs/design.md §8).

A ``Breaker`` lets a caller refuse work before starting it when the dependency is known to be
down, instead of generating an answer whose record cannot be stored: after a failure it stays
open for ``cooldown_s`` (every check refuses at once, nothing is sent), then the next check
probes again. A success less than ``fresh_s`` old skips the probe, so a busy server probes at
most about once per ``fresh_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Unavailable(RuntimeError):
    """A storage dependency could not take or serve records; retrying later may succeed."""


class Breaker:
    """Recent health of one dependency; thread-safe (probes run one at a time).

    ``probe`` raises any exception when the dependency does not answer; ``error`` is the
    ``Unavailable`` subclass that ``check`` raises.
    """

    def __init__(
        self,
        name: str,
        probe: Callable[[], None],
        error: type[Unavailable] = Unavailable,
        fresh_s: float = 0.5,
        cooldown_s: float = 1.0,
    ):
        self.name, self.probe, self.error = name, probe, error
        self.fresh_s, self.cooldown_s = fresh_s, cooldown_s
        self._last_ok = float("-inf")
        self._down_until = float("-inf")
        self._reason = ""
        self._lock = threading.Lock()

    def ok(self) -> None:
        """Record that the dependency just answered."""
        self._last_ok = time.monotonic()

    def trip(self, reason: str) -> None:
        """Record a failure: checks refuse for the next ``cooldown_s`` seconds."""
        self._reason = reason
        self._down_until = time.monotonic() + self.cooldown_s
        self._last_ok = float("-inf")

    @property
    def down(self) -> bool:
        """True while the breaker is open after a failure (no probe is made)."""
        return time.monotonic() < self._down_until

    def check(self) -> None:
        """Return if the dependency answered recently or answers a probe now.

        Raises ``self.error`` while open or when the probe fails (which opens it).
        """
        if self.down:
            raise self.error(f"{self.name} is unavailable: {self._reason}")
        if time.monotonic() - self._last_ok < self.fresh_s:
            return
        with self._lock:
            if self.down:
                raise self.error(f"{self.name} is unavailable: {self._reason}")
            if time.monotonic() - self._last_ok < self.fresh_s:
                return
            try:
                self.probe()
            except Exception as exc:  # any failure of the probe means "down"
                self.trip(f"{exc.__class__.__name__}: {exc}")
                raise self.error(f"{self.name} is unavailable: {self._reason}") from exc
            self.ok()
