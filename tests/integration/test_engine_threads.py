"""A CPU engine with its worker in-process (``Settings.engine_threads``, server/cpu_worker.py),
on the real vLLM: no worker process, the server's environment as it was, and the same served
logprobs and swaps as vLLM's own layout (tests/integration/test_engine_hotswap.py), in float32 and in bf16 (the
demo's engine: in-process and bf16 where the CPU has bf16 units, saoserve/demo.py)."""

from __future__ import annotations

import os

import psutil
import pytest

from core.records import SamplingRecord
from core.weights import weights_sha256
from server.cpu_worker import IN_PROCESS_WORKER, THREADS
from testing.hotswap import LOGPROB_BOUND, learner_logprobs, perturb_model

pytestmark = pytest.mark.engine

PROMPT = [{"role": "user", "content": "Write two lines about the sea."}]
# A bf16 engine's mean |served − learner| gap on the swapped-in weights against its gap to the
# weights it replaced: measured 0.035 against 0.46 nats (13×) on this test's 24 tokens.
MEAN_GAP_RATIO = 5.0


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
async def threaded_engine(model_dir, tmp_path_factory, request):
    from core.settings import Settings
    from server.engine import PolicyEngine

    before = {k: os.environ.get(k) for k in (IN_PROCESS_WORKER, THREADS)}
    # The session's other engines (vLLM's own layout) are children of this process too.
    others = {p.pid for p in psutil.Process().children(recursive=True)}
    settings = Settings(
        home=tmp_path_factory.mktemp("threads"),
        model_dir=model_dir,
        kv_cache_gib=1.0,
        engine_threads=1,
        dtype=request.param,
    )
    engine = await PolicyEngine.start(settings, model_dir)
    started = [p for p in psutil.Process().children(recursive=True) if p.pid not in others]
    yield engine, before, started
    engine.shutdown()


async def answer(engine, seed: int) -> tuple[list[int], list[int], list[float], list]:
    prompt = engine.render(PROMPT)
    ids, lps, spans = [], [], None
    async for d in engine.generate(
        prompt, SamplingRecord(temperature=1.0, max_tokens=24, seed=seed), ignore_eos=True
    ):
        ids += d.token_ids
        lps += d.logprobs
        spans = d.weight_versions or spans
    return prompt, ids, lps, spans


def gaps(model_dir, prompt, ids, lps, precision) -> list[float]:
    """|served − learner| per answer token (nats), the learner in ``precision``."""
    ref = learner_logprobs(model_dir, prompt, ids, 1.0, precision)
    return [abs(a - b) for a, b in zip(ref, lps, strict=True)]


async def test_the_worker_runs_in_the_engine_process_and_the_environment_is_restored(threaded_engine):
    engine, before, started = threaded_engine
    assert {k: os.environ.get(k) for k in before} == before
    titles = [" ".join(p.cmdline()) for p in started]
    assert any("VLLM::EngineCore" in t for t in titles), titles
    assert not any("VLLM::Worker" in t for t in titles), titles


async def test_it_serves_the_learners_logprobs_before_and_after_a_swap(threaded_engine, model_dir, tmp_path):
    engine, _, _ = threaded_engine
    served = engine.settings.dtype
    prompt, ids, lps, spans = await answer(engine, seed=3)
    assert spans == [(0, 0, 24)]
    for precision in ("float32", "bf16"):
        assert max(gaps(model_dir, prompt, ids, lps, precision)) < LOGPROB_BOUND[(served, precision)]

    v1 = perturb_model(model_dir, tmp_path / "v1")
    await engine.swap(1, v1, weights_sha256(v1))
    prompt, ids, lps, spans = await answer(engine, seed=3)
    assert spans == [(1, 0, 24)]
    for precision in ("float32", "bf16"):
        assert max(gaps(v1, prompt, ids, lps, precision)) < LOGPROB_BOUND[(served, precision)]
    # The new weights are what serves: the base model's logprobs of these tokens are further off
    # than the precision gap (float32: 1e-2 against 1e-3; bf16: the mean gap, MEAN_GAP_RATIO×).
    new, old = gaps(v1, prompt, ids, lps, "float32"), gaps(model_dir, prompt, ids, lps, "float32")
    if served == "float32":
        assert max(old) > 1e-2
    else:
        assert sum(old) > MEAN_GAP_RATIO * sum(new), (sum(old) / len(old), sum(new) / len(new))
