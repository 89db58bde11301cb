"""Publishing a policy version: write its folder, commit its row, announce it, prune the old
folders (docs/design.md §3 step 6, §8).

The order is the promise that the database is the truth of the learner's state: the folder
(``core.policy_store`` says its name and layout) is written under a ``.tmp`` name and renamed,
then its ``policy_versions`` row (status ``committed``) is committed together with whatever the
caller commits beside it, and only then is the policy event appended and the row set
``published``. A folder without a committed row means nothing (``learner.resume`` deletes it at
load); a row committed but not announced is announced again. A ``rejected`` version is never
announced: no server ever loads it (docs/guard.md, "The lifecycle").

The learner owns its version counter and its models; these functions take what they read and
write as arguments.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from sqlalchemy import insert, select, update
from sqlalchemy.engine import Connection, Engine, Row

from core import lifecycle_store
from core.db import PolicyVersion
from core.lifecycle import LEARNER, Stage
from core.logbus import LogTransport
from core.policy_store import WEIGHTS_FILE, version_dir, version_dirs
from core.records import POLICY_KEY, TOPIC_POLICY, PolicyEvent, utcnow
from core.weights import weights_sha256
from learner.algo.algorithm import Algorithm
from learner.faults import fault_point

# What a commit runs beside the version's row, in the same transaction: (conn, version, now).
AlsoCommit = Callable[[Connection, int, object], None]


def storable(value):
    """``value`` with every non-finite float replaced by None, recursively (dicts, lists).

    PostgreSQL's JSON refuses NaN and Infinity, and a metric that is not a number is unknown:
    metrics are stored finite or null (docs/design.md §8).
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable(v) for v in value]
    return value


def _newest(db: Engine, *where) -> Row | None:
    """The newest ``policy_versions`` row matching ``where`` (every column), None if none."""
    with db.connect() as conn:
        return conn.execute(
            select(*PolicyVersion.__table__.columns)
            .where(*where)
            .order_by(PolicyVersion.version.desc())
            .limit(1)
        ).first()


def latest_version(db: Engine) -> Row | None:
    """The database's latest version row, whatever its stage; None before the base is recorded."""
    return _newest(db)


def head_version(db: Engine) -> Row | None:
    """The newest version not rejected: the one whose weights the policy trains on."""
    return _newest(db, PolicyVersion.lifecycle != Stage.REJECTED.value)


def promoted_version(db: Engine) -> Row | None:
    """The promoted version's row: the newest one whose stage is ``promoted``."""
    return _newest(db, PolicyVersion.lifecycle == Stage.PROMOTED.value)


def version_row(db: Engine, version: int) -> Row | None:
    """The row of ``version`` (every column), None for a version the database does not know."""
    with db.connect() as conn:
        return conn.execute(
            select(*PolicyVersion.__table__.columns).where(PolicyVersion.version == version)
        ).first()


def version_path(db: Engine, version: int) -> str:
    """The folder ``version`` was published in, as recorded.

    Raises:
        sqlalchemy.exc.NoResultFound: the database does not know ``version``.
    """
    with db.connect() as conn:
        return conn.execute(select(PolicyVersion.path).where(PolicyVersion.version == version)).scalar_one()


def record_base_version(db: Engine, base_dir: Path) -> None:
    """Record version 0: the base model's folder ``base_dir`` itself, published and promoted."""
    now = utcnow()
    with db.begin() as conn:
        conn.execute(
            insert(PolicyVersion).values(
                version=0,
                path=str(Path(base_dir).resolve()),
                sha256=weights_sha256(base_dir),
                status="published",
                parent_version=None,
                metrics={},
                created_at=now,
                lifecycle=Stage.PROMOTED.value,
            )
        )
        lifecycle_store.record_event(conn, 0, None, Stage.PROMOTED, LEARNER, "the base model", now)


def write_version(
    algorithm: Algorithm, policy_dir: Path, base_dir: Path, version: int, dtype: torch.dtype
) -> tuple[Path, str]:
    """Write ``algorithm``'s policy as the folder of ``version``; returns (path, sha256).

    Full weights: ``model.safetensors`` beside the base model's config and tokenizer files from
    ``base_dir``; with a LoRA policy the folder holds the adapter alone, in PEFT's layout
    (``core.policy_store``: ``adapter_model.safetensors``, ``adapter_config.json``, written by
    ``learner.models.lora.Adapter.save``), in the serving dtype too. An older folder of that number is
    replaced.

    Weights are written in ``dtype``, the dtype the servers serve in (``SAOSERVE_DTYPE``), so
    that the served policy is the one the learner evaluates: weights rounded to another dtype on
    the way would open a behaviour/learner logprob gap that DIS masks as if it were staleness
    (measured: docs/design.md §7.3).
    """
    from safetensors.torch import save_file

    out = version_dir(policy_dir, version)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if algorithm.adapter is not None:
        algorithm.save_adapter(tmp, dtype)
    else:
        weights = algorithm.policy_weights(dtype)
        if getattr(algorithm.policy.config, "tie_word_embeddings", False):
            weights.pop("lm_head.weight", None)
        # To the CPU here, at the file's edge: a GPU learner's weights are on its device.
        save_file(
            {k: v.to("cpu").contiguous() for k, v in weights.items()},
            tmp / WEIGHTS_FILE,
            metadata={"format": "pt"},
        )
        for f in Path(base_dir).iterdir():
            if f.is_file() and f.suffix != ".safetensors":
                shutil.copy2(f, tmp / f.name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out, weights_sha256(out)


def commit_version(
    db: Engine,
    version: int,
    path: Path,
    sha: str,
    parent: int,
    metrics: dict,
    also: AlsoCommit,
    stage: Stage = Stage.PROMOTED,
    gate: dict | None = None,
) -> None:
    """Record ``version`` (status ``committed``, lifecycle ``stage``, folder ``path`` with
    checksum ``sha``, trained from ``parent``, ``metrics`` storable, the gate's figures ``gate``)
    and ``also(conn, version, now)`` in one transaction; raises what the database raises."""
    now = utcnow()
    with db.begin() as conn:
        conn.execute(
            insert(PolicyVersion).values(
                version=version,
                path=str(path.resolve()),
                sha256=sha,
                status="committed",
                parent_version=parent,
                metrics=metrics,
                created_at=now,
                lifecycle=stage.value,
                gate=gate,
            )
        )
        also(conn, version, now)


def announce(db: Engine, log: LogTransport, row: Row) -> None:
    """Append the policy event of the committed version ``row`` to the policy topic, then set its
    status ``published`` (idempotent for servers: announcing twice is harmless). A rejected
    version, and the base recorded published, are not announced."""
    if (row.version == 0 and row.status == "published") or row.lifecycle == Stage.REJECTED:
        return
    event = PolicyEvent(
        version=row.version,
        path=row.path,
        sha256=row.sha256,
        created_at=row.created_at,
        parent_version=row.parent_version,
        metrics={k: float(v) for k, v in (row.metrics or {}).items() if isinstance(v, int | float)},
        lifecycle=row.lifecycle,
    )
    log.append(TOPIC_POLICY, POLICY_KEY, event.to_json())
    fault_point("after_policy_event")
    if row.status != "published":
        with db.begin() as conn:
            conn.execute(
                update(PolicyVersion).where(PolicyVersion.version == row.version).values(status="published")
            )


def prune(db: Engine, policy_dir: Path, keep: int, newest: int) -> None:
    """Delete all but the newest ``keep`` version folders up to version ``newest`` (``keep`` 0:
    delete none), and never the folder of a version a server or the learner may still load
    (``core.lifecycle_store.routable``: every promoted version, the newest not rejected, the
    pinned one and a requested rollback's target)."""
    with db.connect() as conn:
        spared = lifecycle_store.routable(conn)
    dirs = [(v, d) for v, d in version_dirs(policy_dir) if v <= newest]
    for v, d in dirs[:-keep] if keep > 0 else []:
        if v not in spared:
            shutil.rmtree(d, ignore_errors=True)
