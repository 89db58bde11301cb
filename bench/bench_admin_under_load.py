"""Admin calls under a full streaming load: how long an operator waits (issue 23).

Starts one ``saoserve serve`` (PostgreSQL, a tansu broker; testing/replicas.py), records version 0
so a rollback has a target, then times the operators' calls twice in one run: on the idle server
and while ``--streams`` streaming chats of ``--max-tokens`` tokens run in a loop (the load runs in
a process of its own, reading the streams without parsing them, so the measuring client does not
share its interpreter). The calls go round robin, one at a time, ``--calls`` of each:
``POST /admin/pause``, ``/admin/resume``, ``/admin/rollback`` (the flag the learner reads; no
learner runs, so nothing carries it out), ``GET /admin/learner`` and ``/admin/policy_versions``
(what ``saoserve admin status`` reads), ``/readyz`` and ``/healthz`` (no storage: the event
loop's own delay).

A pause or resume has taken effect when its answer comes: the flag is committed before the route
answers, and the learner reads it at its next iteration. Prints, per route, p50/p95/max idle and
under load, and the ratio of the p95s; the slowest of the flag writes (pause, resume, rollback)
under load, the bound within which they took effect; then the load's own figures (answers,
tokens/s). The p95 of a route is a nearest rank: with the default 30 calls, the 29th slowest.

    flock /tmp/saoserve-heavy.lock .venv/bin/python bench/bench_admin_under_load.py \\
        [--streams 16] [--max-tokens 128] [--calls 30] [--keep]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from testing.replicas import Deployment

# The harness lives in testing/ (installed with the package; found on the path from ROOT too).
ROOT = Path(__file__).resolve().parent.parent

# (label, method, path, JSON body); the first three write the flag the learner reads.
ROUTES = (
    ("POST /admin/pause", "POST", "/admin/pause", None),
    ("POST /admin/resume", "POST", "/admin/resume", None),
    ("POST /admin/rollback", "POST", "/admin/rollback", {"version": 0}),
    ("GET /admin/learner", "GET", "/admin/learner?limit=10", None),
    ("GET /admin/policy_versions", "GET", "/admin/policy_versions", None),
    ("GET /readyz", "GET", "/readyz", None),
    ("GET /healthz", "GET", "/healthz", None),
)


def load_loop(url: str, streams: int, max_tokens: int, started, stop, out) -> None:
    """``streams`` streaming chats in a loop until ``stop``; puts (answers, bytes, errors)."""

    async def one(i: int, http: httpx.AsyncClient, tally: list[int]) -> None:
        n = 0
        while not stop.is_set():
            body = {
                "messages": [{"role": "user", "content": f"Stream {i}, request {n}: tell a long story."}],
                "max_tokens": max_tokens,
                "stream": True,
            }
            n += 1
            try:
                async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                    async for chunk in r.aiter_raw():
                        tally[1] += len(chunk)
                    tally[0 if r.status_code == 200 else 2] += 1
            except httpx.HTTPError:
                tally[2] += 1
            if i == 0 and n == 1:
                started.set()

    async def main() -> None:
        tally = [0, 0, 0]
        limits = httpx.Limits(max_connections=streams + 4)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            await asyncio.gather(*(one(i, http, tally) for i in range(streams)))
        out.put(tuple(tally))

    asyncio.run(main())


def measure(url: str, headers: dict[str, str], calls: int, gap_s: float) -> dict[str, list[float]]:
    """``calls`` calls of each route, round robin, one at a time; seconds per call by label."""
    times: dict[str, list[float]] = {label: [] for label, *_ in ROUTES}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as http:
        for _ in range(calls):
            for label, method, path, body in ROUTES:
                t0 = time.perf_counter()
                r = http.request(method, path, json=body)
                times[label].append(time.perf_counter() - t0)
                if r.status_code != 200:
                    raise RuntimeError(f"{label}: {r.status_code} {r.text[:300]}")
                time.sleep(gap_s)
    return times


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of ``xs`` by nearest rank: the ceil(q·n)-th smallest (n = 30, q = 0.95:
    the 29th of 30; n = 20: the 19th; n = 5: the 5th, the largest)."""
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def record_version_0(db_url: str, model_dir: Path) -> None:
    from sqlalchemy import insert

    from core.db import PolicyVersion, make_engine
    from core.weights import weights_sha256

    db = make_engine(db_url)
    with db.begin() as conn:
        conn.execute(
            insert(PolicyVersion).values(
                version=0,
                path=str(model_dir),
                sha256=weights_sha256(model_dir),
                status="published",
                parent_version=None,
                metrics={},
                created_at=datetime.now(UTC),
            )
        )
    db.dispose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=16, help="streaming chats in flight during the load")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--calls", type=int, default=30, help="calls of each route per phase (idle, under load)")
    ap.add_argument("--gap-s", type=float, default=0.2, help="seconds between two calls")
    ap.add_argument("--kv-cache-gib", type=float, default=0.5)
    ap.add_argument("--keep", action="store_true", help="keep the run's folder (the server's log)")
    args = ap.parse_args()
    if args.calls < 1:
        ap.error(f"--calls must be at least 1, got {args.calls}")

    sys.path.insert(0, str(ROOT))
    from saoserve.model import prepare_model
    from testing.dependencies import TansuBroker, fresh_pg_database
    from testing.replicas import Deployment

    model_dir = prepare_model(ROOT / "var" / "model")
    home = Path(tempfile.mkdtemp(prefix="bench-admin-load-"))
    broker = TansuBroker()
    broker.start()
    try:
        with fresh_pg_database("benchadmin") as pg:
            dep = Deployment(
                home=home,
                database_url=pg,
                log_url=broker.url,
                model_dir=model_dir,
                kv_cache_gib=args.kv_cache_gib,
            )
            try:
                run(args, dep, model_dir)
            except BaseException:
                print(dep.tails(), file=sys.stderr)
                raise
            finally:
                dep.stop()
    finally:
        broker.kill()
        if args.keep:
            print(f"logs kept in {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)


def run(args, dep: Deployment, model_dir: Path) -> None:
    from testing.replicas import ADMIN, metric

    server = dep.serve("server", {"SAOSERVE_MAX_TOKENS_LIMIT": str(max(args.max_tokens, 64))})
    startup = dep.wait_ready([server])
    record_version_0(dep.database_url, model_dir)
    print(f"server ready in {startup['server']:.0f} s; {os.cpu_count()} CPUs")
    # Warm the routes and the engine once before timing anything.
    measure(server.url, ADMIN, 1, 0.0)
    httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8},
        timeout=120,
    )
    idle = measure(server.url, ADMIN, args.calls, args.gap_s)

    ctx = mp.get_context("spawn")
    started, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    load = ctx.Process(target=load_loop, args=(server.url, args.streams, args.max_tokens, started, stop, out))
    tokens_before = metric(httpx.get(f"{server.url}/metrics").text, "saoserve_generated_tokens_total") or 0.0
    load.start()
    try:
        if not started.wait(300):
            raise RuntimeError("the load's first stream did not finish within 300 s")
        t0 = time.monotonic()
        busy = measure(server.url, ADMIN, args.calls, args.gap_s)
        elapsed = time.monotonic() - t0
        page = httpx.get(f"{server.url}/metrics").text
        in_flight = metric(page, "saoserve_requests_in_flight")
        tokens = (metric(page, "saoserve_generated_tokens_total") or 0.0) - tokens_before
    finally:
        stop.set()
        answers, nbytes, errors = out.get(timeout=600)
        load.join(60)

    print(
        f"\nadmin calls, {args.calls} of each, round robin, one at a time; load: {args.streams} streaming "
        f"chats × {args.max_tokens} tokens in a loop ({in_flight:.0f} in flight at the end)"
    )
    print(
        f"{'route':<28}{'idle p50':>10}{'p95':>8}{'max':>8}{'load p50':>10}{'p95':>8}{'max':>8}"
        f"{'p95 load/idle':>15}   (ms)"
    )
    for label, *_ in ROUTES:
        a, b = idle[label], busy[label]
        cells = [pct(a, 0.5), pct(a, 0.95), max(a), pct(b, 0.5), pct(b, 0.95), max(b)]
        ms = [f"{1000 * c:>{w}.1f}" for c, w in zip(cells, (10, 8, 8, 10, 8, 8), strict=True)]
        print(f"{label:<28}{''.join(ms)}{pct(b, 0.95) / pct(a, 0.95):>15.1f}")
    every = [t for label in busy for t in busy[label]]
    writes = [t for label, *_ in ROUTES[:3] for t in busy[label]]
    print(
        f"flag writes under load (pause, resume, rollback; {len(writes)} calls): each took effect "
        f"within {1000 * max(writes):.1f} ms (p95 {1000 * pct(writes, 0.95):.1f} ms)"
    )
    print(
        f"all admin calls under load: p50 {1000 * statistics.median(every):.1f} ms, p95 "
        f"{1000 * pct(every, 0.95):.1f} ms, max {1000 * max(every):.1f} ms"
    )
    print(
        f"load during the timed phase ({elapsed:.0f} s): {tokens / elapsed:.1f} generated tokens/s; "
        f"whole load: {answers} streams answered, {errors} failed, {nbytes / 1e6:.1f} MB read; "
        f"machine load average (1 min) {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
