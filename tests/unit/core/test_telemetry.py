"""core.telemetry: trace ids derived from the trajectory id and the version, the learner's spans
and their links, and nothing made while tracing is off (in-memory exporter)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from core import telemetry
from core.settings import Settings


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    assert telemetry.configure(Settings(), exporter=exporter)
    yield exporter
    telemetry.shutdown()


def test_trace_ids_are_the_hash_of_the_id():
    # sha256(b"trajectory:chatcmpl-1")[:16] and sha256(b"version:global:3")[:16], computed by hand
    # with hashlib.
    assert telemetry.trajectory_trace_id("chatcmpl-1") == 0x104BBE8A9E73E2E2BDFE2170A4FE8502
    assert telemetry.version_trace_id(3) == 0xE6E62245485B063CE9C44B5C9D9A9FFB
    assert telemetry.version_trace_id(3, "acme") != telemetry.version_trace_id(3)


def test_off_makes_nothing():
    telemetry.shutdown()
    assert not telemetry.configure(Settings(otlp_endpoint=""))
    assert not telemetry.enabled()
    assert telemetry.start_trajectory_span("chat", "chatcmpl-1") is None
    with telemetry.trajectory_span("feedback", "chatcmpl-1"), telemetry.version_span("server.swap", 1):
        telemetry.note(result="ok")
    with telemetry.child_span(None, "log.append"), telemetry.span_for_stage("x"):
        pass
    telemetry.trained(1, 0, [("chatcmpl-1", datetime.now(UTC))], 0, 0)


def test_an_endpoint_turns_it_on():
    try:
        assert telemetry.configure(Settings(otlp_endpoint="http://127.0.0.1:4318"), "learner")
        assert telemetry.enabled()
    finally:
        telemetry.shutdown()
    assert not telemetry.enabled()


def test_the_chat_span_and_its_log_append(spans):
    chat = telemetry.start_trajectory_span("chat", "chatcmpl-1", version=2, tenant=None)
    with telemetry.child_span(chat, "log.append", tokens=2):
        pass
    chat.end()
    append, chat_span = spans.get_finished_spans()
    assert chat_span.context.trace_id == telemetry.trajectory_trace_id("chatcmpl-1")
    assert dict(chat_span.attributes) == {"saoserve.trajectory_id": "chatcmpl-1", "saoserve.version": 2}
    assert append.parent.span_id == chat_span.context.span_id
    assert append.context.trace_id == chat_span.context.trace_id


def test_the_learners_spans_link_the_batch(spans):
    joined = [
        ("chatcmpl-1", datetime(2026, 1, 1, 0, 0, 1, tzinfo=UTC)),
        ("e:ep-7", datetime(2026, 1, 1, 0, 0, 2, tzinfo=UTC)),
    ]
    telemetry.trained(5, 4, joined, 1_767_225_603_000_000_000, 1_767_225_604_000_000_000, policy="acme")
    join1, join2, publish, step = spans.get_finished_spans()
    # 2026-01-01T00:00:01Z = 1,767,225,601 s since the epoch: the join is an instant then.
    assert join1.start_time == join1.end_time == 1_767_225_601_000_000_000
    assert join1.context.trace_id == telemetry.trajectory_trace_id("chatcmpl-1")
    assert join2.context.trace_id == telemetry.trajectory_trace_id("e:ep-7")
    assert step.context.trace_id == telemetry.version_trace_id(5, "acme")
    assert [link.context.trace_id for link in step.links] == [
        telemetry.trajectory_trace_id("chatcmpl-1"),
        telemetry.trajectory_trace_id("e:ep-7"),
    ]
    assert step.attributes["saoserve.parent_version"] == 4 and step.attributes["saoserve.samples"] == 2
    assert step.start_time == 1_767_225_603_000_000_000
    assert publish.parent.span_id == step.context.span_id
    assert publish.start_time == 1_767_225_604_000_000_000 and publish.end_time <= step.end_time


def test_a_swap_is_in_the_versions_trace(spans):
    with telemetry.version_span("server.swap", 5, "acme"):
        telemetry.note(result="refused", seconds=None)
    (swap,) = spans.get_finished_spans()
    assert swap.context.trace_id == telemetry.version_trace_id(5, "acme")
    assert dict(swap.attributes) == {
        "saoserve.version": 5,
        "saoserve.policy": "acme",
        "saoserve.result": "refused",
    }
