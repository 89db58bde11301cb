"""saoserve against vLLM's own OpenAI server, side by side (issue 42: "no slower than bare vLLM").

Starts two processes on the same prepared model with the same engine settings: vLLM's server
(``python -m vllm.entrypoints.openai.api_server``: float32, eager, the context, KV cache bytes,
prefix caching on, chunked prefill off, seed 0, processed logprobs, as ``server.engine`` starts
its engine) and ``saoserve serve`` (its SQLite database and trajectory log, so every answer is
logged). Then interleaved rounds: in each round, for 1, 8 and 16 streams, the same requests
(prompts, ``seed``, ``max_tokens``, temperature 1) go to one server and then the other, the
order alternating by round, while the other server idles. Prints tokens/s of each, the ratio
saoserve / vLLM (per round, then the median and the range over rounds) and the median latency,
and records the table (``bench/results.py``, ``vs_vllm``).

Both servers take their cores the same way (vLLM's default layout; saoserve's
``engine_threads`` unset). On a shared machine the ratio of the interleaved rounds is the figure,
not the absolute tokens/s.

    flock /tmp/saoserve-engine.lock .venv/bin/python bench/bench_vs_vllm.py [--rounds 3] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results import record  # noqa: E402
from saoserve.ports import free_port  # noqa: E402

MODEL_NAME = "smollm2-135m-instruct"
KV_CACHE_GIB = 1.0
MAX_MODEL_LEN = 2048
STREAMS = (1, 8, 16)


def vllm_command(model: Path, port: int) -> list[str]:
    """vLLM's server with ``server.engine.core.PolicyEngine.start``'s engine arguments."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        MODEL_NAME,
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes",
        str(int(KV_CACHE_GIB * (1 << 30))),
        "--enforce-eager",
        "--enable-prefix-caching",
        "--no-enable-chunked-prefill",
        "--logprobs-mode",
        "processed_logprobs",
        "--seed",
        "0",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--disable-log-stats",
    ]


def saoserve_command(port: int) -> list[str]:
    return [sys.executable, "-c", "from saoserve.cli import main; main()", "serve", "--port", str(port)]


def saoserve_env(home: Path, model: Path) -> dict[str, str]:
    return os.environ | {
        "PYTHONPATH": str(ROOT),
        "SAOSERVE_HOME": str(home),
        "SAOSERVE_MODEL_DIR": str(model),
        "SAOSERVE_FEEDBACK_SECRET": "bench-feedback-secret-0123456789",
        "SAOSERVE_ADMIN_KEY": "bench-admin-key-0123456789abcdef",
        "SAOSERVE_KV_CACHE_GIB": str(KV_CACHE_GIB),
        "SAOSERVE_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "SAOSERVE_DTYPE": "float32",
    }


async def wait_ready(url: str, path: str, proc: subprocess.Popen, timeout_s: float = 420.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{url}: the server exited with {proc.returncode}")
            try:
                if (await http.get(path)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1.0)
    raise TimeoutError(f"{url} not ready within {timeout_s} s")


async def load(
    url: str, n: int, streams: int, max_tokens: int, offset: int
) -> tuple[float, int, list[float]]:
    """``n`` chat requests with ``streams`` in flight: (wall s, completion tokens, latencies s)."""
    sem = asyncio.Semaphore(streams)
    lat: list[float] = []
    tokens = 0

    async def one(i: int, http: httpx.AsyncClient) -> None:
        nonlocal tokens
        async with sem:
            t0 = time.perf_counter()
            r = await http.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL_NAME,
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
        await asyncio.gather(*(one(offset + i, http) for i in range(n)))
        return time.perf_counter() - t0, tokens, lat


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


async def main(args: argparse.Namespace) -> None:
    from saoserve.model import prepare_model

    # A `timeout` that ends the run still stops the two servers (the ``finally`` below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    model = prepare_model(ROOT / "var" / "model")
    tmp = Path(tempfile.mkdtemp(prefix="bench-vs-vllm-"))
    vport, sport = free_port(), free_port()
    logs = {name: open(tmp / f"{name}.log", "w") for name in ("vllm", "saoserve")}  # noqa: SIM115
    procs = {
        "vllm": subprocess.Popen(
            vllm_command(model, vport), stdout=logs["vllm"], stderr=subprocess.STDOUT, start_new_session=True
        ),
        "saoserve": subprocess.Popen(
            saoserve_command(sport),
            env=saoserve_env(tmp / "home", model),
            stdout=logs["saoserve"],
            stderr=subprocess.STDOUT,
            start_new_session=True,
        ),
    }
    urls = {"vllm": f"http://127.0.0.1:{vport}", "saoserve": f"http://127.0.0.1:{sport}"}
    runs: dict[tuple[str, int], list[tuple[float, int, list[float]]]] = {}
    try:
        await wait_ready(urls["vllm"], "/v1/models", procs["vllm"])
        await wait_ready(urls["saoserve"], "/readyz", procs["saoserve"])
        for name in procs:  # each engine's first requests (warm-up), not measured
            await load(urls[name], 8, 8, args.max_tokens, 10_000)
        for rnd in range(args.rounds):
            order = ("vllm", "saoserve") if rnd % 2 == 0 else ("saoserve", "vllm")
            for streams in STREAMS:
                n = max(args.requests, 2 * streams)
                for name in order:
                    # The same requests (prompts and seeds) for both servers in a round.
                    runs.setdefault((name, streams), []).append(
                        await load(urls[name], n, streams, args.max_tokens, 1000 * rnd)
                    )
                    print(
                        f"round {rnd} streams {streams} {name}: {runs[(name, streams)][-1][1]} tokens",
                        flush=True,
                    )
    finally:
        for p in procs.values():
            stop(p)
        for f in logs.values():
            f.close()

    def tps(run) -> float:
        return run[1] / run[0]

    rows = []
    for streams in STREAMS:
        v, s = runs[("vllm", streams)], runs[("saoserve", streams)]
        ratios = [tps(b) / tps(a) for a, b in zip(v, s, strict=True)]
        rows.append(
            {
                "streams": streams,
                "vLLM tok/s": statistics.median(tps(r) for r in v),
                "saoserve tok/s": statistics.median(tps(r) for r in s),
                "ratio saoserve/vLLM (median)": statistics.median(ratios),
                "ratio min": min(ratios),
                "ratio max": max(ratios),
                "vLLM p50 s": statistics.median(x for r in v for x in r[2]),
                "saoserve p50 s": statistics.median(x for r in s for x in r[2]),
            }
        )
    print(
        f"\n{args.rounds} interleaved rounds, max_tokens {args.max_tokens}, float32, eager; "
        f"load average at the end {os.getloadavg()[0]:.1f}"
    )
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    record(
        "vs_vllm",
        "saoserve (trajectory logging on) against vLLM's own OpenAI server",
        rows,
        notes=(
            "Tokens/s of each server under the same requests (prompts, seeds, max_tokens "
            f"{args.max_tokens}, temperature 1), same model, dtype and engine settings, "
            f"{args.rounds} rounds interleaved, alternating which goes first; the ratio is "
            "saoserve's over vLLM's in each round (target: at least 1.0 within the spread of the "
            "rounds). Measured on a 2-core machine shared with other jobs (load average "
            f"{os.getloadavg()[0]:.1f} at the end): the ratios count, not "
            "the absolute figures."
        ),
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=8, help="requests a measurement (at least 2 per stream)")
    p.add_argument("--max-tokens", type=int, default=32)
    asyncio.run(main(p.parse_args()))
