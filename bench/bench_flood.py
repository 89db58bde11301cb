"""A flood from one API key against another key's latency, with and without backpressure (issue 42).

One vLLM engine in this process, the real app (SQLite database and trajectory log) and two API
keys of two tenants. In each round, interleaved:

- ``alone``: the other key sends ``--requests`` chats one after another, nobody else does;
- ``flood, limit N``: the same while the flooding key keeps ``--flood-streams`` requests going
  at once, with ``SAOSERVE_KEY_CONCURRENCY_LIMIT`` = N, for each N of ``--key-limits``: its
  requests over the limit are answered 429 and it sends them again after ``--flood-backoff-s``
  (less than the Retry-After a well-behaved client waits: a flood);
- ``flood, no limit``: the same flood with no limit, for comparison.

Prints the other key's p50 and p95 latency in each, its p95 over its p95 alone (target: within
1.5× under a limited flood), the flooder's answers and 429s, and records the table
(``bench/results.py``, ``flood_429``).

    flock /tmp/saoserve-engine.lock .venv/bin/python bench/bench_flood.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results import record  # noqa: E402
from core.db import make_engine, migrate  # noqa: E402
from core.keys import KeyStore  # noqa: E402
from core.records import utcnow  # noqa: E402
from testing.servers import make_settings, running_server  # noqa: E402


def p95(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.95 * (len(s) - 1)))]


def configs(limits: list[int]) -> list[str]:
    return ["alone", *(f"flood, limit {n}" for n in limits), "flood, no limit"]


async def run_config(engine, home: Path, model: Path, config: str, args) -> dict:
    limit = int(config.rsplit(" ", 1)[1]) if config.startswith("flood, limit ") else 0
    settings = make_settings(home, model_dir=model, key_concurrency_limit=limit)
    migrate(settings.resolved_database_url)
    db = make_engine(settings.resolved_database_url)
    store = KeyStore(db)
    _, victim = store.create("quiet", utcnow())
    _, flooder = store.create("noisy", utcnow())
    db.dispose()
    body = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": args.max_tokens}
    stop = asyncio.Event()
    counts = {"ok": 0, "429": 0}

    async def flood_worker(http: httpx.AsyncClient, i: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            r = await http.post(
                "/v1/chat/completions",
                json=body | {"seed": 100 * i + n},
                headers={"Authorization": f"Bearer {flooder}"},
            )
            if r.status_code == 429:
                counts["429"] += 1
                await asyncio.sleep(args.flood_backoff_s)
            else:
                r.raise_for_status()
                counts["ok"] += 1

    async with running_server(settings, engine, watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            flood = []
            if config != "alone":
                flood = [asyncio.create_task(flood_worker(http, i)) for i in range(args.flood_streams)]
                await asyncio.sleep(1.0)  # the flood is under way before the measurement
            lat = []
            for i in range(args.requests):
                t0 = time.perf_counter()
                r = await http.post(
                    "/v1/chat/completions",
                    json=body | {"seed": i},
                    headers={"Authorization": f"Bearer {victim}"},
                )
                r.raise_for_status()
                lat.append(time.perf_counter() - t0)
            stop.set()
            await asyncio.gather(*flood)
    return {"lat": lat, **counts}


async def main(args: argparse.Namespace) -> None:
    from saoserve.model import prepare_model
    from server.engine import PolicyEngine

    # A `timeout` that ends the run still shuts the engine down (the ``finally`` below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    model = prepare_model(ROOT / "var" / "model")
    tmp = Path(tempfile.mkdtemp(prefix="bench-flood-"))
    engine = await PolicyEngine.start(make_settings(tmp / "engine", model_dir=model), model)
    runs: dict[str, list[dict]] = {c: [] for c in configs(args.key_limits)}
    try:
        await run_config(
            engine, tmp / "warmup", model, "alone", argparse.Namespace(**vars(args) | {"requests": 4})
        )
        for rnd in range(args.rounds):
            for c in runs:
                home = tmp / f"{rnd}-{c.replace(', ', '-').replace(' ', '')}"
                runs[c].append(await run_config(engine, home, model, c, args))
                print(f"round {rnd} {c}: p95 {p95(runs[c][-1]['lat']):.2f} s", flush=True)
    finally:
        engine.shutdown()
    alone = p95([x for r in runs["alone"] for x in r["lat"]])
    rows = []
    for c, rs in runs.items():
        lat = [x for r in rs for x in r["lat"]]
        rows.append(
            {
                "other key's traffic": c,
                "p50 s": statistics.median(lat),
                "p95 s": p95(lat),
                "p95 / p95 alone": p95(lat) / alone,
                "flooder answered": sum(r["ok"] for r in rs),
                "flooder 429s": sum(r["429"] for r in rs),
            }
        )
    print(
        f"\n{args.rounds} rounds x {args.requests} requests of the other key; flood {args.flood_streams} "
        f"streams, key limits {args.key_limits}; load average {os.getloadavg()[0]:.1f}"
    )
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in cols))
    record(
        "flood_429",
        "A flood from one API key: 429s, and another key's latency",
        rows,
        notes=(
            f"The other key sends {args.requests} chats one after another (max_tokens "
            f"{args.max_tokens}) in each of {args.rounds} rounds; the flooding key keeps "
            f"{args.flood_streams} requests going, sending a refused one again after "
            f"{args.flood_backoff_s} s. 'flood, limit N': SAOSERVE_KEY_CONCURRENCY_LIMIT=N. "
            "Target: the other key's p95 within 1.5× of its p95 alone under a limited flood. A "
            f"2-core machine shared with other jobs (load average {os.getloadavg()[0]:.1f} at the end); "
            "the client runs in the server's process."
        ),
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=12, help="the other key's chats a configuration")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--flood-streams", type=int, default=16)
    p.add_argument(
        "--key-limits", type=lambda v: [int(x) for x in v.split(",")], default=[2, 1], help="e.g. 2,1"
    )
    p.add_argument("--flood-backoff-s", type=float, default=0.1)
    asyncio.run(main(p.parse_args()))
