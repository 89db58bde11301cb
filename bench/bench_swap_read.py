"""The full-weight swap's pause beside a raw read of the same weights, cold and warm (issue 42).

One vLLM engine in this process (``server.engine.core.PolicyEngine``, float32, eager), and two float32
weight sets as the learner writes them (the base model and a perturbed copy,
``bench.bench_replica_swap.weight_sets``), each version folder hard-linking one of them. In each
round, for the page cache cold and then warm, interleaved:

- a raw read of the weights file: its bytes into a buffer (``readinto``), and
  ``safetensors.torch.load_file`` (the bytes as tensors);
- a swap to the next version (``PolicyEngine.swap``): its whole time (the sha256 check of the
  file, then the pause: reload in place, stamp, resume) and its pause (generation stopped).

Cold: the file's pages are dropped from the page cache first, ``posix_fadvise(DONTNEED)`` after an
``fsync`` (no root needed for pages that are not dirty; ``fincore`` shows how much is still
cached). Warm: the file is read once first. The swap's sha256 check reads the file before the
pause, so the pause itself reads warm pages either way: its ratio is to the warm read, and the
whole swap's to the cold read. Prints each and the ratios (target: pause ≤ 1.5 × the raw read),
and records the table (``bench/results.py``, ``swap_vs_read``).

    flock /tmp/saoserve-engine.lock .venv/bin/python bench/bench_swap_read.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_replica_swap import WEIGHTS_FILE, version_folder, weight_sets  # noqa: E402
from bench.results import record  # noqa: E402
from testing.servers import make_settings  # noqa: E402


def drop_cache(path: Path) -> None:
    """Drop ``path``'s pages from the page cache (written back first, so none is dirty)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cached_share(path: Path) -> float:
    """The share of ``path``'s pages in the page cache (``fincore``; -1 where it is missing)."""
    if shutil.which("fincore") is None:
        return -1.0
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES,SIZE", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return int(out[0]) / int(out[1])


def raw_read(path: Path) -> float:
    """Seconds to read ``path``'s bytes into one buffer."""
    buf = bytearray(path.stat().st_size)
    view = memoryview(buf)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        got = 0
        while got < len(buf):
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    return time.perf_counter() - t0


def tensor_read(path: Path) -> float:
    """Seconds of ``safetensors.torch.load_file(path)``: the bytes as tensors."""
    from safetensors.torch import load_file

    t0 = time.perf_counter()
    load_file(path)
    return time.perf_counter() - t0


async def main(args: argparse.Namespace) -> None:
    from saoserve.model import prepare_model
    from server.engine import PolicyEngine

    # A `timeout` that ends the run still shuts the engine down (the ``finally`` below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    model = prepare_model(ROOT / "var" / "model")
    tmp = Path(tempfile.mkdtemp(prefix="bench-swap-read-"))
    sets = weight_sets(model, tmp / "weights")
    settings = make_settings(tmp / "home", model_dir=model)
    engine = await PolicyEngine.start(settings, model)
    rows: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
    version = 0
    try:
        for rnd in range(args.rounds):
            for cache in ("cold", "warm"):
                version += 1
                weights, sha = sets[version % 2]
                folder = version_folder(tmp / "policies", version, model, weights)
                path = folder / WEIGHTS_FILE
                figures: dict[str, float] = {}
                for what in ("read", "tensors", "swap"):
                    if cache == "cold":
                        drop_cache(path)
                    else:
                        raw_read(path)
                    figures[f"cached before {what}"] = cached_share(path)
                    if what == "read":
                        figures["read s"] = raw_read(path)
                    elif what == "tensors":
                        figures["load_file s"] = tensor_read(path)
                    else:
                        res = await engine.swap(version, folder, sha)
                        figures["swap s"], figures["pause s"] = res.seconds, res.paused_seconds
                rows[cache].append(figures)
                print(f"round {rnd} {cache}: {figures}", flush=True)
    finally:
        engine.shutdown()
    size_mb = sets[0][0].stat().st_size / 1e6
    warm_read = statistics.median(r["read s"] for r in rows["warm"])
    table = []
    for cache, runs in rows.items():

        def med(key: str, runs=runs) -> float:
            return statistics.median(r[key] for r in runs)

        table.append(
            {
                "page cache": cache,
                "cached before read": med("cached before read"),
                "raw read s": med("read s"),
                "load_file s": med("load_file s"),
                "swap s": med("swap s"),
                "pause s": med("pause s"),
                "pause / warm raw read": med("pause s") / warm_read,
                "pause / raw read": med("pause s") / med("read s"),
                "swap / raw read": med("swap s") / med("read s"),
            }
        )
    print(f"\n{args.rounds} rounds, weights {size_mb:.0f} MB float32; load average {os.getloadavg()[0]:.1f}")
    cols = list(table[0])
    print(" | ".join(cols))
    for r in table:
        print(" | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    record(
        "swap_vs_read",
        "The full-weight swap's pause beside a raw read of the same weights",
        table,
        notes=(
            f"Weights file {size_mb:.0f} MB (float32); medians of {args.rounds} rounds, cold and warm "
            "interleaved. Cold: the file's pages dropped with posix_fadvise(DONTNEED) before each "
            "read and swap ('cached before read': the share fincore found cached). The swap's sha256 "
            "check reads the file before the pause, so the pause reads warm pages: compare it with "
            "the warm raw read (target ≤ 1.5×), and the whole swap with the cold one. A 2-core "
            f"machine shared with other jobs (load average {os.getloadavg()[0]:.1f} at the end)."
        ),
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(p.parse_args()))
