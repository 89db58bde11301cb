"""Policy versions as LoRA adapters: swap time and serving cost, adapter vs merged vs full weights
(issue 20; docs/serving_adapters.md).

Engines, one at a time (each start is ~30 s on 2 cores):
  plain : vLLM without LoRA (``AdapterServing.MERGED``): full-weight swaps, merged adapter swaps,
          and the base model's serving speed;
  lora  : vLLM with LoRA (``AdapterServing.ADAPTER``, ``--max-loras`` slots per batch, rank ≤ 16):
          ``add_lora`` swaps, and serving the base, one adapter, and ``--max-loras`` adapters mixed;
  lean  : (``--lean``) LoRA with one slot and rank ≤ 8, serving an adapter on all seven
          projections and one on q/v only: the settings that bring the adapter path nearest 1.0.

Swap: ``--swaps`` swaps of each kind while 2 requests decode; per kind the median swap time
(copy/check/hash/merge + load), the pause (generation frozen), and event→first token (from the
swap's start to the first token of a request sent when it returns). Serving: 1, 8 and 16 streams
of ``--tokens`` tokens each (EOS ignored), temperature 1, at the engine (no HTTP, no log): tokens/s,
p50/p95 request latency, and tokens/s over the plain engine's base at the same streams.

    flock /tmp/saoserve-heavy.lock .venv/bin/python bench/bench_adapter_serving.py \\
        [--tokens 32] [--swaps 3] [--max-loras 4] [--lean]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_replica_swap import version_folder, weight_sets  # noqa: E402
from core.policy_store import version_dir  # noqa: E402
from core.settings import AdapterServing, Settings  # noqa: E402
from core.weights import weights_sha256  # noqa: E402
from server.engine import PolicyEngine  # noqa: E402
from testing.adapters import ALL_MODULES, PROMPT, write_adapters  # noqa: E402

STREAMS = (1, 8, 16)


async def one(
    engine: PolicyEngine, seed: int, tokens: int, version: int | None = None
) -> tuple[float, float]:
    """One request: (seconds to its first token, seconds to its end)."""
    from core.records import SamplingRecord

    sampling = SamplingRecord(temperature=1.0, max_tokens=tokens, seed=seed)
    t0 = time.perf_counter()
    first = None
    async for _ in engine.generate(engine.render(PROMPT), sampling, version=version, ignore_eos=True):
        first = first or time.perf_counter() - t0
    return first, time.perf_counter() - t0


async def serving(engine: PolicyEngine, streams: int, tokens: int, versions: list[int | None]) -> dict:
    """``streams`` concurrent requests, request i on ``versions[i % len]`` (None: the current)."""
    t0 = time.perf_counter()
    runs = await asyncio.gather(
        *(one(engine, 100 + i, tokens, versions[i % len(versions)]) for i in range(streams))
    )
    wall = time.perf_counter() - t0
    lat = sorted(end for _, end in runs)
    p95 = lat[min(len(lat) - 1, round(0.95 * (len(lat) - 1)))]
    return {"tps": streams * tokens / wall, "p50": statistics.median(lat), "p95": p95}


async def swaps(engine: PolicyEngine, folders: list[tuple[Path, str]], first_version: int) -> dict:
    """Swap to each folder in turn with 2 requests decoding; medians of the swap's seconds, its
    pause, and event→first token."""
    rows = []
    for i, (path, sha) in enumerate(folders):
        load = [asyncio.create_task(one(engine, 7 + j, 48)) for j in range(2)]
        await asyncio.sleep(0.5)
        t0 = time.perf_counter()
        res = await engine.swap(first_version + i, path, sha)
        swapped = time.perf_counter() - t0
        ttft, _ = await one(engine, 1, 1)
        rows.append((res.seconds, res.paused_seconds, swapped + ttft))
        await asyncio.gather(*load)
        await engine.removals_done()
    return {
        k: statistics.median(r[j] for r in rows) for j, k in enumerate(("seconds", "paused", "first_token"))
    }


async def start(model_dir: Path, home: Path, mode: AdapterServing, **lora) -> PolicyEngine:
    settings = Settings(home=home, model_dir=model_dir, kv_cache_gib=1.0, adapter_serving=mode, **lora)
    engine = await PolicyEngine.start(settings, model_dir)
    await serving(engine, 4, 8, [None])  # warm-up
    return engine


def publish(policy_dir: Path, version: int, adapter: Path) -> tuple[Path, str]:
    """``adapter`` as the version folder ``version`` (its files hard-linked)."""
    folder = version_dir(policy_dir, version)
    folder.mkdir(parents=True)
    for f in adapter.iterdir():
        (folder / f.name).hardlink_to(f)
    return folder, weights_sha256(folder)


async def main(args: argparse.Namespace) -> None:
    from saoserve.model import prepare_model

    model_dir = prepare_model(Path("var/model"))
    tmp = Path(tempfile.mkdtemp(prefix="bench-adapters-"))
    try:
        await measure(args, model_dir, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def measure(args: argparse.Namespace, model_dir: Path, tmp: Path) -> None:
    policies = tmp / "policies"
    n = max(args.swaps, args.max_loras)
    ads = [tmp / f"a{i}" for i in range(n)]
    write_adapters(model_dir, ads, rank=8, seed=1)
    adapter_versions = [publish(policies, 1 + i, a) for i, a in enumerate(ads)]
    full = [
        (version_folder(policies, 100 + i, model_dir, w), s)
        for i, (w, s) in enumerate(weight_sets(model_dir, tmp))
    ]
    swap_rows: dict[str, dict] = {}
    serve_rows: dict[str, dict[int, dict]] = {}

    engine = await start(model_dir, tmp / "plain", AdapterServing.MERGED)
    serve_rows["base, no-LoRA engine"] = {s: await serving(engine, s, args.tokens, [None]) for s in STREAMS}
    swap_rows["full weights"] = await swaps(engine, (full * args.swaps)[: args.swaps], 100)
    swap_rows["merged adapter"] = await swaps(engine, adapter_versions[: args.swaps], 200)
    serve_rows["merged adapter"] = {s: await serving(engine, s, args.tokens, [None]) for s in STREAMS}
    engine.shutdown()

    lora = dict(max_loras=args.max_loras, max_lora_rank=16, max_cpu_loras=max(8, args.max_loras + 2))
    engine = await start(model_dir, tmp / "lora", AdapterServing.ADAPTER, **lora)
    serve_rows["base, LoRA engine"] = {s: await serving(engine, s, args.tokens, [None]) for s in STREAMS}
    swap_rows["adapter (add_lora)"] = await swaps(engine, adapter_versions[: args.swaps], 1)
    mixed = list(range(300, 300 + args.max_loras))
    for v, (path, sha) in zip(mixed, adapter_versions, strict=False):
        await engine.swap(v, path, sha)
        engine.pin(v)
    serve_rows["one adapter"] = {s: await serving(engine, s, args.tokens, [mixed[-1]]) for s in STREAMS}
    serve_rows[f"{args.max_loras} adapters mixed"] = {
        s: await serving(engine, s, args.tokens, mixed) for s in STREAMS
    }
    engine.shutdown()

    if args.lean:
        qv = tmp / "qv"
        write_adapters(model_dir, [qv], rank=8, modules=("q_proj", "v_proj"), seed=2)
        engine = await start(
            model_dir, tmp / "lean", AdapterServing.ADAPTER, max_loras=1, max_lora_rank=8, max_cpu_loras=2
        )
        await engine.swap(400, *adapter_versions[0])
        serve_rows["one adapter, 1 slot, rank ≤ 8"] = {
            s: await serving(engine, s, args.tokens, [None]) for s in STREAMS
        }
        await engine.swap(401, *publish(policies, 401, qv))
        serve_rows["q/v adapter, 1 slot, rank ≤ 8"] = {
            s: await serving(engine, s, args.tokens, [None]) for s in STREAMS
        }
        engine.shutdown()

    print(
        f"\nswap (median of {args.swaps}, 2 requests decoding; adapters rank 8 on {len(ALL_MODULES)} projections)"
    )
    print(f"{'kind':<22}{'swap s':>9}{'pause s':>9}{'event→1st token s':>19}")
    for kind, r in swap_rows.items():
        print(f"{kind:<22}{r['seconds']:>9.3f}{r['paused']:>9.3f}{r['first_token']:>19.3f}")
    base = serve_rows["base, no-LoRA engine"]
    print(f"\nserving ({args.tokens} tokens a stream; ratio: tokens/s over the no-LoRA engine's base)")
    print(
        f"{'config':<32}" + "".join(f"{f'{s} st tok/s':>13}{'p50':>7}{'p95':>7}{'ratio':>7}" for s in STREAMS)
    )
    for config, by in serve_rows.items():
        cells = "".join(
            f"{by[s]['tps']:>13.1f}{by[s]['p50']:>7.2f}{by[s]['p95']:>7.2f}{by[s]['tps'] / base[s]['tps']:>7.2f}"
            for s in STREAMS
        )
        print(f"{config:<32}{cells}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--swaps", type=int, default=3)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--lean", action="store_true")
    asyncio.run(main(p.parse_args()))
