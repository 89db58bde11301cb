"""Replica swap delay: from a policy event to each replica serving its version (issue 14).

Starts ``--replicas`` ``saoserve serve`` processes (PostgreSQL, a tansu broker, small KV cache;
testing/replicas.py), then publishes ``--versions`` versions on the ``policy`` topic the way the
learner does (a ``PolicyEvent`` with the folder's sha256, key ``policy``), one every
``--interval-s`` seconds, while ``--load`` chats per replica stay in flight. The versions
alternate between two float32 weight sets (the base model and a perturbed copy, hard-linked
into one folder per version), so every swap loads weights that differ from the served ones.
No learner runs: its step would only add CPU contention of its own (tests/system/test_replicas.py
measures the same delays with a real learner).

Each replica's ``/metrics`` gives the time it started serving a version
(``saoserve_policy_swapped_at_seconds``); the event's time is its ``created_at``. Prints one
row per version (event→replica delays, the last replica's, the spread between first and last),
each replica's swap time for that version (sha256 check + pause/reload/resume, from the growth of
its ``saoserve_policy_swap_seconds`` sum), the medians and maxima, and the machine's load average.

Co-located replicas on one machine all bind vLLM's CPU worker to core 0 by default, so under
load they share that core and each one's swap (reload included) slows down. ``--bind-cores`` gives
replica i core i (``VLLM_CPU_OMP_THREADS_BIND``), closer to replicas on machines of their own.

    flock /tmp/saoserve-engine.lock .venv/bin/python bench/bench_replica_swap.py \\
        [--versions 8] [--interval-s 6] [--replicas 2] [--load 1] [--bind-cores] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.logbus import open_log  # noqa: E402
from core.records import POLICY_KEY, TOPIC_POLICY, PolicyEvent, utcnow  # noqa: E402
from core.weights import weights_sha256  # noqa: E402
from testing.dependencies import TansuBroker, fresh_pg_database  # noqa: E402
from testing.replicas import Deployment, metric, swap_delays, wait_serving  # noqa: E402

WEIGHTS_FILE = "model.safetensors"


def weight_sets(model_dir: Path, out: Path) -> list[tuple[Path, str]]:
    """Two float32 weight files as the learner writes them (tied LM head omitted): the base
    model's and a copy with noise (std 1e-3) on every tensor. Returns (file, sha256) pairs."""
    import torch
    from safetensors.torch import load_file, save_file

    base = {k: v.float() for k, v in load_file(model_dir / WEIGHTS_FILE).items()}
    base.pop("lm_head.weight", None)
    g = torch.Generator().manual_seed(0)
    noisy = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    sets = []
    for i, weights in enumerate((base, noisy)):
        folder = out / f"weights-{i}"
        folder.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in weights.items()}, folder / WEIGHTS_FILE)
        sets.append((folder / WEIGHTS_FILE, weights_sha256(folder)))
    return sets


def version_folder(policy_dir: Path, version: int, model_dir: Path, weights: Path) -> Path:
    """``v<version>/``: the model's config and tokenizer files, and ``weights`` hard-linked."""
    folder = policy_dir / f"v{version:06d}"
    folder.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, folder / f.name)
    os.link(weights, folder / WEIGHTS_FILE)
    return folder


class Load:
    """``per_replica`` chat loops per replica, each with one request in flight at a time."""

    def __init__(self, urls: list[str], per_replica: int, max_tokens: int):
        self.urls, self.per_replica, self.max_tokens = urls, per_replica, max_tokens
        self.stop = threading.Event()
        self.ok = 0
        self.failed: list[str] = []
        self.threads = [
            threading.Thread(target=self._loop, args=(url, i), daemon=True)
            for url in urls
            for i in range(per_replica)
        ]

    def _loop(self, url: str, i: int) -> None:
        n = 0
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                body = {
                    "model": "smollm2-135m-instruct",
                    "messages": [{"role": "user", "content": f"Loop {i}, request {n}: write one line."}],
                    "max_tokens": self.max_tokens,
                }
                n += 1
                try:
                    r = client.post(f"{url}/v1/chat/completions", json=body)
                except httpx.HTTPError as exc:
                    self.failed.append(repr(exc))
                    continue
                if r.status_code == 200:
                    self.ok += 1
                else:
                    self.failed.append(f"{r.status_code} {r.text[:200]}")

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(150)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", type=int, default=8)
    ap.add_argument("--interval-s", type=float, default=6.0, help="seconds between publications")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--load", type=int, default=1, help="chats in flight per replica during the run")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kv-cache-gib", type=float, default=0.25)
    ap.add_argument(
        "--bind-cores", action="store_true", help="bind replica i's vLLM worker to core i (mod the cores)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the run's folder (the processes' logs)")
    args = ap.parse_args()

    from saoserve.model import prepare_model

    root = Path(__file__).resolve().parent.parent
    model_dir = prepare_model(root / "var" / "model")
    home = Path(tempfile.mkdtemp(prefix="bench-replica-swap-"))
    broker = TansuBroker()
    broker.start()
    log = open_log(broker.url)
    try:
        with fresh_pg_database("benchswap") as pg:
            dep = Deployment(
                home=home,
                database_url=pg,
                log_url=broker.url,
                model_dir=model_dir,
                kv_cache_gib=args.kv_cache_gib,
            )
            try:
                run(args, dep, log, model_dir, home)
            except BaseException:
                print(dep.tails(), file=sys.stderr)
                raise
            finally:
                dep.stop()
    finally:
        log.close()
        broker.kill()
        if args.keep:
            shutil.rmtree(home / "policies", ignore_errors=True)
            print(f"logs kept in {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)


def run(args, dep: Deployment, log, model_dir: Path, home: Path) -> None:
    # vLLM's CPU worker binds its OpenMP threads to core 0 of each engine by default ("auto"
    # reserves the other for the front end), so co-located replicas share one core.
    ncpu = os.cpu_count() or 1
    replicas = [
        dep.serve(
            f"replica-{chr(ord('a') + i)}",
            {"VLLM_CPU_OMP_THREADS_BIND": str(i % ncpu)} if args.bind_cores else None,
        )
        for i in range(args.replicas)
    ]
    sets = weight_sets(model_dir, home)
    startup = dep.wait_ready(replicas)
    print(f"{len(replicas)} replicas ready in " + ", ".join(f"{s:.0f} s" for s in startup.values()))
    names = [r.name for r in replicas]
    swap_total = dict.fromkeys(names, 0.0)
    rows = []
    load_avg = [os.getloadavg()[0]]
    with Load([r.url for r in replicas], args.load, args.max_tokens) as load, httpx.Client() as client:
        for v in range(1, args.versions + 1):
            t0 = time.monotonic()
            weights, sha = sets[v % 2]
            folder = version_folder(home / "policies", v, model_dir, weights)
            event = PolicyEvent(
                version=v, path=str(folder.resolve()), sha256=sha, created_at=utcnow(), parent_version=v - 1
            )
            log.append(TOPIC_POLICY, POLICY_KEY, event.to_json())
            swapped = wait_serving(replicas, v, timeout_s=120, poll_s=0.1)
            # Each replica swapped exactly once since the last version: the growth of its swap
            # histogram's sum is this swap's duration (sha256 check + pause/reload/resume).
            swap_s = {}
            for r in replicas:
                total = metric(client.get(f"{r.url}/metrics").text, "saoserve_policy_swap_seconds_sum")
                swap_s[r.name], swap_total[r.name] = total - swap_total[r.name], total
            rows.append((v, swap_delays(event.created_at.timestamp(), swapped), swap_s))
            time.sleep(max(0.0, args.interval_s - (time.monotonic() - t0)))
    load_avg.append(os.getloadavg()[0])

    short = [n.removeprefix("replica-") for n in names]
    head = f"{'version':>8}" + "".join(f"{'event→' + n + ' s':>11}{'swap ' + n + ' s':>10}" for n in short)
    print(head + f"{'event→last s':>14}{'spread s':>10}")
    for v, d, sw in rows:
        cells = "".join(f"{d[n]:>11.2f}{sw[n]:>10.2f}" for n in names)
        print(f"{v:>8}{cells}{d['last']:>14.2f}{d['spread']:>10.2f}")
    lasts = [d["last"] for _, d, _ in rows]
    spreads = [d["spread"] for _, d, _ in rows]
    swaps = [sw[n] for _, _, sw in rows for n in names]
    detect = [d[n] - sw[n] for _, d, sw in rows for n in names]
    print(
        f"event→last replica: median {statistics.median(lasts):.2f} s, max {max(lasts):.2f} s; "
        f"spread: median {statistics.median(spreads):.2f} s, max {max(spreads):.2f} s"
    )
    print(
        f"of which the swap (sha256 check + pause/reload/resume): median {statistics.median(swaps):.2f} s, "
        f"max {max(swaps):.2f} s; event→swap start (append, 1 s poll): median {statistics.median(detect):.2f} s, "
        f"max {max(detect):.2f} s"
    )
    print(
        f"load: {load.ok} chats answered during the run ({args.load} in flight per replica, "
        f"{args.max_tokens} tokens), {len(load.failed)} failed"
        + (f": {load.failed[:3]}" if load.failed else "")
        + f"; machine load average (1 min) {load_avg[0]:.1f} at the first version, {load_avg[1]:.1f} at the end"
    )


if __name__ == "__main__":
    main()
