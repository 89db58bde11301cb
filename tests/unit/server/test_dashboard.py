"""The operators' dashboard (issue 23) without a server: ``GET /dashboard/state`` and ``/metrics``
on SQLite (the test of ``testing.backends.dashboard``), and the counts over a label."""

from __future__ import annotations

from types import SimpleNamespace

from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Counter

from core.control import GUARD_OFF, GUARD_PIN, set_flag
from core.db import make_engine
from server.metrics import label_counts
from testing.backends.dashboard import *  # noqa: F403 (its test runs here on SQLite)
from testing.backends.dashboard import add_lineage, populate
from testing.servers import make_settings


def test_label_counts_sums_over_the_other_labels():
    c = Counter("x_total", "x", ["stream", "outcome"], registry=CollectorRegistry())
    c.labels("true", "ok").inc(2)
    c.labels("false", "ok").inc()
    c.labels("false", "aborted").inc()
    c.labels("true", "engine_error")  # made, never counted: 0
    assert label_counts(c, "outcome") == {"ok": 3, "aborted": 1, "engine_error": 0}
    assert label_counts(c, "stream") == {"true": 2, "false": 2}


def test_the_guard_says_whether_it_can_decide_or_only_watch(tmp_path):
    """What the guard can do is read from this replica (``server.ops.serving.guard_capability``):
    an engine serving adapters decides against a live control arm while its canary split is in
    effect; a lineage without the split (the promoted version not held) is on probation, where
    the guard only watches; the pin says so; ``saoserve admin status`` prints the same words.
    (A full-weight engine: ``test_dashboard_state``, ``PROBATION_SAYS``.)"""
    from core.lifecycle import CanarySplit
    from saoserve.admin.status import _guard_lines
    from server.adapters import AdapterTable
    from server.app import create_app
    from server.canary import CanaryRouter
    from server.metrics import ServerMetrics

    settings = make_settings(tmp_path)
    engine = SimpleNamespace(version=4, adapters=AdapterTable(3))
    app = create_app(settings, engine=engine, watch_policy=False)
    with TestClient(app) as client:

        def guard() -> dict:
            return client.get("/dashboard/state").json()["guard"]

        idle = guard()
        assert (idle["mode"], idle["can"], idle["says"]) == (
            "canary",
            "decide",
            "can decide: nothing under watch now; a new version will get a canary share beside a live "
            "control arm (the promoted version)",
        )
        populate(settings.resolved_database_url)  # version 2 promoted
        add_lineage(settings.resolved_database_url)  # versions 3 and 4 under watch
        db = make_engine(settings.resolved_database_url)
        set_flag(db, GUARD_OFF, None)
        set_flag(db, GUARD_PIN, None)
        unheld = guard()
        assert (unheld["can"], unheld["says"]) == (
            "watch",
            "only watches for now: no canary split is in effect (full-weight versions, or the promoted "
            "version cannot be held beside the lineage), so the lineage serves all traffic on probation, "
            "compared with the promoted version's earlier ratings (no live control arm)",
        )
        assert _guard_lines(unheld)[1] == ("", "promoted version 2; on probation: versions 3, 4")
        # The router holds version 2 beside the lineage: the split is in effect.
        router = CanaryRouter(db, engine, ServerMetrics(), 0.2)
        router.split = CanarySplit(frozenset({3, 4}), 2, 0.2)
        app.state.s.canary = router
        split = guard()
        says = (
            "can decide: versions 3, 4 get a canary share of 0.2 beside a live control arm (version 2), "
            "both rated in the same window"
        )
        assert (split["can"], split["says"]) == ("decide", says)
        assert _guard_lines(split)[:2] == [
            ("guard", says),
            ("", "promoted version 2; on canary: versions 3, 4"),
        ]
        set_flag(db, GUARD_PIN, "2")
        pinned = guard()
        assert (pinned["can"], pinned["says"]) == (
            "pinned",
            "pinned to version 2: the guard promotes and rejects nothing by itself",
        )
        assert _guard_lines(pinned)[1] == ("", "promoted version 2; under watch: versions 3, 4")
        db.dispose()
