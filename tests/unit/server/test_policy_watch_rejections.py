"""The policy watcher (server/policy_watch.py) leaving a rejected version, at the edges a tester
found: a rejection of a later lineage member, a restore target whose folder is gone, and a
version announced as rejected.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from server.engine import SwapRefused
from server.metrics import ServerMetrics
from server.policy_watch import PolicyWatcher
from testing.fakes import FakeEngine, OutageLog, append_events, event, notice, staged


@dataclass
class FoldersGone(FakeEngine):
    """FakeEngine whose swap refuses the versions in ``gone`` (their folder was pruned)."""

    gone: set[int] = field(default_factory=set)

    async def swap(self, version: int, path: Path, sha256: str):
        if version in self.gone:
            raise SwapRefused(f"no policy weights at {path}")
        return await super().swap(version, path, sha256)


async def test_a_rejection_of_a_later_lineage_member_leaves_the_older_one_serving_ready():
    # Version 1 promoted, 2 and 3 on canary, 3 serving; 3 alone is rejected (2 stays a
    # candidate). The replica goes to version 2, the newest not rejected, on probation as before
    # 3 was published, and is ready: a replica restarting now catches up to 2 as well. (Going to
    # the promoted version 1 instead left /readyz "behind", newest 2, on every full-weight
    # replica until the learner's restore was published.)
    log = OutageLog(0, [staged(1, "promoted"), staged(2, "canary"), staged(3, "canary")])
    engine = FakeEngine(version=0)
    watcher = PolicyWatcher(log, engine, ServerMetrics(), poll_s=0.25)
    await watcher.catch_up()
    await watcher.poll()
    append_events(log, notice(3, "rejected", 1))
    await watcher.poll()
    await watcher.poll()
    assert engine.version == 2 and [v for v, _, _ in engine.swaps] == [3, 2]
    assert watcher.readiness() == "ok"


async def test_a_restore_target_whose_folder_is_gone_falls_back_to_an_older_version(tmp_path):
    # Versions 1, 2, 3 published, 3 serving and rejected; version 2's folder was pruned. Version 1
    # (and the base weights) can still serve: a replica is stranded only when every version
    # below is refused and the base cannot be read; before, only the newest was tried.
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    log = OutageLog(0, [event(1), event(2), event(3)])
    engine = FoldersGone(version=0, model_dir=tmp_path, gone={2})
    watcher = PolicyWatcher(log, engine, ServerMetrics(), poll_s=0.25)
    await watcher.catch_up()
    await watcher.poll()
    append_events(log, notice(3, "rejected", 1))
    await watcher.poll()
    assert engine.version == 1 and watcher.stranded is None
    # /readyz then says "behind" (version 2 is newer and not rejected), as for any version whose
    # swap was refused.


async def test_with_every_folder_below_gone_the_base_weights_serve(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    log = OutageLog(0, [event(1), event(2)])
    engine = FoldersGone(version=0, model_dir=tmp_path, gone={1})
    watcher = PolicyWatcher(log, engine, ServerMetrics(), poll_s=0.25)
    await watcher.catch_up()
    await watcher.poll()
    append_events(log, notice(2, "rejected", 1))
    await watcher.poll()
    assert engine.swaps[-1] == (0, tmp_path, hashlib.sha256(b"weights").hexdigest())
    assert watcher.stranded is None


async def test_a_version_announced_as_rejected_does_not_hold_the_replica_catching_up():
    # A publish event whose lifecycle is "rejected" (a bug or a forgery: the learner never
    # announces one) is never loaded; the replica catches up to version 1, the newest not
    # rejected. Before, catch_up picked it, apply refused it, and the replica refused every
    # chat (CatchingUp) until a newer version was published.
    log = OutageLog(0, [event(1), staged(2, "rejected")])
    engine = FakeEngine(version=0)
    watcher = PolicyWatcher(log, engine, ServerMetrics(), poll_s=0.25)
    await watcher.catch_up()
    await watcher.poll()
    assert engine.version == 1 and watcher.caught_up
    assert watcher.newest == 1 and watcher.readiness() == "ok"
    watcher.require()
