"""The learner process (``saoserve learn``): join, train, publish (DESIGN §3, §8).

Loop: read new trajectory and feedback records from the stored offsets; join them (by
trajectory id, or by episode id for multi-turn episodes); in ONE database transaction commit
the new offsets, the pending joins, the produced samples and the prompt evidence of the joined
results (SPO++ results enter the evidence when feedback is joined, attributed to the dispatch
version). When ``batch_size`` samples are waiting and learning is not paused: one SAO step,
write the new policy (safetensors in the servers' dtype, a directory per version, sha256), record the version
and delete the consumed samples in one transaction, then publish a policy event that every
server replica follows.

A crash at any point loses and duplicates nothing: offsets only move together with the state
they produced; a trajectory id joined once leaves a tombstone so a re-sent copy is ignored; a
version committed but not yet announced is announced again at start.

The database is the truth of the learner's state (DESIGN §8). A version's directory is written
before its commit but means nothing until then: at load, directories above the database's
latest version are deleted. ``checkpoint.pt`` (tagged with its version) is written only after
the commit, and a checkpoint newer than the database's latest version is ignored. A failure
between applying a step in memory and its commit drops the in-memory models; the next iteration
reloads the committed state as a restart would (``load``). Fault points (``learner.faults``)
mark each step of the cycle for the kill -9 harness (tests/test_learner_faults.py).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import threading
import uuid
from collections.abc import Callable
from datetime import UTC
from pathlib import Path

import torch
from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.engine import Connection, Engine

from core.control import PAUSED, ROLLBACK_TO, get_flag
from core.db import (
    ControlFlag,
    LearnerCounter,
    LearnerSample,
    LearnerStep,
    PolicyVersion,
    make_engine,
    migrate,
)
from core.logbus import LogTransport, open_log
from core.records import (
    TOPIC_POLICY,
    PolicyEvent,
    utcnow,
)
from core.settings import Settings
from core.weights import weights_sha256
from learner.algorithm import Algorithm, build_algorithm
from learner.config import LearnerConfig
from learner.faults import ReadFaultLog, armed, fault_point
from learner.joiner import Joiner, JoinStats
from learner.samples import Sample, collate

log = logging.getLogger(__name__)

CONSUMER = "learner"
POLICY_KEY = "policy"
WEIGHTS_FILE = "model.safetensors"
CHECKPOINT_FILE = "checkpoint.pt"


def storable(value):
    """``value`` with every non-finite float replaced by None, recursively (dicts, lists).

    PostgreSQL's JSON refuses NaN and Infinity, and a metric that is not a number is unknown:
    metrics are stored finite or null (DESIGN §8).
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable(v) for v in value]
    return value


class Learner:
    """One learner per policy. Not thread-safe: one loop drives it.

    ``algorithm`` is the ``learner.algorithm.Algorithm`` the config names, None until ``load``
    (and after a step failed before its commit).
    """

    def __init__(
        self,
        settings: Settings,
        config: LearnerConfig,
        log_transport: LogTransport | None = None,
        db: Engine | None = None,
    ):
        self.settings = settings
        self.config = config
        transport = log_transport or open_log(settings.resolved_log_url)
        self.log = ReadFaultLog(transport) if armed() else transport
        self.db = db or make_engine(settings.resolved_database_url)
        self.joiner = Joiner(self.log, self.db, config.expire_s)
        self.policy_dir = Path(settings.resolved_policy_dir)
        self.base_dir = Path(settings.resolved_model_dir)
        self.run_id = uuid.uuid4().hex[:12]
        self.algorithm: Algorithm | None = None
        self.version = 0
        self._unannounced = False

    def poll_once(self, max_records: int = 500) -> JoinStats:
        """Read new records, join, commit offsets + joins + samples + evidence together."""
        stats = self.joiner.poll_once(max_records)
        if isinstance(self.log, ReadFaultLog) and self.log.take_read():
            fault_point("after_join_commit")
        return stats

    def waiting_samples(self) -> int:
        with self.db.connect() as conn:
            return conn.execute(select(func.count()).select_from(LearnerSample)).scalar_one()

    # ---------------------------------------------------------------- model
    def load(self) -> None:
        """Build policy and critic in the state the database has committed.

        The policy takes the weights of the database's latest version; the critic, optimizer
        states and step count come from ``checkpoint.pt`` when its version is not newer than
        that (else from the pretrained critic, or fresh). Version directories the database
        does not know are deleted. On any error ``self.algorithm`` stays None.
        """
        self.algorithm = None
        try:
            self._load()
        except BaseException:
            self.algorithm = None
            raise

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM

        def load_policy():
            return AutoModelForCausalLM.from_pretrained(self.base_dir, dtype=torch.float32)

        latest = self._latest_version()
        algorithm = build_algorithm(self.config, load_policy)
        committed = latest.version if latest is not None else 0
        self._discard_uncommitted(committed)
        ckpt = self.policy_dir / CHECKPOINT_FILE
        state = torch.load(ckpt, map_location="cpu", weights_only=False) if ckpt.is_file() else None
        if state is not None and state["version"] > committed:
            # Written by a learner before the version was committed in this database (older
            # code, or a database restored from a backup): it claims updates that never were.
            log.warning("ignoring %s at version %d: the database is at %d", ckpt, state["version"], committed)
            state = None
        self.version = 0
        if state is None:
            loaded = algorithm.warm_start(self.policy_dir)
            if loaded is not None:
                log.info("critic: starting from the pretrained %s", loaded)
        else:
            algorithm.load_state_dict(state["learner"])
            self.version = state["version"]
        self.algorithm = algorithm
        if latest is not None and latest.version > self.version:
            # Versions trained after the last checkpoint: take their published policy weights
            # (the critic and optimizer state come from the checkpoint).
            self._load_policy_weights(Path(latest.path))
            self.version = latest.version
        algorithm.on_version(self.version)
        if latest is None:
            self._record_base_version()
        elif latest.status != "published":
            self._announce(latest)

    def _discard_uncommitted(self, committed: int) -> None:
        """Delete version directories above ``committed`` and half-written files.

        Such a directory was written by a learner that died (or failed) before the version's
        commit; the next step of that number writes it again.
        """
        if not self.policy_dir.is_dir():
            return
        for d in self.policy_dir.glob("v[0-9]*"):
            number = d.name[1:]
            if not number.isdigit() or int(number) > committed:
                log.info("deleting %s: not a version the database has committed", d)
                shutil.rmtree(d, ignore_errors=True)
        (self.policy_dir / (CHECKPOINT_FILE + ".tmp")).unlink(missing_ok=True)

    def _load_policy_weights(self, path: Path) -> None:
        from safetensors.torch import load_file

        weights = {k: v.float() for k, v in load_file(path / WEIGHTS_FILE).items()}
        missing, unexpected = self.algorithm.policy.load_state_dict(weights, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise RuntimeError(f"policy weights at {path} do not match the model: {missing} {unexpected}")

    def _latest_version(self):
        with self.db.connect() as conn:
            return conn.execute(
                select(*PolicyVersion.__table__.columns).order_by(PolicyVersion.version.desc()).limit(1)
            ).first()

    def _record_base_version(self) -> None:
        with self.db.begin() as conn:
            conn.execute(
                insert(PolicyVersion).values(
                    version=0,
                    path=str(self.base_dir.resolve()),
                    sha256=weights_sha256(self.base_dir),
                    status="published",
                    parent_version=None,
                    metrics={},
                    created_at=utcnow(),
                )
            )

    def _announce(self, row) -> None:
        """Publish the policy event of a committed version (idempotent for servers)."""
        if row.version == 0 and row.status == "published":
            return
        event = PolicyEvent(
            version=row.version,
            path=row.path,
            sha256=row.sha256,
            created_at=row.created_at,
            parent_version=row.parent_version,
            metrics={k: float(v) for k, v in (row.metrics or {}).items() if isinstance(v, int | float)},
        )
        self.log.append(TOPIC_POLICY, POLICY_KEY, event.to_json())
        fault_point("after_policy_event")
        if row.status != "published":
            with self.db.begin() as conn:
                conn.execute(
                    update(PolicyVersion)
                    .where(PolicyVersion.version == row.version)
                    .values(status="published")
                )

    def _write_version(self, version: int) -> tuple[Path, str]:
        """Weights + config + tokenizer in a new directory; returns (path, sha256).

        Weights are written in the dtype the servers serve in (``SAOSERVE_DTYPE``). Publishing
        bf16 while the learner keeps fp32 master weights made the served policy differ from
        the one the learner evaluates by 0.13-0.19 nats per token on average (max ~1 nat,
        measured on a 21-step run), which DIS then masks as if it were staleness; with the
        float32 engine and float32 weights they agree to ~1e-4.
        """
        from safetensors.torch import save_file

        out = self.policy_dir / f"v{version:06d}"
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        weights = self.algorithm.policy_weights(getattr(torch, self.settings.dtype))
        if getattr(self.algorithm.policy.config, "tie_word_embeddings", False):
            weights.pop("lm_head.weight", None)
        save_file(
            {k: v.contiguous() for k, v in weights.items()}, tmp / WEIGHTS_FILE, metadata={"format": "pt"}
        )
        for f in self.base_dir.iterdir():
            if f.is_file() and f.suffix != ".safetensors":
                shutil.copy2(f, tmp / f.name)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        return out, weights_sha256(out)

    def _prune(self) -> None:
        keep = self.config.keep_versions
        dirs = sorted(
            d
            for d in self.policy_dir.glob("v[0-9]*")
            if d.name[1:].isdigit() and int(d.name[1:]) <= self.version
        )
        for d in dirs[:-keep] if keep > 0 else []:
            shutil.rmtree(d, ignore_errors=True)

    # ----------------------------------------------------------------- train
    def flag(self, name: str) -> str | None:
        return get_flag(self.db, name)

    def train_step(self) -> dict | None:
        """One step on the oldest ``batch_size`` samples, then publish the new version.

        The step counts as applied only once its version is committed: on any error before
        that, the in-memory models are dropped (``self.algorithm = None``) and the error
        re-raised; ``run`` reloads the committed state before anything else.
        """
        with self.db.connect() as conn:
            rows = conn.execute(
                select(LearnerSample.id, LearnerSample.payload, LearnerSample.created_at)
                .order_by(LearnerSample.created_at, LearnerSample.id)
                .limit(self.config.batch_size)
            ).all()
        if len(rows) < self.config.batch_size:
            return None
        samples = [Sample.from_json(json.loads(p)) for _, p, _ in rows]
        batch = collate(samples, self.version)
        sample_ids = [r[0] for r in rows]
        try:
            metrics = self._step(samples, batch)
            # The newest sample of the batch, whose feedback completed it (judge.runstats).
            metrics["completing_sample"] = rows[-1][0]
            # When that sample was joined (unix s, within a poll of its feedback's receipt): the
            # start of feedback→served, which servers measure (saoserve_feedback_to_served_seconds).
            joined = rows[-1][2]
            metrics["batch_completed_at"] = (
                joined if joined.tzinfo else joined.replace(tzinfo=UTC)
            ).timestamp()
            fault_point("during_step")
        except BaseException:
            self.algorithm = None
            raise
        clean = storable(metrics)
        flat = {k: v for k, v in clean.items() if v is None or isinstance(v, int | float)}
        step = self.algorithm.steps

        def record_step(conn: Connection, version: int, now) -> None:
            # The step (with the ids of the samples it trained) and the samples' deletion.
            conn.execute(delete(LearnerSample).where(LearnerSample.id.in_(sample_ids)))
            conn.execute(
                insert(LearnerStep).values(
                    run_id=self.run_id,
                    step=step,
                    version=version,
                    metrics=json.loads(json.dumps(clean | {"sample_ids": sample_ids}, default=str)),
                    created_at=now,
                )
            )

        new_version = self._publish(self.version, flat, record_step)
        if step % self.config.checkpoint_every == 0:
            self._checkpoint(new_version)
            fault_point("after_checkpoint")
        self._announce_latest()
        self._prune()
        log.info(
            "version %d: reward %.3f kept %.3f EV %s loss %.4f (%.1fs)",
            new_version,
            metrics["reward_mean"],
            metrics["kept_fraction"],
            metrics.get("explained_variance"),
            metrics["policy_loss"],
            metrics["step_time_s"],
        )
        return metrics

    def _step(self, samples: list[Sample], batch) -> dict:
        metrics = self.algorithm.step(batch, samples)
        stale = batch.token_staleness[batch.action_mask.bool()]
        metrics["staleness_mean"] = stale.float().mean().item()
        metrics["staleness_max"] = int(stale.max().item())
        metrics["staleness_hist"] = {
            str(int(k)): int(v) for k, v in zip(*torch.unique(stale, return_counts=True), strict=True)
        }
        return metrics

    def _publish(self, parent: int, metrics: dict, also: Callable[[Connection, int, object], None]) -> int:
        """Write the next version's weights, then commit its row together with ``also(conn,
        version, now)`` in one transaction; returns the new version (still to be announced).

        Metrics must be storable (``storable``). On any error before the commit the in-memory
        models are dropped (``self.algorithm = None``) and the error re-raised.
        """
        new_version = self.version + 1
        try:
            path, sha = self._write_version(new_version)
            fault_point("after_weights")
            self._commit_version(new_version, path, sha, parent, metrics, also)
        except BaseException:
            self.algorithm = None
            raise
        self.version = new_version
        self._unannounced = True
        self.algorithm.on_version(new_version)
        fault_point("after_commit")
        return new_version

    def _commit_version(
        self, version: int, path: Path, sha: str, parent: int, metrics: dict, also: Callable
    ) -> None:
        """Record the version (status committed) and ``also(conn, version, now)`` in one transaction."""
        now = utcnow()
        with self.db.begin() as conn:
            conn.execute(
                insert(PolicyVersion).values(
                    version=version,
                    path=str(path.resolve()),
                    sha256=sha,
                    status="committed",
                    parent_version=parent,
                    metrics=metrics,
                    created_at=now,
                )
            )
            also(conn, version, now)

    def _announce_latest(self) -> None:
        self._announce(self._latest_version())
        self._unannounced = False

    def _checkpoint(self, version: int) -> None:
        """Replace ``checkpoint.pt`` with the state of ``version``; call only once it is committed."""
        tmp = self.policy_dir / (CHECKPOINT_FILE + ".tmp")
        state = {
            "version": version,
            "learner": self.algorithm.state_dict(),
            "config": self.config.model_dump(mode="json"),
        }
        torch.save(state, tmp)
        tmp.replace(self.policy_dir / CHECKPOINT_FILE)

    def rollback(self, version: int) -> int | None:
        """Publish a new version whose weights are those of ``version`` (versions stay monotone).

        Optimizer moments are reset: they belong to the abandoned trajectory of updates. An
        unknown ``version``, or one whose weights were pruned, is refused: the flag is cleared,
        the ``rollback_refused`` counter bumped and None returned (retrying could never
        succeed). As in ``train_step``, an error before the commit drops the in-memory models.
        """
        with self.db.connect() as conn:
            row = conn.execute(
                select(*PolicyVersion.__table__.columns).where(PolicyVersion.version == version)
            ).first()
        if row is None or not (Path(row.path) / WEIGHTS_FILE).is_file():
            log.error("rollback to version %d refused: unknown, or its weights are gone", version)
            with self.db.begin() as conn:
                conn.execute(delete(ControlFlag).where(ControlFlag.name == ROLLBACK_TO))
                res = conn.execute(
                    update(LearnerCounter)
                    .where(LearnerCounter.name == "rollback_refused")
                    .values(value=LearnerCounter.value + 1)
                )
                if res.rowcount == 0:
                    conn.execute(insert(LearnerCounter).values(name="rollback_refused", value=1))
            return None
        try:
            self._load_policy_weights(Path(row.path))
            self.algorithm.reset_policy_optimizer()
        except BaseException:
            self.algorithm = None
            raise

        def clear_flag(conn: Connection, new_version: int, now) -> None:
            conn.execute(delete(ControlFlag).where(ControlFlag.name == ROLLBACK_TO))

        new_version = self._publish(version, {"rollback_to": version}, clear_flag)
        self._announce_latest()
        return new_version

    def run(self, stop: threading.Event | None = None) -> None:
        """Join and train until ``stop`` is set or ``max_steps`` steps are done."""
        stop = stop or threading.Event()
        while not stop.is_set():
            try:
                if self.algorithm is None:
                    # First start, or a step failed before its commit: the committed state.
                    self.load()
                elif self._unannounced:
                    self._announce_latest()
                self.poll_once()
                target = self.flag(ROLLBACK_TO)
                if target is not None:
                    self.rollback(int(target))
                    continue
                if self.flag(PAUSED) == "1":
                    stop.wait(self.config.poll_s)
                    continue
                if self.train_step() is None:
                    stop.wait(self.config.poll_s)
                elif self.config.max_steps is not None and self.algorithm.steps >= self.config.max_steps:
                    return
            except Exception:
                # Log or database outage: wait and resume from the committed state.
                log.exception("learner iteration failed; retrying")
                stop.wait(max(self.config.poll_s, 2.0))


def run_learner(settings: Settings, config: LearnerConfig, stop: threading.Event | None = None) -> Learner:
    """Migrate, build, and run a learner in this thread (``saoserve learn``)."""
    migrate(settings.resolved_database_url)
    log.info("learner config: %s", config.model_dump_json())
    learner = Learner(settings, config)
    learner.load()
    learner.run(stop)
    return learner
