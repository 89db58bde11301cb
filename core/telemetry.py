"""OpenTelemetry spans of the serving-learning loop (issue 42; docs/deploy.md, "Logs and traces"):
a chat request, its log append and its feedback; the learner's join, step and publish; a
server's swap. Exported by OTLP/HTTP when ``Settings.otlp_endpoint`` is set; off otherwise.

The stages run in different processes, days apart, and share no request context: what they
share is the trajectory id (it travels in every record) and the policy version (in every policy
event). So the trace ids are derived from them:

- a **trajectory's trace** (``trajectory_context``): its trace id is the first 128 bits of
  sha256(``trajectory:<id>``), under a root span context of the next 64 bits that no process
  records. The server's ``chat`` span (and its child ``log.append``), the server's ``feedback``
  span for it and the learner's ``learner.join`` span of its sample all belong to it.
- a **version's trace** (``version_context``), the same from ``version:<policy>:<n>``: the
  learner's ``learner.step`` that produced version n (with its child ``learner.publish``) and
  every replica's ``server.swap`` to it.

The step span links to the trajectory traces of its batch, and carries ``saoserve.parent_version``
(the version that sampled them, whose trace holds that version's swaps). A trace viewer thus
goes from a chat to its feedback (same trace), to the step that trained it (a link) and to the
swaps that served the version (same trace as the step).

Off (no endpoint, no exporter given to ``configure``), every function returns at its first line
(``_tracer is None``): no span, id or hash is made. The learner's and the server's spans are
made in their own processes, each with its own ``configure``.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import TYPE_CHECKING

from core.policies import GLOBAL
from core.records import as_utc

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Context, Span, Tracer

    from core.settings import Settings

TRAJECTORY_ID = "saoserve.trajectory_id"
VERSION = "saoserve.version"
PARENT_VERSION = "saoserve.parent_version"
POLICY = "saoserve.policy"

# The most trajectory links a step span keeps (OpenTelemetry's default span limit).
MAX_LINKS = 128

_tracer: Tracer | None = None
_provider = None
_policy = GLOBAL


def enabled() -> bool:
    """Whether spans are made (``configure`` found an endpoint or was given an exporter)."""
    return _tracer is not None


def configure(
    settings: Settings, role: str = "", exporter: SpanExporter | None = None, policy: str = GLOBAL
) -> bool:
    """Make spans in this process from now on, exported to ``settings.otlp_endpoint`` (OTLP over
    HTTP, in batches), or to ``exporter`` (each span as it ends: a test's in-memory exporter).
    ``role`` is appended to the ``service.name`` (``saoserve-learner``); ``policy``: the policy a
    learner trains (``trained``). Neither endpoint nor exporter: tracing stays (or turns) off.
    Returns whether it is on."""
    global _tracer, _provider, _policy
    shutdown()
    _policy = policy
    if exporter is None and not settings.otlp_endpoint:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    name = settings.otlp_service_name + (f"-{role}" if role else "")
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        endpoint = settings.otlp_endpoint.rstrip("/") + "/v1/traces"
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    _provider, _tracer = provider, provider.get_tracer("saoserve")
    return True


def shutdown() -> None:
    """Export what is pending and turn tracing off."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def _ids(key: str) -> tuple[int, int]:
    digest = hashlib.sha256(key.encode()).digest()
    # A zero id is invalid in OpenTelemetry; sha256 gives one with probability 2^-64.
    return int.from_bytes(digest[:16], "big") or 1, int.from_bytes(digest[16:24], "big") or 1


def _root(key: str):
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    trace_id, span_id = _ids(key)
    return NonRecordingSpan(
        SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    )


def trajectory_trace_id(trajectory_id: str) -> int:
    """The trace id of ``trajectory_id``'s trace (128 bits)."""
    return _ids(f"trajectory:{trajectory_id}")[0]


def version_trace_id(version: int, policy: str = GLOBAL) -> int:
    """The trace id of ``policy``'s version ``version`` (128 bits)."""
    return _ids(f"version:{policy}:{version}")[0]


def trajectory_context(trajectory_id: str) -> Context:
    """The parent context of a span in ``trajectory_id``'s trace."""
    from opentelemetry.trace import set_span_in_context

    return set_span_in_context(_root(f"trajectory:{trajectory_id}"))


def version_context(version: int, policy: str = GLOBAL) -> Context:
    """The parent context of a span in the trace of ``policy``'s version ``version``."""
    from opentelemetry.trace import set_span_in_context

    return set_span_in_context(_root(f"version:{policy}:{version}"))


def start_trajectory_span(name: str, trajectory_id: str, **attributes) -> Span | None:
    """Start the span ``name`` in ``trajectory_id``'s trace (the caller ends it: ``Span.end``);
    None while tracing is off."""
    if _tracer is None:
        return None
    attrs = {TRAJECTORY_ID: trajectory_id} | _attributes(attributes)
    return _tracer.start_span(name, context=trajectory_context(trajectory_id), attributes=attrs)


@contextlib.contextmanager
def child_span(parent: Span | None, name: str, **attributes) -> Iterator[None]:
    """A span ``name`` under ``parent`` for the ``with``'s duration (an exception is recorded on
    it and re-raised); nothing when ``parent`` is None (tracing off)."""
    if parent is None or _tracer is None:
        yield
        return
    from opentelemetry.trace import set_span_in_context

    with _tracer.start_as_current_span(
        name, context=set_span_in_context(parent), attributes=_attributes(attributes)
    ):
        yield


@contextlib.contextmanager
def trajectory_span(name: str, trajectory_id: str, **attributes) -> Iterator[None]:
    """The span ``name`` in ``trajectory_id``'s trace for the ``with``'s duration; nothing while
    tracing is off."""
    if _tracer is None:
        yield
        return
    attrs = {TRAJECTORY_ID: trajectory_id} | _attributes(attributes)
    with _tracer.start_as_current_span(name, context=trajectory_context(trajectory_id), attributes=attrs):
        yield


@contextlib.contextmanager
def version_span(name: str, version: int, policy: str = GLOBAL, **attributes) -> Iterator[None]:
    """The span ``name`` in the trace of ``policy``'s ``version`` for the ``with``'s duration
    (a server's swap); nothing while tracing is off."""
    if _tracer is None:
        yield
        return
    attrs = {VERSION: version, POLICY: policy} | _attributes(attributes)
    with _tracer.start_as_current_span(name, context=version_context(version, policy), attributes=attrs):
        yield


def span_for_stage(name: str, **attributes) -> contextlib.AbstractContextManager:
    """A span ``name`` in a trace of its own for the ``with``'s duration (the learner's poll of
    the log, which joins many trajectories); nothing while tracing is off."""
    if _tracer is None:
        return contextlib.nullcontext()
    return _tracer.start_as_current_span(name, attributes=_attributes(attributes))


def trained(
    version: int,
    parent_version: int,
    samples: Iterable[tuple[str, datetime]],
    step_started_ns: int,
    publish_started_ns: int,
    policy: str | None = None,
) -> None:
    """Record, once version ``version`` is published, the learner's spans of it: ``learner.step``
    (from ``step_started_ns``, in the version's trace, linked to each trajectory of its batch),
    ``learner.publish`` (its child, from ``publish_started_ns``), both ending now, and in each
    trajectory's trace a ``learner.join`` span at the time its sample was joined. ``samples``:
    (sample id, joined at) of the batch; a sample's id is its trajectory id, or ``e:<episode
    id>`` for an episode (whose feedback span is in that trace). Times are unix ns
    (``time.time_ns``); a join's duration is not known here, so its span is an instant.
    ``policy``: the learner's (default: ``configure``'s). Nothing while tracing is off."""
    if _tracer is None:
        return
    from opentelemetry.trace import Link

    policy = policy or _policy
    joined = list(samples)
    ids = [tid for tid, _ in joined]
    for tid, when in joined:
        at = int(as_utc(when).timestamp() * 1e9)
        span = _tracer.start_span(
            "learner.join",
            context=trajectory_context(tid),
            attributes={TRAJECTORY_ID: tid, VERSION: version, POLICY: policy},
            start_time=at,
        )
        span.end(end_time=at)
    links = [
        Link(_root(f"trajectory:{tid}").get_span_context(), {TRAJECTORY_ID: tid}) for tid in ids[:MAX_LINKS]
    ]
    attrs = {VERSION: version, PARENT_VERSION: parent_version, POLICY: policy, "saoserve.samples": len(ids)}
    step = _tracer.start_span(
        "learner.step",
        context=version_context(version, policy),
        attributes=attrs,
        links=links,
        start_time=step_started_ns,
    )
    from opentelemetry.trace import set_span_in_context

    publish = _tracer.start_span(
        "learner.publish",
        context=set_span_in_context(step),
        attributes={VERSION: version, POLICY: policy},
        start_time=publish_started_ns,
    )
    now = time.time_ns()
    publish.end(end_time=now)
    step.end(end_time=now)


def note(**attributes) -> None:
    """Set ``saoserve.<key>`` attributes on the current span (a swap's result); nothing while
    tracing is off."""
    if _tracer is None:
        return
    from opentelemetry.trace import get_current_span

    get_current_span().set_attributes(_attributes(attributes))


def _attributes(attributes: dict) -> dict:
    """``saoserve.<key>`` for each attribute that is set (None left out)."""
    return {f"saoserve.{k}": v for k, v in attributes.items() if v is not None}
