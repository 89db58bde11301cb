"""A restarted ``saoserve serve`` process (testing/replicas.py) on the shared model is unready until
it serves the newest of two published versions (issue 23, docs/reliability.md "Replicas that
restart"). The app on a stand-in engine: tests/unit/server/test_replica_readiness.py."""

from __future__ import annotations

import shutil
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from core.logbus import open_log
from core.records import TOPIC_POLICY, PolicyEvent


# ------------------------------------------------------------------------------ engine tier
@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.kafka
def test_a_restarted_replica_is_unready_until_it_serves_the_newest_version(model_dir, tmp_path):
    """A real ``saoserve serve`` (PostgreSQL, tansu) serves version 1, is stopped, versions 2
    and 3 are published, and it starts again: every ``/readyz`` answer from its start is 503
    naming the gap (at least one is seen: the swap takes seconds) until it is 200 at version 3,
    and 200 from then on; its chats then carry version 3 in every token. A stale event (version
    2 again, twice) is ignored, counted twice and logged once."""
    from core.db import make_engine
    from testing.dependencies import TansuBroker, fresh_pg_database
    from testing.replicas import ADMIN, Deployment, metric

    broker = TansuBroker()
    broker.start()
    with fresh_pg_database("saoready") as pg:
        dep = Deployment(home=tmp_path, database_url=pg, log_url=broker.url, model_dir=model_dir)
        db = make_engine(pg)
        try:
            a = dep.serve("replica-a")
            dep.wait_ready([a])
            versions = float32_versions(model_dir, tmp_path / "policies", 3)
            publish_version(dep, db, *versions[1])
            wait_version(a, 1)
            first = chat(a)
            assert first["policy_version"] == 1
            a.stop()
            dep.procs.remove(a)
            publish_version(dep, db, *versions[2])
            publish_version(dep, db, *versions[3])

            b = dep.serve("replica-a-restarted")
            seen = poll_readyz(b, timeout_s=300)
            unready = [body for _, code, body in seen if code == 503]
            ready_at = next(i for i, (_, code, _) in enumerate(seen) if code == 200)
            assert unready, "no 503 seen while the restarted replica caught up"
            assert all(code == 503 for _, code, _ in seen[:ready_at])
            assert all(code == 200 for _, code, _ in seen[ready_at:])
            # The second line is the last milliseconds of the catch-up swap: vLLM serves 3 and
            # the watcher has not yet marked itself caught up (CI, 2026-12-04).
            assert {body["policy"] for body in unready} <= {
                "catching up: serves version 0, the policy topic's newest is 3",
                "catching up: serves version 3, the policy topic's newest is 3",
            }
            assert all(body["policy_version"] == 3 for _, _, body in seen[ready_at:])
            print(
                f"\nrestarted replica: listening {seen[0][0] - b.started_at:.1f} s after its start, then "
                f"{len(unready)} answers 503 over {seen[ready_at][0] - seen[0][0]:.2f} s before 200 at version 3"
            )
            answer = chat(b)
            assert answer["policy_version"] == 3
            rec = httpx.get(f"{b.url}/admin/trajectories/{answer['id']}", headers=ADMIN, timeout=30).json()
            assert rec["dispatch_version"] == 3
            assert all(v >= first["policy_version"] for v, _ in rec["token_versions"])
            assert [v for v, _ in rec["token_versions"]] == [3]

            # A stale event (version 2 published again, e.g. by a learner restored from a backup).
            publish_event(dep, *versions[2])
            publish_event(dep, *versions[2])
            deadline = time.monotonic() + 30
            while (
                metric(httpx.get(f"{b.url}/metrics").text, "saoserve_policy_swaps_total", result="stale") != 2
            ):
                assert time.monotonic() < deadline, b.tail()
                time.sleep(0.2)
            assert chat(b)["policy_version"] == 3
            assert b.log_path.read_text().count("policy event for version 2 ignored") == 1
        except BaseException:
            print("\n" + dep.tails())
            raise
        finally:
            dep.stop()
            db.dispose()
            broker.kill()
            shutil.rmtree(tmp_path / "policies", ignore_errors=True)


def float32_versions(model_dir: Path, root: Path, n: int) -> dict[int, tuple[int, Path, str]]:
    """Versions 1..n as the learner writes them: float32 safetensors of the model's weights
    (version v scaled by 1 + v·1e-4, so each has its own checksum) in ``root/vNNNNNN``."""
    import torch
    from safetensors.torch import load_file, save_file

    from core.weights import weights_sha256

    base = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        base |= load_file(f)
    out = {}
    for v in range(1, n + 1):
        folder = root / f"v{v:06d}"
        folder.mkdir(parents=True)
        scaled = {k: (t.to(torch.float32) * (1 + v * 1e-4)).contiguous() for k, t in base.items()}
        save_file(scaled, folder / "model.safetensors")
        out[v] = (v, folder, weights_sha256(folder))
    return out


def publish_event(dep, version: int, folder: Path, sha: str) -> None:
    log = open_log(dep.log_url)
    ev = PolicyEvent(
        version=version,
        path=str(folder),
        sha256=sha,
        created_at=datetime.now(UTC),
        parent_version=version - 1,
        metrics={},
    )
    log.append(TOPIC_POLICY, "policy", ev.to_json())
    log.close()


def publish_version(dep, db, version: int, folder: Path, sha: str) -> None:
    """Record ``version`` as the learner does (its row, then its event, then ``published``)."""
    from sqlalchemy import insert

    from core.db import PolicyVersion

    with db.begin() as conn:
        conn.execute(
            insert(PolicyVersion).values(
                version=version,
                path=str(folder),
                sha256=sha,
                status="published",
                parent_version=version - 1,
                metrics={},
                created_at=datetime.now(UTC),
            )
        )
    publish_event(dep, version, folder, sha)


def wait_version(replica, version: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while replica.serving()[0] != version:
        assert time.monotonic() < deadline, replica.tail()
        time.sleep(0.2)


def chat(replica) -> dict:
    r = httpx.post(
        f"{replica.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def poll_readyz(replica, timeout_s: float) -> list[tuple[float, int, dict]]:
    """Every ``/readyz`` answer (Unix time, status, body) from the replica's first until 2 s after
    its first 200, every 50 ms (connection refused while the engine starts is not an answer)."""
    seen: list[tuple[float, int, dict]] = []
    deadline = time.monotonic() + timeout_s
    ready_since = None
    with httpx.Client(timeout=5) as http:
        while ready_since is None or time.monotonic() - ready_since < 2.0:
            assert time.monotonic() < deadline, replica.tail()
            assert replica.alive(), replica.tail()
            try:
                r = http.get(f"{replica.url}/readyz")
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            seen.append((time.time(), r.status_code, r.json()))
            if r.status_code == 200 and ready_since is None:
                ready_since = time.monotonic()
            time.sleep(0.05)
    return seen
