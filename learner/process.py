"""The learner process (``saoserve learn``): join, train, publish (docs/design.md §3, §8).

Loop: read new trajectory and feedback records from the stored offsets; join them (by
trajectory id, or by episode id for multi-turn episodes); in ONE database transaction commit
the new offsets, the pending joins, the produced samples and the prompt evidence of the joined
results (SPO++ results enter the evidence when feedback is joined, attributed to the dispatch
version). When ``batch_size`` samples are waiting and learning is not paused: one SAO step,
write the new policy (safetensors in the servers' dtype, a directory per version: full weights, or a
LoRA adapter in PEFT's layout; sha256), record the version
and delete the consumed samples in one transaction, then publish a policy event that every
server replica follows.

A crash at any point loses and duplicates nothing: offsets only move together with the state
they produced; a trajectory id joined once leaves a tombstone so a re-sent copy is ignored; a
version committed but not yet announced is announced again at start.

The database is the truth of the learner's state (docs/design.md §8). A version's directory is written
before its commit but means nothing until then: at load, directories above the database's
latest version are deleted. ``checkpoint.pt`` (tagged with its version) is written only after
the commit (every ``checkpoint_every`` steps, and at a clean stop), and a checkpoint newer than
the database's latest version is ignored. A failure between applying a step in memory and its
commit drops the in-memory models; the next iteration reloads the committed state as a restart
would (``load``). Fault points (``learner.faults``) mark each step of the cycle for the kill -9
harness (tests/test_learner_faults.py).

Nothing stops the loop for good: a join that fails is logged and the rollback and pause
requests are still carried out; a record or a batch that keeps failing is set aside as a dead
letter after ``core.dead_letters.MAX_TRIES`` tries (``learner.joiner``, ``train_step``).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch
from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.engine import Connection, Engine

from core import lifecycle_store
from core.control import (
    GUARD_OFF,
    GUARD_PIN,
    GUARD_VERDICT,
    PAUSED,
    ROLLBACK_TO,
    Flag,
    clear_if,
    get_flag,
    read_flag,
    set_flag,
)
from core.db import (
    LearnerSample,
    LearnerStep,
    PolicyVersion,
    QuarantinedSample,
    make_engine,
    migrate,
)
from core.dead_letters import COUNTER as DEAD_LETTERS
from core.dead_letters import MAX_TRIES, Letter, describe, set_aside
from core.lifecycle import GUARD, LEARNER, Arm, Stage, judge_lineage, lineage
from core.logbus import LogTransport, open_log
from core.policy_store import ADAPTER_FILE, CHECKPOINT_FILE, WEIGHTS_FILE, Layout, layout, version_dir
from core.records import (
    POLICY_KEY,
    TOPIC_POLICY,
    PolicyEvent,
    as_utc,
    utcnow,
)
from core.sequential import Decision
from core.settings import Settings
from core.weights import weights_sha256
from learner.algorithm import Algorithm
from learner.config import LearnerConfig, LoraPolicy
from learner.faults import ReadFaultLog, armed, fault_point
from learner.gate_models import GateReferences
from learner.identity_cap import identity_shares, select_batch
from learner.joiner import Joiner, JoinStats, bump_counter
from learner.registry import build_algorithm
from learner.samples import Sample, collate

log = logging.getLogger(__name__)


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
        # The version whose weights the policy holds: ``version`` unless the newest versions
        # were rejected (the policy went back to an earlier one, docs/guard.md).
        self.weights_version = 0
        self._unannounced = False
        # When the lineage is next evaluated (time.monotonic).
        self._next_check = 0.0
        lora = config.policy if isinstance(config.policy, LoraPolicy) else None
        self.gate_references = GateReferences(self.base_dir, self._path_of, lora)
        # The version whose state checkpoint.pt (or the load) already holds: a clean stop
        # writes one only past it.
        self._durable_version: int | None = None
        # (sample ids, failures) of the batch whose step last failed.
        self._failed_batch: tuple[tuple[str, ...], int] = ((), 0)

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
        kind = self.config.policy.kind
        if state is not None and (state.get("config") or {}).get("policy", {}).get("kind", "full") != kind:
            raise RuntimeError(f"{ckpt} is of another kind of policy than this learner's ({kind})")
        self.version = self.weights_version = 0
        if state is None:
            loaded = algorithm.warm_start(self.policy_dir)
            if loaded is not None:
                log.info("critic: starting from the pretrained %s", loaded)
        else:
            algorithm.load_state_dict(state["learner"])
            self.version = state["version"]
            self.weights_version = state.get("weights_version", state["version"])
        self.algorithm = algorithm
        head = self._head_version()
        if head is not None and head.version != self.weights_version:
            # Versions trained after the last checkpoint, or the checkpoint's weights rejected
            # since: take the newest version not rejected (the critic and optimizer state come
            # from the checkpoint).
            self._load_policy_weights(Path(head.path))
            self.weights_version = head.version
        if latest is not None:
            self.version = max(self.version, latest.version)
        algorithm.on_version(self.version)
        self._durable_version = self.version
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
        """Load the version folder at ``path`` into the policy: its full weights, or with a LoRA
        policy its adapter (the base model's folder, version 0, is the initial adapter, B = 0).

        Raises:
            RuntimeError: the folder's layout is not the learner's (full weights, other than the
                base's, for a LoRA learner, or an adapter for a full one; a policy cannot change
                its kind in one policy directory), or its tensors do not match the model.
        """
        from safetensors.torch import load_file

        found = layout(path)
        if self.algorithm.adapter is not None and found != Layout.ADAPTER:
            if Path(path).resolve() != self.base_dir.resolve():
                raise RuntimeError(f"{path} holds full weights; this learner trains a LoRA adapter")
            self.algorithm.reset_policy_to_base()
            return
        if self.algorithm.adapter is None and found == Layout.ADAPTER:
            raise RuntimeError(f"{path} holds a LoRA adapter; this learner trains the full weights")
        name = ADAPTER_FILE if found == Layout.ADAPTER else WEIGHTS_FILE
        weights = {k: v.float() for k, v in load_file(path / name).items()}
        try:
            missing, unexpected = self.algorithm.load_policy_weights(weights)
        except ValueError as exc:
            raise RuntimeError(f"the adapter at {path} does not match the policy's: {exc}") from exc
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise RuntimeError(f"policy weights at {path} do not match the model: {missing} {unexpected}")

    def _latest_version(self):
        with self.db.connect() as conn:
            return conn.execute(
                select(*PolicyVersion.__table__.columns).order_by(PolicyVersion.version.desc()).limit(1)
            ).first()

    def _head_version(self):
        """The newest version not rejected: the one whose weights the policy trains on."""
        with self.db.connect() as conn:
            return conn.execute(
                select(*PolicyVersion.__table__.columns)
                .where(PolicyVersion.lifecycle != Stage.REJECTED.value)
                .order_by(PolicyVersion.version.desc())
                .limit(1)
            ).first()

    def _promoted_version(self):
        """The promoted version's row: the newest one whose stage is ``promoted``."""
        with self.db.connect() as conn:
            return conn.execute(
                select(*PolicyVersion.__table__.columns)
                .where(PolicyVersion.lifecycle == Stage.PROMOTED.value)
                .order_by(PolicyVersion.version.desc())
                .limit(1)
            ).first()

    def _record_base_version(self) -> None:
        now = utcnow()
        with self.db.begin() as conn:
            conn.execute(
                insert(PolicyVersion).values(
                    version=0,
                    path=str(self.base_dir.resolve()),
                    sha256=weights_sha256(self.base_dir),
                    status="published",
                    parent_version=None,
                    metrics={},
                    created_at=now,
                    lifecycle=Stage.PROMOTED.value,
                )
            )
            lifecycle_store.record_event(conn, 0, None, Stage.PROMOTED, LEARNER, "the base model", now)

    def _announce(self, row) -> None:
        """Publish the policy event of a committed version (idempotent for servers). A rejected
        version is never announced: no server ever loads it."""
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

        With a LoRA policy the directory holds the adapter alone, in PEFT's layout
        (``core.policy_store``: ``adapter_model.safetensors``, ``adapter_config.json``, written by
        ``learner.lora.Adapter.save``), in the serving dtype too.

        Weights are written in the dtype the servers serve in (``SAOSERVE_DTYPE``). Publishing
        bf16 while the learner keeps fp32 master weights made the served policy differ from
        the one the learner evaluates by 0.13-0.19 nats per token on average (max ~1 nat,
        measured on a 21-step run), which DIS then masks as if it were staleness; with the
        float32 engine and float32 weights they agree to ~1e-4.
        """
        from safetensors.torch import save_file

        out = version_dir(self.policy_dir, version)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        dtype = getattr(torch, self.settings.dtype)
        if self.algorithm.adapter is not None:
            self.algorithm.adapter.save(tmp, dtype)
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
            return out, weights_sha256(out)
        weights = self.algorithm.policy_weights(dtype)
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
        """Delete all but the newest ``keep_versions`` version folders, and never the promoted
        version's (a rejection of the lineage restores its weights)."""
        keep = self.config.keep_versions
        promoted = self._promoted_version()
        spared = f"v{promoted.version:06d}" if promoted is not None else None
        dirs = sorted(
            d
            for d in self.policy_dir.glob("v[0-9]*")
            if d.name[1:].isdigit() and int(d.name[1:]) <= self.version
        )
        for d in dirs[:-keep] if keep > 0 else []:
            if d.name != spared:
                shutil.rmtree(d, ignore_errors=True)

    # ----------------------------------------------------------------- train
    def flag(self, name: str) -> str | None:
        return get_flag(self.db, name)

    def train_step(self) -> dict | None:
        """One step on the oldest ``batch_size`` samples, then publish the new version.

        The step counts as applied only once its version is committed: on any error before
        that, the in-memory models are dropped (``self.algorithm = None``) and the error
        re-raised; ``run`` reloads the committed state before anything else. Samples that do not
        parse are set aside at once, and a batch whose step fails ``MAX_TRIES`` times in a row
        (collating it or the update, not an outage of the commit) is set aside whole (dead
        letters of kind ``untrainable``, ``core.dead_letters``); None is returned then.
        """
        rows, deferred = self._next_batch()
        if rows is None:
            return None
        samples, unreadable = [], []
        for row in rows:
            try:
                samples.append(Sample.from_json(json.loads(row.payload)))
            except (ValueError, TypeError, KeyError) as exc:
                unreadable.append(row)
                error = exc
        if unreadable:
            self._set_aside_samples(unreadable, f"the sample does not parse: {describe(error)}", 1)
            return None
        sample_ids = [r[0] for r in rows]
        try:
            batch = collate(samples, self.version)
            metrics = self._step(batch)
            metrics |= identity_shares([r.identity for r in rows], [smp.reward for smp in samples])
            metrics["identity_deferred"] = deferred
            # The newest sample of the batch, whose feedback completed it (judge.runstats).
            metrics["completing_sample"] = rows[-1].id
            # When that sample was joined (unix s, within a poll of its feedback's receipt): the
            # start of feedback→served, which servers measure (saoserve_feedback_to_served_seconds).
            joined = rows[-1].created_at
            metrics["batch_completed_at"] = (as_utc(joined)).timestamp()
            fault_point("during_step")
            gate = self._run_gate()
        except Exception as exc:
            self.algorithm = None
            if self._step_failed(rows, exc):
                return None
            raise
        except BaseException:
            self.algorithm = None
            raise
        self._failed_batch = ((), 0)
        if gate is not None:
            metrics["gate_reasons"] = gate.reasons
        clean = storable(metrics)
        flat = {k: v for k, v in clean.items() if v is None or isinstance(v, int | float)}
        step = self.algorithm.steps
        parent = self.weights_version
        stage = self._stage_of_new(gate)

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
            lifecycle_store.record_event(
                conn, version, None, Stage.CANDIDATE, LEARNER, f"trained from version {parent}", now
            )
            lifecycle_store.record_event(conn, version, Stage.CANDIDATE, stage, LEARNER, self._why(gate), now)
            if stage == Stage.REJECTED:
                n = lifecycle_store.quarantine(
                    conn, {version: sample_ids}, "trained a version the gate rejected", now
                )
                bump_counter(conn, lifecycle_store.QUARANTINED, n)

        gate_json = None if gate is None else storable(gate.model_dump(mode="json"))
        new_version = self._publish(parent, flat, record_step, stage, gate_json)
        if stage == Stage.REJECTED:
            fault_point("after_gate_reject")
            self._back_to(parent)
            # Never served, never restored: only its figures (in the database) matter.
            shutil.rmtree(version_dir(self.policy_dir, new_version), ignore_errors=True)
            log.warning("version %d rejected by the gate: %s", new_version, "; ".join(gate.reasons))
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

    # ----------------------------------------------------------------- guard
    def guard_on(self) -> bool:
        """Whether the lifecycle runs: on in the config and not turned off by an operator."""
        return self.config.guard.enabled and self.flag(GUARD_OFF) != "1"

    def _stage_of_new(self, gate) -> Stage:
        """The stage a new trained version is recorded with: promoted with the guard off,
        rejected when the gate failed, else canary (probation)."""
        if not self.guard_on():
            return Stage.PROMOTED
        return Stage.REJECTED if gate is not None and not gate.passed else Stage.CANARY

    def _why(self, gate) -> str:
        if not self.guard_on():
            return "the guard is off"
        if gate is None:
            return "no gate configured; on probation"
        if gate.passed:
            return f"gate passed (KL to base {gate.kl_base}, to parent {gate.kl_promoted}); on probation"
        return "gate failed: " + "; ".join(gate.reasons)

    def _run_gate(self):
        """The gate (``learner.gate.run_gate``) on the policy just stepped, against the base and
        the version it was trained from (its parent, serving now); None when the guard is off
        or no gate is configured."""
        cfg = self.config.guard.gate
        if cfg is None or not self.guard_on():
            return None
        from learner.gate import run_gate

        base, parent, tokenizer = self.gate_references.models(self.weights_version)
        reference = self.gate_references.answers(cfg)
        policy = self.algorithm.policy
        training = policy.training
        policy.eval()
        try:
            return run_gate(policy, base, parent, tokenizer, cfg, reference=reference)
        finally:
            policy.train(training)

    def _path_of(self, version: int) -> str:
        with self.db.connect() as conn:
            return conn.execute(
                select(PolicyVersion.path).where(PolicyVersion.version == version)
            ).scalar_one()

    def _back_to(self, version: int) -> None:
        """Put the policy back to ``version``'s published weights (its folder, as a rollback
        loads them) with fresh optimizer moments; an error drops the in-memory models."""
        path = self._path_of(version)
        try:
            self._load_policy_weights(Path(path))
            self.algorithm.reset_policy_optimizer()
        except BaseException:
            self.algorithm = None
            raise
        self.weights_version = version

    def _next_batch(self) -> tuple[list | None, int]:
        """The rows of the next batch and how many samples the identity cap deferred, or
        ``(None, 0)`` while the waiting samples cannot fill one: the oldest ``batch_size``
        samples that are not quarantined (a quarantined sample trained a rejected version:
        never again, docs/guard.md) and that ``learner.identity_cap.select_batch`` admits. The
        cap reads the identities of all waiting samples, and the payloads of the chosen only."""
        n, cap = self.config.batch_size, self.config.max_identity_share
        cols = (LearnerSample.id, LearnerSample.prompt_id, LearnerSample.payload, LearnerSample.created_at)
        pool_query = (
            select(LearnerSample.id, LearnerSample.identity)
            .where(LearnerSample.id.not_in(select(QuarantinedSample.sample_id)))
            .order_by(LearnerSample.created_at, LearnerSample.id)
        )
        with self.db.connect() as conn:
            pool = conn.execute(pool_query if cap is not None else pool_query.limit(n)).all()
            pick = select_batch([r.identity for r in pool], n, cap)
            if not pick.full:
                return None, 0
            ids = [pool[i].id for i in pick.chosen]
            found = conn.execute(select(*cols, LearnerSample.identity).where(LearnerSample.id.in_(ids))).all()
        by_id = {r.id: r for r in found}
        # A sample forgotten or expired between the two reads: the next iteration reads again.
        if len(by_id) < n:
            return None, 0
        return [by_id[i] for i in ids], len(pick.deferred)

    def _step_failed(self, rows, exc: Exception) -> bool:
        """Count a failed step of the batch ``rows``; at the ``MAX_TRIES``-th failure in a row
        of the same batch, set it aside and return True (the caller goes on), else False."""
        ids = tuple(r.id for r in rows)
        tries = self._failed_batch[1] + 1 if self._failed_batch[0] == ids else 1
        self._failed_batch = (ids, tries)
        if tries < MAX_TRIES:
            return False
        self._failed_batch = ((), 0)
        self._set_aside_samples(rows, f"its batch's step failed {tries} times: {describe(exc)}", tries)
        return True

    def _set_aside_samples(self, rows, reason: str, attempts: int) -> None:
        """Delete the samples ``rows`` and write them as dead letters (kind ``untrainable``),
        in one transaction."""
        log.error("set aside %d samples (%s): %s", len(rows), ", ".join(r.id for r in rows[:5]), reason)
        letters = [
            Letter(
                "untrainable", reason, key=r.id, prompt_id=r.prompt_id, payload=r.payload, attempts=attempts
            )
            for r in rows
        ]
        with self.db.begin() as conn:
            conn.execute(delete(LearnerSample).where(LearnerSample.id.in_([r.id for r in rows])))
            bump_counter(conn, DEAD_LETTERS, set_aside(conn, letters, utcnow()))

    def _step(self, batch) -> dict:
        metrics = self.algorithm.step(batch)
        stale = batch.token_staleness[batch.action_mask.bool()]
        metrics["staleness_mean"] = stale.float().mean().item()
        metrics["staleness_max"] = int(stale.max().item())
        metrics["staleness_hist"] = {
            str(int(k)): int(v) for k, v in zip(*torch.unique(stale, return_counts=True), strict=True)
        }
        return metrics

    def _publish(
        self,
        parent: int,
        metrics: dict,
        also: Callable[[Connection, int, object], None],
        stage: Stage = Stage.PROMOTED,
        gate: dict | None = None,
    ) -> int:
        """Write the next version's weights, then commit its row (lifecycle ``stage``, the gate's
        figures ``gate``) together with ``also(conn, version, now)`` in one transaction; returns
        the new version (still to be announced; a rejected one never is).

        Metrics must be storable (``storable``). On any error before the commit the in-memory
        models are dropped (``self.algorithm = None``) and the error re-raised.
        """
        new_version = self.version + 1
        try:
            path, sha = self._write_version(new_version)
            fault_point("after_weights")
            self._commit_version(new_version, path, sha, parent, metrics, also, stage, gate)
        except BaseException:
            self.algorithm = None
            raise
        self.version = new_version
        if stage != Stage.REJECTED:
            self.weights_version = new_version
        self._unannounced = True
        self.algorithm.on_version(new_version)
        fault_point("after_commit")
        return new_version

    def _commit_version(
        self,
        version: int,
        path: Path,
        sha: str,
        parent: int,
        metrics: dict,
        also: Callable,
        stage: Stage = Stage.PROMOTED,
        gate: dict | None = None,
    ) -> None:
        """Record the version (status committed, lifecycle ``stage``) and ``also(conn, version,
        now)`` in one transaction."""
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
                    lifecycle=stage.value,
                    gate=gate,
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
            "weights_version": self.weights_version,
            "learner": self.algorithm.state_dict(),
            "config": self.config.model_dump(mode="json"),
        }
        torch.save(state, tmp)
        tmp.replace(self.policy_dir / CHECKPOINT_FILE)
        self._durable_version = version

    def checkpoint_on_stop(self) -> bool:
        """At a clean stop: write ``checkpoint.pt`` at the last committed version (critic,
        optimizer states, step count), unless the checkpoint or the load already holds it.

        Only when the in-memory models are that version's: a step not committed drops them
        (``self.algorithm`` None), and the database's latest version must be ``self.version``
        (an interrupt between a commit and its bookkeeping leaves them apart: nothing is
        written, the checkpoint never claims a state the database has not committed). Returns
        whether it wrote one; a failure is logged, not raised (the stop goes on).
        """
        if self.algorithm is None or self._durable_version == self.version:
            return False
        try:
            latest = self._latest_version()
            if latest is None or latest.version != self.version:
                log.warning(
                    "no checkpoint at stop: the database is at version %s, the learner at %d",
                    None if latest is None else latest.version,
                    self.version,
                )
                return False
            self._checkpoint(self.version)
        except Exception:
            log.exception("could not write the checkpoint at stop")
            return False
        log.info("checkpoint written at version %d (step %d) on stop", self.version, self.algorithm.steps)
        return True

    def rollback(
        self,
        version: int,
        request: Flag | None = None,
        actor: str = "operator",
        also: Callable[[Connection, int, object], None] | None = None,
    ) -> int | None:
        """Publish a new version whose weights are those of ``version`` (versions stay monotone).

        The new version is recorded ``promoted`` (an operator chose those weights, or the guard
        restores the promoted version's), its event by ``actor``, together with ``also(conn,
        version, now)`` (the guard's rejection of the lineage). A ``rejected`` version is
        refused like an unknown one: it never serves again.

        ``request``: the ``rollback_to`` flag as read when it was taken up (None: read now, and
        taken only if it asks for ``version``).
        The flag is cleared in the commit of the new version only if it still holds that
        request (``core.control.clear_if``): a rollback requested meanwhile is carried out next.
        Optimizer moments are reset: they belong to the abandoned trajectory of updates. An
        unknown ``version``, or one whose weights were pruned, is refused: its request is
        cleared, the ``rollback_refused`` counter bumped and None returned (retrying could never
        succeed). As in ``train_step``, an error before the commit drops the in-memory models.
        After the publish, version folders are pruned to ``keep_versions``.
        """
        seen = request
        if seen is None:
            current = read_flag(self.db, ROLLBACK_TO)
            seen = current if current is not None and current.value == str(version) else None

        def clear(conn: Connection, new_version: int | None = None, now=None) -> None:
            if seen is not None:
                clear_if(conn, ROLLBACK_TO, seen)
            if new_version is not None:
                if also is not None:
                    also(conn, new_version, now)
                reason = f"the weights of version {version} (rollback)"
                lifecycle_store.record_event(conn, new_version, None, Stage.PROMOTED, actor, reason, now)

        with self.db.connect() as conn:
            row = conn.execute(
                select(*PolicyVersion.__table__.columns).where(PolicyVersion.version == version)
            ).first()
        if row is None or row.lifecycle == Stage.REJECTED or layout(row.path) is None:
            log.error("rollback to version %d refused: unknown, rejected, or its weights are gone", version)
            with self.db.begin() as conn:
                clear(conn)
                bump_counter(conn, "rollback_refused", 1)
            return None
        try:
            self._load_policy_weights(Path(row.path))
            self.algorithm.reset_policy_optimizer()
        except BaseException:
            self.algorithm = None
            raise
        new_version = self._publish(version, {"rollback_to": version}, clear)
        fault_point("after_rollback_commit")
        self._announce_latest()
        self._prune()
        log.info("rolled back to version %d: its weights are published as version %d", version, new_version)
        return new_version

    def guard_check(self) -> Decision | None:
        """Evaluate the lineage on probation and carry out the verdict (docs/guard.md, "The
        lifecycle"); returns the decision, None when there was nothing to judge.

        First, a version that serves (announced) but was rejected since (by an operator) is
        rolled back, guard on or off: the promoted version's weights are published as a new
        version. Then, unless
        the guard is off or an operator pinned the promoted version, the lineage's rated answers
        are compared with the promoted versions' (``judge_lineage``): when a canary split served
        the lineage (its answers carry the canary arm), its canary-arm answers against the
        promoted versions' control-arm answers since the lineage started; on probation, all its
        answers against the promoted versions' from before it. Unless that rejects, the health
        veto compares the same arms' shares of sound answers (every answer, rated or not;
        ``guard.min_answer_tokens``) and rejects when the lineage's is surely lower:
        ``promote`` moves every version of the lineage to ``promoted``; ``reject`` moves them to
        ``rejected``, quarantines the samples that trained them and publishes the promoted
        version's weights as a new, promoted version, all in one transaction.
        """
        with self.db.connect() as conn:
            rows = conn.execute(
                select(
                    PolicyVersion.version,
                    PolicyVersion.lifecycle,
                    PolicyVersion.status,
                    PolicyVersion.created_at,
                ).order_by(PolicyVersion.version)
            ).all()
            st = lifecycle_store.stages(conn)
            served = [r for r in rows if r.status == "published"]
            if served and served[-1].lifecycle == Stage.REJECTED:
                self._reject_lineage([], "an operator rejected the version serving")
                return Decision.REJECT
            members = lineage(st)
            if not members or not self.guard_on() or self.flag(GUARD_PIN) is not None:
                return None
            started = next(r.created_at for r in rows if r.version == members[0])
            started = as_utc(started)
            promoted = [v.version for v in st if v.stage == Stage.PROMOTED]
            guard = self.config.guard
            canary = lifecycle_store.rated_rewards(conn, members, arm=Arm.CANARY)
            # A canary split served the lineage: both arms of one window. Probation: against the
            # promoted record from before the lineage.
            split = bool(canary)
            lineage_arm = {"arm": Arm.CANARY} if split else {}
            promoted_arm = (
                {"since": started, "arm": Arm.CONTROL}
                if split
                else {"before": started, "limit": guard.promoted_window}
            )
            elapsed = max((utcnow() - started).total_seconds(), 0.0)
            verdict = judge_lineage(
                lifecycle_store.rated_rewards(conn, members, **lineage_arm),
                lifecycle_store.rated_rewards(conn, promoted, **promoted_arm),
                guard.rule_params(),
                elapsed_s=elapsed,
            )
            if verdict.decision != Decision.REJECT and guard.min_answer_tokens is not None:
                health = judge_lineage(
                    lifecycle_store.answer_health(conn, members, guard.min_answer_tokens, **lineage_arm),
                    lifecycle_store.answer_health(conn, promoted, guard.min_answer_tokens, **promoted_arm),
                    guard.health_params(),
                )
                if health.decision == Decision.REJECT:
                    verdict = replace(health, reason=f"degenerate answers (health veto): {health.reason}")
        self._record_verdict(members, verdict)
        if verdict.decision == Decision.PROMOTE:
            now = utcnow()
            with self.db.begin() as conn:
                for v in members:
                    lifecycle_store.transition(conn, v, Stage.PROMOTED, GUARD, verdict.reason, now)
                fault_point("during_guard_promote")
            fault_point("after_guard_promote")
            self._notify(members, Stage.PROMOTED, GUARD)
            log.info("guard: versions %s promoted: %s", members, verdict.reason)
        elif verdict.decision == Decision.REJECT:
            self._reject_lineage(members, verdict.reason)
        return verdict.decision

    def _record_verdict(self, members: list[int], verdict) -> None:
        """Keep the verdict (bounds, counts, decision) on ``members`` as the ``guard_verdict``
        flag, for /metrics and the dashboard: ``{"lineage": [...], "at": ISO time, **Verdict}``."""
        record = {"lineage": members, "at": utcnow().isoformat()} | asdict(verdict)
        set_flag(self.db, GUARD_VERDICT, json.dumps(storable(record)))

    def _reject_lineage(self, members: list[int], reason: str) -> int | None:
        """Reject ``members``, quarantine the samples of every rejected version after the
        promoted one, and publish the promoted version's weights as a new version, in one
        transaction (``rollback``); returns the new version (None: the rollback was refused)."""
        target = self._promoted_version()

        def also(conn: Connection, new_version: int, now) -> None:
            for v in members:
                lifecycle_store.transition(conn, v, Stage.REJECTED, GUARD, reason, now)
            rejected = [
                v.version
                for v in lifecycle_store.stages(conn)
                if target.version < v.version < new_version and v.stage == Stage.REJECTED
            ]
            trained = lifecycle_store.trained_sample_ids(conn, rejected)
            n = lifecycle_store.quarantine(conn, trained, f"trained the rejected lineage {rejected}", now)
            bump_counter(conn, lifecycle_store.QUARANTINED, n)
            fault_point("during_guard_reject")

        new_version = self.rollback(target.version, actor=GUARD, also=also)
        if new_version is not None:
            self._notify(members, Stage.REJECTED, GUARD)
        log.warning(
            "guard: lineage %s rejected (%s); version %s restores version %d",
            members,
            reason,
            new_version,
            target.version,
        )
        return new_version

    def _notify(self, versions: list[int], stage: Stage, actor: str) -> None:
        """Append the stage notices of ``versions`` to the policy topic
        (``core.lifecycle_store.stage_events``). A failure is logged, not raised: the move is
        committed, and a notice changes nothing served."""
        try:
            with self.db.connect() as conn:
                events = lifecycle_store.stage_events(conn, versions, stage, actor)
            for e in events:
                self.log.append(TOPIC_POLICY, POLICY_KEY, e.to_json())
        except Exception as exc:
            log.warning("stage notices of versions %s (%s) not sent: %s", versions, stage, exc)

    def _guard_tick(self) -> None:
        """``guard_check`` at most every ``guard.check_s`` seconds."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + self.config.guard.check_s
        self.guard_check()

    def _requested_rollback(self) -> bool:
        """Carry out the ``rollback_to`` request if there is one; a value that is not a version
        number is refused like an unknown version."""
        request = read_flag(self.db, ROLLBACK_TO)
        if request is None:
            return False
        try:
            version = int(request.value)
        except ValueError:
            version = -1
        self.rollback(version, request)
        return True

    def _poll(self) -> None:
        """``poll_once``, its failure logged and not raised: whatever the joins do, the control
        flags are read and acted upon, and the samples already joined are trained."""
        try:
            self.poll_once()
        except Exception:
            log.exception("join failed; the learner goes on (the records are read again)")

    def run(self, stop: threading.Event | None = None) -> None:
        """Join and train until ``stop`` is set or ``max_steps`` steps are done.

        Each iteration joins (a failing join is logged, ``_poll``), then carries out a requested
        rollback, or waits while paused, or trains. On a clean stop (``stop`` set, ``max_steps``
        reached, KeyboardInterrupt) the checkpoint is written at the last committed version
        (``checkpoint_on_stop``).
        """
        stop = stop or threading.Event()
        try:
            while not stop.is_set():
                try:
                    if self.algorithm is None:
                        # First start, or a step failed before its commit: the committed state.
                        self.load()
                    elif self._unannounced:
                        self._announce_latest()
                    self._poll()
                    if self._requested_rollback():
                        continue
                    self._guard_tick()
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
        finally:
            self.checkpoint_on_stop()


def run_learner(settings: Settings, config: LearnerConfig, stop: threading.Event | None = None) -> Learner:
    """Migrate, build, and run a learner in this thread (``saoserve learn``)."""
    migrate(settings.resolved_database_url)
    log.info("learner config: %s", config.model_dump_json())
    learner = Learner(settings, config)
    learner.load()
    stop = stop or threading.Event()
    # SIGTERM (docker stop, systemd) is a clean stop, as Ctrl-C is: the loop ends and the
    # checkpoint is written. Only the main thread may set a handler.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set()) if main else None
    try:
        learner.run(stop)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    return learner
