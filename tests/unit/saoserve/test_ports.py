"""saoserve.ports: the ports the demo, benchmarks and tests hand their child servers."""

from __future__ import annotations

import socket

import pytest

from saoserve import ports


def test_the_kernels_range_is_read_from_its_file(tmp_path):
    f = tmp_path / "ip_local_port_range"
    f.write_text("40000\t60999\n")
    assert ports.ephemeral_low(f) == 40_000


@pytest.mark.parametrize("content", [None, "", "not a number\n"])
def test_an_absent_or_unreadable_range_file_gives_linuxs_default(tmp_path, content):
    f = tmp_path / "ip_local_port_range"
    if content is not None:
        f.write_text(content)
    assert ports.ephemeral_low(f) == 32_768


def test_a_port_is_drawn_below_the_ephemeral_range_and_is_free(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_low", lambda: 32_768)
    for _ in range(20):
        port = ports.free_port()
        assert ports.LOWEST <= port < 32_768
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_bound_port_is_never_drawn(monkeypatch):
    """With the range narrowed to one bound port and one free one, the free one comes back."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        bound = taken.getsockname()[1]
        draws = iter([bound, bound, bound + 1])
        monkeypatch.setattr(ports.random.SystemRandom, "randrange", lambda self, a, b: next(draws))
        monkeypatch.setattr(ports, "ephemeral_low", lambda: 60_000)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", bound + 1))
            except OSError:
                pytest.skip("the port after the kernel's pick is in use")
        assert ports.free_port() == bound + 1


def test_no_free_port_is_an_error_naming_the_range(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        bound = taken.getsockname()[1]
        monkeypatch.setattr(ports.random.SystemRandom, "randrange", lambda self, a, b: bound)
        monkeypatch.setattr(ports, "ephemeral_low", lambda: 32_768)
        with pytest.raises(RuntimeError, match=r"no free port on 127.0.0.1 in 10000-32767 after 200 tries"):
            ports.free_port()


def test_a_range_starting_too_low_leaves_the_pick_to_the_kernel(monkeypatch):
    """10,500 leaves 500 ports above ``LOWEST``: the kernel picks, from its real range."""
    real_low = ports.ephemeral_low()
    monkeypatch.setattr(ports, "ephemeral_low", lambda: 10_500)
    assert ports.free_port() >= real_low
