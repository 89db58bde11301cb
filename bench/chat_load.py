"""Constant chat load on a running server: N requests in flight, until interrupted.

Usage: ``python bench/chat_load.py URL [--streams 8] [--max-tokens 48] [--every-s 30]``. Each of
the N streams posts one ``/v1/chat/completions`` (temperature 1, a writing request, at most
``--max-tokens`` tokens) after another; every ``--every-s`` seconds the script prints the answer
tokens per second of that interval and the refused requests. It is the load beside which
docs/precision.md ("Sharing the cores") times the learner step (``bench_learner_precision.py``)
on each engine layout.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx


async def stream(
    http: httpx.AsyncClient, model: str, max_tokens: int, i: int, counts: dict[str, int]
) -> None:
    k = 0
    while True:
        k += 1
        body = {
            "model": model,
            "messages": [
                {"role": "user", "content": f"Write a short story about lighthouse number {i}-{k}."}
            ],
            "max_tokens": max_tokens,
            "temperature": 1.0,
        }
        r = await http.post("/v1/chat/completions", json=body)
        if r.status_code == 200:
            counts["tokens"] += r.json()["usage"]["completion_tokens"]
        else:
            counts["refused"] += 1
            await asyncio.sleep(1.0)


async def main(url: str, streams: int, max_tokens: int, every_s: float) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        counts = {"tokens": 0, "refused": 0}
        tasks = [asyncio.create_task(stream(http, model, max_tokens, i, counts)) for i in range(streams)]
        t0, last = time.monotonic(), dict(counts)
        try:
            while True:
                await asyncio.sleep(every_s)
                rate = (counts["tokens"] - last["tokens"]) / every_s
                refused = counts["refused"] - last["refused"]
                print(f"{time.monotonic() - t0:7.0f} s  {rate:6.1f} tokens/s  {refused} refused", flush=True)
                last = dict(counts)
        finally:
            for t in tasks:
                t.cancel()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--every-s", type=float, default=30.0)
    args = ap.parse_args()
    try:
        asyncio.run(main(args.url, args.streams, args.max_tokens, args.every_s))
    except KeyboardInterrupt:
        pass
