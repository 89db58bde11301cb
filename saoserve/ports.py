"""Loopback ports for the servers the demo, the benchmarks and the tests start as child processes.

A port that the kernel picks (``bind(("127.0.0.1", 0))``) comes from its ephemeral range, the
range it also gives every outgoing connection of the machine: vLLM's ZMQ sockets, database and
broker clients. A child that binds such a port a few seconds after it was picked can find it
taken by one of those, and fail. Ports below that range are handed out only by ``bind`` to an
explicit port, so one picked there is taken only by another picker.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 10_000  # below this sit the well-known and registered services a machine may run
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_TRIES = 200


def ephemeral_low(range_file: Path = _RANGE_FILE) -> int:
    """The lowest port of the kernel's ephemeral range (Linux's ``ip_local_port_range``, 32768
    by default; the default where the file is absent or unreadable)."""
    try:
        return int(range_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing is bound to, drawn at random from ``LOWEST`` up to
    the ephemeral range (the kernel's own pick where that range starts too low to leave room).
    Raises RuntimeError if ``_TRIES`` draws all find their port bound."""
    low = ephemeral_low()
    if low - LOWEST < 1_000:
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    rng = random.SystemRandom()
    for _ in range(_TRIES):
        port = rng.randrange(LOWEST, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on {host} in {LOWEST}-{low - 1} after {_TRIES} tries")
