"""The operators' pages' handling besides their routes (``server.ops.api_router``): what the
dashboard shows of the learner and the guard."""

from __future__ import annotations

from sqlalchemy.engine import Engine

from core.control import PAUSED, ROLLBACK_TO
from core.lifecycle import CanarySplit
from core.policies import GLOBAL
from core.records import as_utc
from server.ops.protocol import GuardCan, GuardState, VersionPoint, VersionReward
from server.ops.queries import learner_rows


def guard_capability(
    on: bool, pinned: int | None, adapters: bool, split: CanarySplit | None, lineage: list[int]
) -> tuple[GuardCan, str]:
    """What the guard can do on this replica, and the plain sentence the dashboard and ``saoserve
    admin status`` show for it (docs/guard.md, "The lifecycle").

    ``decide``: the engine serves adapters, so the lineage gets a canary share beside a live
    control arm (the promoted version) rated in the same window: the decision rule's
    comparison is not confounded by drift. ``watch``: each new version serves all traffic on
    probation and is compared with the promoted version's earlier ratings, which drift between
    the two windows confounds: the vetoes watch, a verdict is weak (a full-weight engine, or an
    adapter engine with no split in effect: full-weight versions, or a promoted version it cannot
    hold beside the lineage). ``off`` and
    ``pinned``: the operators' switches; the guard decides nothing by itself.

    ``on``, ``pinned``: the switches; ``adapters``: this replica's engine serves adapters;
    ``split``: its canary split in effect (None: none); ``lineage``: the versions under watch.
    """
    if not on:
        tail = f"; pinned to version {pinned}" if pinned is not None else ""
        return "off", f"off: every new version is promoted as it is recorded, with no comparison{tail}"
    if pinned is not None:
        return "pinned", f"pinned to version {pinned}: the guard promotes and rejects nothing by itself"
    if adapters and split is not None:
        versions = ", ".join(map(str, sorted(split.lineage)))
        return "decide", (
            f"can decide: versions {versions} get a canary share of {split.share:g} beside a live control "
            f"arm (version {split.control}), both rated in the same window"
        )
    if adapters and not lineage:
        return "decide", (
            "can decide: nothing under watch now; a new version will get a canary share beside a live "
            "control arm (the promoted version)"
        )
    if adapters:
        return "watch", (
            "only watches for now: no canary split is in effect (full-weight versions, or the promoted "
            "version cannot be held beside the lineage), so the lineage serves all traffic on probation, "
            "compared with the promoted version's earlier ratings (no live control arm)"
        )
    return "watch", (
        "only watches: this engine serves one full-weight version at a time, so each new version serves "
        "all traffic on probation, compared with the promoted version's earlier ratings (no live "
        "control arm: drift between the two windows is confounded with the version)"
    )


def learner_overview(
    db: Engine,
    n_versions: int,
    policy: str = GLOBAL,
    adapters: bool = False,
    split: CanarySplit | None = None,
) -> dict:
    """What the dashboard shows beside the step metrics, read in one connection
    (``server.ops.queries.learner_rows``).

    ``learning`` (``running`` | ``paused``) and ``rollback_to`` (a requested rollback the learner
    has not carried out yet, or None) from the control flags; ``versions``: the newest
    ``n_versions`` (oldest first) and ``newest_version``; ``samples_waiting`` (joined, not trained
    yet) and ``samples_trained`` (the samples every recorded step trained, from its
    ``sample_ids``); ``reward_by_version``: completion feedback received, by the version that
    began the answer, for the versions shown (episode feedback is not in it); ``guard``: the
    lifecycle (``GuardState``), what the guard can do read from ``adapters`` (the replica's
    engine serves adapters) and ``split`` (its canary split in effect). docs/design.md §2
    (operators), docs/guard.md.
    """
    r = learner_rows(db, n_versions, policy)
    flags, lc = r.flags, r.lifecycle
    versions = [
        VersionPoint(
            version=v,
            parent_version=p,
            status=st,
            lifecycle=stage,
            rollback_to=rb,
            created_at=as_utc(c).isoformat(),
        )
        for v, p, st, stage, rb, c in reversed(r.versions)
    ]
    target = flags.get(ROLLBACK_TO)
    can, says = guard_capability(lc.guard_on, lc.pinned, adapters, split, lc.lineage)
    return {
        "learning": "paused" if flags.get(PAUSED) == "1" else "running",
        "rollback_to": None if target is None else int(target),
        "versions": versions,
        "newest_version": versions[-1].version if versions else None,
        "samples_waiting": r.waiting,
        "samples_trained": int(r.trained),
        "reward_by_version": [VersionReward(version=v, reward_mean=m, n=n) for v, m, n in r.rewards],
        "guard": GuardState(
            on=lc.guard_on,
            pinned=lc.pinned,
            promoted=lc.promoted,
            lineage=lc.lineage,
            stages=lc.stages,
            verdict=lc.verdict,
            mode="canary" if adapters else "probation",
            can=can,
            says=says,
        ),
    }
