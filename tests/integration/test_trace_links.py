"""A trace links a chat request, its feedback, the learner's step that trained it and the swap
that served the version (issue 42; core/telemetry.py), through the real code paths in one
process: the app under uvicorn with the SQL-table log (``ScriptedEngine`` answers instead of
vLLM, and records the swap), the real learner on a tiny random Llama joining the logged
trajectory and feedback, training and publishing version 1, and the server's policy watcher
swapping to it. Spans go to OpenTelemetry's in-memory exporter.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx
import pytest
import torch
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from core import telemetry
from learner.config import LearnerConfig
from learner.process import Learner
from server.engine import GenerationDelta
from testing.fakes import FakeEngine
from testing.servers import make_settings, running_server

TIMEOUT_S = 120.0


@dataclass
class ScriptedEngine(FakeEngine):
    """Every prompt renders as tokens 1, 2, 3 and every answer is the tokens 7, 8 (logprobs
    −0.5, −0.25), finished with ``stop``, at the served version; swaps are recorded
    (``FakeEngine``)."""

    tokenizer: tuple = tuple(range(100))

    def render(self, messages: list[dict]) -> list[int]:
        return [1, 2, 3]

    async def generate(self, prompt_ids, sampling, request_id=None, top_logprobs=0, **_):
        yield GenerationDelta([7], [-0.5], "hi", self.version)
        yield GenerationDelta([8], [-0.25], "!", self.version, "stop", [(self.version, 0, 2)])


def tiny_model(path):
    """A random 2-layer Llama (vocabulary 64) saved as policy version 0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture
def exporter():
    exp = InMemorySpanExporter()
    yield exp
    telemetry.shutdown()


async def test_a_trace_links_chat_feedback_step_and_swap(tmp_path, exporter):
    settings = make_settings(
        tmp_path,
        model_dir=tiny_model(tmp_path / "model"),
        policy_dir=tmp_path / "policies",
        policy_poll_s=0.05,
    )
    telemetry.configure(settings, exporter=exporter)
    engine = ScriptedEngine()
    async with running_server(settings, engine) as url:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as http:
            chat = (
                await http.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
                )
            ).json()
            rated = await http.post(
                "/v1/feedback",
                json={"id": chat["id"], "reward": 1.0, "feedback_token": chat["feedback_token"]},
            )
            assert rated.status_code == 202, rated.text

            def learn() -> dict | None:
                learner = Learner(settings, LearnerConfig(batch_size=1, poll_s=0.01))
                learner.load()
                learner.poll_once()
                return learner.train_step()

            assert await asyncio.to_thread(learn) is not None
            for _ in range(600):  # the watcher reads the policy topic every 0.05 s
                if engine.swaps:
                    break
                await asyncio.sleep(0.05)
    assert [v for v, _, _ in engine.swaps] == [1]
    spans = exporter.get_finished_spans()
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    trace = telemetry.trajectory_trace_id(chat["id"])
    version = telemetry.version_trace_id(1)

    (chat_span,) = by_name["chat"]
    (append,) = by_name["log.append"]
    (feedback,) = by_name["feedback"]
    (join,) = by_name["learner.join"]
    (step,) = by_name["learner.step"]
    (publish,) = by_name["learner.publish"]
    (swap,) = by_name["server.swap"]
    # The trajectory's trace: the chat (its log append under it), its feedback, its join.
    for s in (chat_span, append, feedback, join):
        assert s.context.trace_id == trace, s.name
    assert append.parent.span_id == chat_span.context.span_id
    assert chat_span.attributes["saoserve.trajectory_id"] == chat["id"]
    assert chat_span.attributes["saoserve.outcome"] == "ok"
    assert feedback.attributes["saoserve.reward"] == 1.0
    # The version's trace: the step that trained on it (linked to the trajectory), its publish,
    # and the swap that served version 1.
    for s in (step, publish, swap):
        assert s.context.trace_id == version, s.name
    assert [link.context.trace_id for link in step.links] == [trace]
    assert step.attributes["saoserve.parent_version"] == 0
    assert publish.parent.span_id == step.context.span_id
    assert swap.attributes["saoserve.result"] == "ok"
    # In time order: answered, rated, joined, trained, served.
    assert chat_span.end_time <= feedback.start_time <= join.start_time <= step.start_time
    assert step.end_time <= swap.start_time
