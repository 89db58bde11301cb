"""Serving in float32 and bf16: throughput, and the served-vs-learner logprob gap per token (issue 21).

Usage: ``python bench/bench_serving_precision.py [MODEL_DIR] [--dtypes float32,bfloat16]
[--answers 32] [--max-tokens 48] [--streams 8] [--kv-cache-gib 0.5] [--learner-batch 16]``.
MODEL_DIR defaults to ``var/model`` (prepared by ``saoserve prepare-model`` if missing).

Serving: for each dtype of ``--dtypes``, one vLLM engine (``server.engine.core.PolicyEngine.start``
with ``Settings(dtype=…)``, eager, a ``--kv-cache-gib`` KV cache) answers 8 short warm-up
requests, then the same ``--answers`` requests at each concurrency of ``--streams``: the
simulation's writing requests (``judge.styles.writing_requests``, the first ``--answers``),
rendered by the chat template, temperature 1, seed ``i`` for request ``i``, ``--max-tokens``
each. Only one engine runs at a time: each is shut down before the next starts, so the dtypes run
one after the other, not interleaved (the load average is printed for each). Per dtype and
concurrency the table gives the tokens/s over the run's wall time, p50/p95 of the request
latency, and the tokens/s ratio to float32's at the same concurrency.

The gap: the answers of the first ``--streams`` value, with the engine's logged (processed)
logprobs, are made into learner samples (``learner.data.samples.collate``, rows of
``--learner-batch``) and recomputed by the learner itself, ``SAOLearner.logprobs`` on its policy
(the function its DIS step calls, shared-prefix pass included), built from the ``cpu`` preset in
float32 and with ``bf16`` on (bf16 weights, grouped attention: ``learner.models.precision``; compiled
layers off, as in the ``demo`` preset). The weights are the same everywhere (the prepared model's
bf16 tensors; a float32 engine or learner upcasts them), so the whole gap is precision. Per pair
(served dtype × learner precision), over the answers' tokens: max, p99 and mean of
``|Δ| = |learner − served|`` (nats), the mean signed Δ, and the fraction of tokens each
correction masks from precision alone: DIS (``learner.algo.dis.dis_loss`` with the default
``eps_low``/``eps_high`` of ``learner.config``), and MIS with exact old logits
(``learner.algo.offpolicy.mis_token_mask`` with the default ``c``; at the same weights π_old is the
learner's own logprob, so only ``r_d = π_old/μ`` can mask).

No timing is asserted anywhere; its runs go to a dated log (docs/log/2026-12-06-precision-runs.md)
with the machine they came from.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from core.records import SamplingRecord
from core.settings import Settings
from judge.styles import writing_requests
from learner.algo.dis import dis_loss
from learner.algo.offpolicy import mis_token_mask
from learner.algo.sao import SAOLearner
from learner.config import MISSnapshotCorrection, build_config
from learner.data.samples import Sample, collate

DTYPES = ("float32", "bfloat16")
LEARNERS = ("float32", "bf16")
TEMPERATURE = 1.0


@dataclass
class Answer:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    seconds: float


@dataclass
class Run:
    dtype: str
    streams: int
    wall: float
    answers: list[Answer]
    load: tuple[float, float]

    @property
    def tokens(self) -> int:
        return sum(len(a.token_ids) for a in self.answers)


async def serve(
    engine, prompts: list[list[int]], streams: int, max_tokens: int
) -> tuple[float, list[Answer]]:
    """Answer every prompt (seed = its index) with at most ``streams`` in flight; wall seconds."""
    sem = asyncio.Semaphore(streams)

    async def one(i: int, prompt: list[int]) -> Answer:
        async with sem:
            sampling = SamplingRecord(temperature=TEMPERATURE, max_tokens=max_tokens, seed=i)
            ids: list[int] = []
            lps: list[float] = []
            t0 = time.perf_counter()
            async for d in engine.generate(prompt, sampling):
                ids += d.token_ids
                lps += d.logprobs
            return Answer(prompt, ids, lps, time.perf_counter() - t0)

    t0 = time.perf_counter()
    answers = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return time.perf_counter() - t0, list(answers)


async def serving_runs(args: argparse.Namespace, model: Path, home: Path) -> dict[str, list[Run]]:
    from server.engine import PolicyEngine

    runs: dict[str, list[Run]] = {}
    for dtype in args.dtypes:
        settings = Settings(
            home=home / dtype,
            model_dir=model,
            enforce_eager=True,
            kv_cache_gib=args.kv_cache_gib,
            dtype=dtype,
        )
        engine = await PolicyEngine.start(settings, model)
        try:
            prompts = [engine.render([{"role": "user", "content": r}]) for r in args.requests]
            await serve(engine, prompts[:8], 8, 8)
            runs[dtype] = []
            for streams in args.streams:
                before = os.getloadavg()[0]
                wall, answers = await serve(engine, prompts, streams, args.max_tokens)
                runs[dtype].append(Run(dtype, streams, wall, answers, (before, os.getloadavg()[0])))
                print(f"served {dtype} at {streams} streams in {wall:.1f} s", file=sys.stderr)
        finally:
            engine.shutdown()
        gc.collect()
    return runs


def samples(answers: list[Answer]) -> list[Sample]:
    """The answers as the learner's samples: one action span per answer, version 0."""
    out = []
    for i, a in enumerate(answers):
        n = len(a.prompt_ids)
        out.append(
            Sample(
                id=str(i),
                prompt_id=str(i),
                input_ids=a.prompt_ids + a.token_ids,
                actions=[(n, n + len(a.token_ids))],
                rollout_logprobs=a.logprobs,
                token_versions=[0] * len(a.token_ids),
                temperature=TEMPERATURE,
                reward=0.0,
                baseline_value=None,
                result_version=0,
            )
        )
    return out


def learner_logprobs(model: Path, bf16: bool, batches: dict[str, list]) -> dict[str, list[torch.Tensor]]:
    """``SAOLearner.logprobs`` of every batch's tokens (``[B, T]`` float32 each) under a learner
    of the ``cpu`` preset, float32 or with ``bf16``."""
    from transformers import AutoModelForCausalLM

    config = build_config("cpu", overrides={"bf16": bf16})
    learner = SAOLearner.build(
        config, lambda: AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    )
    out = {}
    with torch.no_grad():
        for dtype, bs in batches.items():
            out[dtype] = [learner.logprobs(learner.policy, b, b.action_mask.bool()) for b in bs]
    del learner
    gc.collect()
    return out


def gap_row(batches: list, learned: list[torch.Tensor]) -> dict[str, float]:
    """The gap statistics of one precision pair over all action tokens of ``batches``."""
    defaults, mis = build_config("cpu").algorithm, MISSnapshotCorrection()
    deltas, dis_masked, mis_masked, n = [], 0, 0, 0
    for b, lp in zip(batches, learned, strict=True):
        mask = b.action_mask.bool()
        zeros = torch.zeros_like(lp)
        deltas.append((lp - b.rollout_logprobs)[mask].double())
        _, stats = dis_loss(lp, b.rollout_logprobs, zeros, mask, defaults.eps_low, defaults.eps_high)
        tokens = stats["action_tokens"]
        dis_masked += round((1.0 - stats["kept_fraction"]) * tokens)
        kept = mis_token_mask(
            lp,
            lp,
            b.rollout_logprobs,
            zeros,
            eps_low=mis.clip_low,
            eps_high=mis.clip_high,
            c=mis.c,
            action_mask=mask,
        )
        mis_masked += tokens - int(kept.sum())
        n += tokens
    d = torch.cat(deltas)
    a = d.abs()
    return {
        "tokens": n,
        "max": a.max().item(),
        "p99": torch.quantile(a, 0.99).item(),
        "mean_abs": a.mean().item(),
        "mean": d.mean().item(),
        "dis": dis_masked / n,
        "mis": mis_masked / n,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", nargs="?", default="var/model")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help=f"serving dtypes, of {', '.join(DTYPES)}")
    ap.add_argument("--answers", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--streams", default="8", help="comma-separated concurrencies; the gap uses the first")
    ap.add_argument("--kv-cache-gib", type=float, default=0.5)
    ap.add_argument("--learner-batch", type=int, default=16, help="rows per learner forward")
    args = ap.parse_args()
    args.dtypes = args.dtypes.split(",")
    for d in args.dtypes:
        if d not in DTYPES:
            ap.error(f"unknown dtype {d!r}: choose from {', '.join(DTYPES)}")
    try:
        args.streams = [int(s) for s in args.streams.split(",")]
    except ValueError:
        ap.error(f"--streams must be comma-separated integers, got {args.streams!r}")
    pool = writing_requests()
    if not 1 <= args.answers <= len(pool):
        ap.error(f"--answers must be in [1, {len(pool)}] (the writing requests)")
    if min(args.streams) < 1 or args.max_tokens < 1 or args.learner_batch < 1:
        ap.error("need --streams >= 1, --max-tokens >= 1 and --learner-batch >= 1")
    args.requests = pool[: args.answers]

    from saoserve.model import prepare_model

    model = prepare_model(Path(args.model_dir))
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-serving-precision-") as home:
        runs = asyncio.run(serving_runs(args, model, Path(home)))
    gap_answers = {d: rs[0].answers for d, rs in runs.items()}
    batches = {
        d: [
            collate(samples(ans[i : i + args.learner_batch]), 0)
            for i in range(0, len(ans), args.learner_batch)
        ]
        for d, ans in gap_answers.items()
    }
    load_learner = os.getloadavg()[0]
    learned = {lp: learner_logprobs(model, lp == "bf16", batches) for lp in LEARNERS}

    print(
        f"\nmodel={args.model_dir} answers={args.answers} max_tokens={args.max_tokens} temperature "
        f"{TEMPERATURE} seeds 0..{args.answers - 1}, eager engine, kv cache {args.kv_cache_gib} GiB, "
        f"torch threads {torch.get_num_threads()}; total {time.perf_counter() - t_start:.0f} s"
    )
    print(
        f"{'serving':<10}{'streams':>8}{'tokens':>8}{'tok/s':>8}{'p50 s':>8}{'p95 s':>8}{'÷ fp32':>8}  load"
    )
    base = {r.streams: r.tokens / r.wall for r in runs.get("float32", [])}
    for rs in runs.values():
        for r in rs:
            lat = sorted(a.seconds for a in r.answers)
            p95 = lat[min(len(lat) - 1, int(0.95 * len(lat)))]
            tps = r.tokens / r.wall
            ratio = f"{tps / base[r.streams]:>8.2f}" if r.streams in base else f"{'-':>8}"
            print(
                f"{r.dtype:<10}{r.streams:>8}{r.tokens:>8}{tps:>8.1f}{statistics.median(lat):>8.2f}"
                f"{p95:>8.2f}{ratio}  {r.load[0]:.2f}→{r.load[1]:.2f}"
            )
    if "float32" in gap_answers and "bfloat16" in gap_answers:
        same = sum(
            a.token_ids == b.token_ids
            for a, b in zip(gap_answers["float32"], gap_answers["bfloat16"], strict=True)
        )
        print(f"bfloat16 answers token-identical to float32's (same seeds): {same}/{args.answers}")
    defaults = build_config("cpu").algorithm
    print(
        f"\nserved − learner gap per token, nats (answers of {args.streams[0]} streams; learner load "
        f"{load_learner:.2f}); DIS masks ratio ∉ ({1 - defaults.eps_low:g}, {1 + defaults.eps_high:g}), "
        f"MIS (exact old logits) masks r_d ∉ [1/{MISSnapshotCorrection().c:g}, {MISSnapshotCorrection().c:g}]"
    )
    print(
        f"{'served':<10}{'learner':<9}{'tokens':>7}{'max':>9}{'p99':>9}{'mean |Δ|':>10}{'mean Δ':>10}"
        f"{'DIS mask':>10}{'MIS mask':>10}"
    )
    for dtype, bs in batches.items():
        for lp in LEARNERS:
            g = gap_row(bs, learned[lp][dtype])
            print(
                f"{dtype:<10}{lp:<9}{g['tokens']:>7}{g['max']:>9.3g}{g['p99']:>9.3g}{g['mean_abs']:>10.3g}"
                f"{g['mean']:>10.2g}{g['dis']:>10.4f}{g['mis']:>10.4f}"
            )
    print("command: .venv/bin/python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
