"""The learner process (``saoserve learn``): join, train, publish (docs/design.md §3, §8).

Loop: read new trajectory and feedback records from the stored offsets; join them (by
trajectory id, or by episode id for multi-turn episodes); in ONE database transaction commit
the new offsets, the pending joins, the produced samples and the prompt evidence of the joined
results (SPO++ results enter the evidence when feedback is joined, attributed to the dispatch
version; ``learner.data.joiner``). When ``batch_size`` samples are waiting (``learner.data.sample_queue``)
and learning is not paused: one step of the configured algorithm, what it commits planned
(``learner.step_plan``), the new policy written, committed with the deletion of the consumed
samples in one transaction, then announced on the policy topic that every server replica
follows (``learner.publish``). The guard gates each new version and judges the lineage on
probation (``learner.guard.guard``); a rollback publishes an earlier version's weights as a new
version (``learner.guard.rollback``).

A crash at any point loses and duplicates nothing: offsets only move together with the state
they produced; a trajectory id joined once leaves a tombstone so a re-sent copy is ignored; a
version committed but not yet announced is announced again at start.

The database is the truth of the learner's state (docs/design.md §8): the ``Learner`` owns the
version counter and the in-memory models, and they only move past a commit. At load, version
folders the database does not know are deleted and a checkpoint ahead of it is ignored
(``learner.resume``); ``checkpoint.pt`` is written only after a commit (every
``checkpoint_every`` steps, and at a clean stop). A failure between applying a step in memory
and its commit drops the in-memory models; the next iteration reloads the committed state as a
restart would (``load``). Fault points (``learner.faults``) mark each step of the cycle for the
kill -9 harness (tests/system/test_learner_faults.py).

Nothing stops the loop for good: a join that fails is logged and the rollback and pause
requests are still carried out; a record or a batch that keeps failing is set aside as a dead
letter after ``core.dead_letters.MAX_TRIES`` tries (``learner.data.joiner``, ``train_step``).
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from sqlalchemy import delete, insert
from sqlalchemy.engine import Connection, Engine

from core import lifecycle_store, telemetry
from core.control import PAUSED, Flag, get_flag
from core.db import LearnerSample, LearnerStep, bump_counter, make_engine, migrate
from core.dead_letters import MAX_TRIES, describe
from core.hardware import bf16_warning
from core.lifecycle import LEARNER, Stage
from core.logbus import LogTransport, open_log
from core.policy_store import version_dir, version_dirs
from core.sequential import Decision
from core.settings import Settings
from learner import publish, resume
from learner.algo.algorithm import Algorithm
from learner.algo.registry import build_algorithm
from learner.config import LearnerConfig, LoraPolicy
from learner.data import sample_queue
from learner.data.joiner import Joiner, JoinStats
from learner.data.samples import Sample, collate
from learner.faults import ReadFaultLog, armed, fault_point
from learner.guard import rollback
from learner.guard.gate_models import GateReferences
from learner.guard.guard import Guard
from learner.guard.guard_votes import Electorate, warn_vote_cap_scope
from learner.publish import AlsoCommit
from learner.step_plan import StepPlan, Trained, plan_step

log = logging.getLogger(__name__)


class Learner:
    """One learner per policy. Not thread-safe: one loop drives it.

    ``algorithm`` is the ``learner.algo.algorithm.Algorithm`` the config names, None until ``load``
    (and after a step failed before its commit). ``version`` is the database's latest version
    as this learner committed or loaded it; ``guard`` its ``learner.guard.guard.Guard``.
    ``policy_name``: the policy its trace spans name (None: ``core.telemetry.configure``'s).
    """

    policy_name: str | None = None

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
        # The API keys' database: the global one, also for a tenant namespace's learner.
        same = settings.keys_database_url == settings.resolved_database_url
        self.keys_db = self.db if same else make_engine(settings.keys_database_url)
        self.joiner = Joiner(self.log, self.db, config.expire_s, self.keys_db)
        self.policy_dir = Path(settings.resolved_policy_dir)
        self.base_dir = Path(settings.resolved_model_dir)
        self.run_id = uuid.uuid4().hex[:12]
        self.algorithm: Algorithm | None = None
        self.version = 0
        # The version whose weights the policy holds: ``version`` unless the newest versions
        # were rejected (the policy went back to an earlier one, docs/guard.md).
        self.weights_version = 0
        self._unannounced = False
        lora = config.policy if isinstance(config.policy, LoraPolicy) else None
        references = GateReferences(self.base_dir, partial(publish.version_path, self.db), lora)
        voters = Electorate.of(config.guard.vote_identity_share, config.batch_size, config.guard.vote_cap)
        warn_vote_cap_scope(config.guard)
        # Without the KL anchor there is no reference to measure a drift against.
        probe = self.measure_drift if config.has_kl_anchor else None
        self.guard = Guard(
            self.db,
            self.log,
            config.guard,
            references,
            self.rollback,
            voters,
            self.keep_state,
            self.keys_db,
            probe,
        )
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
        """How many samples wait to train (``learner.data.sample_queue.waiting``)."""
        return sample_queue.waiting(self.db)

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

        latest = publish.latest_version(self.db)
        algorithm = self._build_algorithm(load_policy)
        committed = latest.version if latest is not None else 0
        resume.discard_uncommitted(self.policy_dir, committed)
        state = resume.newest_state(
            self.policy_dir,
            committed,
            self.config.policy,
            self._rejected,
            self._read_checkpoint(committed),
        )
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
        head = publish.head_version(self.db)
        if head is not None and head.version != self.weights_version:
            # Versions trained after the last checkpoint, or the checkpoint's weights rejected
            # since: take the newest version not rejected (the critic and optimizer state come
            # from the checkpoint).
            resume.load_policy_weights(algorithm, Path(head.path), self.base_dir)
            self.weights_version = head.version
        if latest is not None:
            self.version = max(self.version, latest.version)
        algorithm.on_version(self.version)
        self._durable_version = self.version
        if latest is None:
            publish.record_base_version(self.db, self.base_dir)
        elif latest.status != "published":
            publish.announce(self.db, self.log, latest)
        if committed == 0 and state is None:
            # The base's learner state (fresh or warm-started critic, fresh optimizers): what a
            # rollback to version 0 restores. Written again at each start before the first step,
            # so a policy folder reused with a new database holds this start's, not an old one's.
            self._write_state(0, algorithm)

    def _rejected(self, version: int) -> bool:
        """Whether the database records ``version`` as rejected (or does not know it)."""
        row = publish.version_row(self.db, version)
        return row is None or row.lifecycle == Stage.REJECTED

    def keep_state(self, version: int) -> None:
        """Keep the learner's whole state as ``version``'s (``learner.resume.write_state``) if
        the policy holds that version's weights and none is kept yet: called for the promoted
        version at each guard check and at the first start, so a rollback to it restores the
        critic, the optimizers, the step count and the baselines, not only the weights."""
        if self.algorithm is None or version != self.weights_version:
            return
        if resume.state_path(self.policy_dir, version).is_file():
            return
        if self._write_state(version, self.algorithm):
            log.info("learner state of the promoted version %d kept", version)

    def _write_state(self, version: int, algorithm: Algorithm) -> bool:
        """Keep ``algorithm``'s whole state as ``version``'s (``learner.resume.write_state``);
        False where this learner keeps none (``learner.distributed.RankedLearner``)."""
        resume.write_state(self.policy_dir, version, algorithm, self.config)
        return True

    def _read_state(self, version: int) -> dict | None:
        """The state kept as ``version``'s (``learner.resume.read_state``), None if none."""
        return resume.read_state(self.policy_dir, version)

    def _build_algorithm(self, load_policy) -> Algorithm:
        """The algorithm of the config, its models from ``load_policy`` (``learner.algo.registry``;
        with N ranks ``learner.distributed.RankedLearner`` builds it on every rank)."""
        return build_algorithm(self.config, load_policy)

    def _read_checkpoint(self, committed: int) -> dict | None:
        """The checkpoint's state at most at version ``committed`` (``learner.resume.read_checkpoint``;
        with N ranks the sharded one, ``learner.distributed``), None when there is none."""
        return resume.read_checkpoint(self.policy_dir, committed, self.config.policy)

    def _restore(self, path: Path) -> None:
        """Put the policy on the weights of the version folder at ``path``
        (``learner.resume.load_policy_weights``), with fresh optimizer moments: they belong to
        the abandoned trajectory of updates. An error drops the in-memory models."""
        try:
            resume.load_policy_weights(self.algorithm, path, self.base_dir)
            self.algorithm.reset_policy_optimizer()
        except BaseException:
            self.algorithm = None
            raise

    def _restore_state(self, state: dict) -> None:
        """Put the whole learner on a kept state (``learner.resume.write_state``): policy,
        critic, both optimizers, step count, baselines. An error drops the in-memory models."""
        try:
            self.algorithm.load_state_dict(state)
        except BaseException:
            self.algorithm = None
            raise

    # --------------------------------------------------------------- publish
    def _publish(
        self,
        version: int,
        parent: int,
        metrics: dict,
        also: AlsoCommit,
        stage: Stage = Stage.PROMOTED,
        gate: dict | None = None,
    ) -> None:
        """Write the policy as the folder of ``version`` (``learner.publish.write_version``, in the
        servers' dtype ``SAOSERVE_DTYPE``), then commit its row (lifecycle ``stage``, the gate's
        figures ``gate``) together with ``also(conn, version, now)`` in one transaction
        (``learner.publish.commit_version``); the version is still to be announced (a rejected
        one never is). ``version`` is the next one, ``self.version + 1``.

        Metrics must be storable (``storable``). On any error before the commit the in-memory
        models are dropped (``self.algorithm = None``) and the error re-raised.
        """
        try:
            dtype = getattr(torch, self.settings.dtype)
            path, sha = publish.write_version(self.algorithm, self.policy_dir, self.base_dir, version, dtype)
            fault_point("after_weights")
            publish.commit_version(self.db, version, path, sha, parent, metrics, also, stage, gate)
        except BaseException:
            self.algorithm = None
            raise
        self.version = version
        if stage != Stage.REJECTED:
            self.weights_version = version
        self._unannounced = True
        self.algorithm.on_version(version)
        fault_point("after_commit")

    def _announce_latest(self) -> None:
        publish.announce(self.db, self.log, publish.latest_version(self.db))
        self._unannounced = False

    def _prune(self) -> None:
        publish.prune(self.db, self.policy_dir, self.config.keep_versions, self.version)
        # A kept state goes with its version's folder; the base's (version 0) stays.
        folders = {v for v, _ in version_dirs(self.policy_dir)}
        resume.prune_states(self.policy_dir, folders | {0})

    def _checkpoint(self, version: int) -> None:
        """Replace ``checkpoint.pt`` with the state of ``version``; call only once it is committed."""
        resume.write_checkpoint(self.policy_dir, version, self.weights_version, self.algorithm, self.config)
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
            latest = publish.latest_version(self.db)
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

    # ----------------------------------------------------------------- train
    def train_step(self) -> dict | None:
        """One step on the oldest ``batch_size`` samples, then publish the new version.

        Batch → step → gate → plan (``learner.step_plan.plan_step``: the version, its stage,
        its events, quarantine, what follows) → one transaction (``_publish``) → after the
        commit: back to the parent's weights if the gate rejected it, announce, checkpoint,
        prune. Returns the step's metrics.

        The step counts as applied only once its version is committed: on any error before
        that, the in-memory models are dropped (``self.algorithm = None``) and the error
        re-raised; ``run`` reloads the committed state before anything else. Samples that do not
        parse are set aside at once, and a batch whose step fails ``MAX_TRIES`` times in a row
        (collating it, the update, the gate or its plan, not an outage of the commit) is set
        aside whole (dead letters of kind ``untrainable``, ``core.dead_letters``); None is
        returned then.
        """
        rows, deferred = self._next_batch()
        if rows is None:
            return None
        samples = self._parse_batch(rows)
        if samples is None:
            return None
        step_started_ns = time.time_ns()  # the step's span (core.telemetry.trained)
        try:
            plan = self._step_and_plan(rows, samples, deferred)
        except Exception as exc:
            self.algorithm = None
            if self._step_failed(rows, exc):
                return None
            raise
        except BaseException:
            self.algorithm = None
            raise
        self._failed_batch = ((), 0)
        publish_started_ns = time.time_ns()
        also = partial(self._record_step, plan)
        self._publish(plan.version, plan.parent, plan.version_metrics, also, plan.stage, plan.gate)
        if plan.back_to is not None:
            self._unserve(plan)
        # Announced before the checkpoint is written (seconds, every checkpoint_every-th step):
        # servers need only the committed version, and a restart takes the policy's weights from
        # the database's latest version whether or not the checkpoint caught up.
        self._announce_latest()
        trained = [(r.id, r.created_at) for r in rows]
        telemetry.trained(
            plan.version, plan.parent, trained, step_started_ns, publish_started_ns, self.policy_name
        )
        if plan.checkpoint:
            self._checkpoint(plan.version)
            fault_point("after_checkpoint")
        self._prune()
        _log_step(plan)
        return plan.metrics

    def _step_and_plan(self, rows, samples: list[Sample], deferred: int) -> StepPlan:
        """Step on the batch ``rows`` (parsed: ``samples``; ``deferred``: how many the identity
        cap held back), run the gate on the stepped policy, and plan what the step commits
        (``learner.step_plan.plan_step``). Nothing is written; raises what they raise."""
        metrics = self._step(collate(samples, self.version))
        fault_point("during_step")
        gate = self._run_gate()
        trained = Trained(
            metrics,
            tuple(r.id for r in rows),
            tuple(r.identity for r in rows),
            tuple(smp.reward for smp in samples),
            deferred,
            rows[-1].created_at,
            self.algorithm.steps,
        )
        on = self.guard.on()
        return plan_step(trained, gate, on, self.version, self.weights_version, self.config.checkpoint_every)

    def _unserve(self, plan: StepPlan) -> None:
        """After the commit of a version the gate rejected: the policy back to ``plan.back_to``'s
        weights, and the version's folder deleted (never served, never restored: only its
        figures, in the database, matter)."""
        fault_point("after_gate_reject")
        self._back_to(plan.back_to)
        shutil.rmtree(version_dir(self.policy_dir, plan.version), ignore_errors=True)
        reasons = "; ".join(plan.metrics["gate_reasons"])
        log.warning("version %d rejected by the gate: %s", plan.version, reasons)

    def _parse_batch(self, rows) -> list[Sample] | None:
        """The samples of the batch ``rows``; None when one does not parse: those that do not
        are set aside at once (dead letters of kind ``untrainable``), the others wait."""
        samples, unreadable = [], []
        for row in rows:
            try:
                samples.append(Sample.from_json(json.loads(row.payload)))
            except (ValueError, TypeError, KeyError) as exc:
                unreadable.append(row)
                error = exc
        if unreadable:
            sample_queue.set_aside_samples(
                self.db, unreadable, f"the sample does not parse: {describe(error)}", 1
            )
            return None
        return samples

    def _record_step(self, plan: StepPlan, conn: Connection, version: int, now) -> None:
        """What the step's commit writes beside its version's row (``plan``; an ``AlsoCommit``):
        the consumed samples' deletion, the step's row (with their ids), the lifecycle events,
        and the quarantine of a rejected version's samples."""
        conn.execute(delete(LearnerSample).where(LearnerSample.id.in_(plan.sample_ids)))
        conn.execute(
            insert(LearnerStep).values(
                run_id=self.run_id, step=plan.step, version=version, metrics=plan.step_metrics, created_at=now
            )
        )
        for before, after, why in plan.events:
            lifecycle_store.record_event(conn, version, before, after, LEARNER, why, now)
        if plan.quarantine is not None:
            n = lifecycle_store.quarantine(conn, {version: list(plan.sample_ids)}, plan.quarantine, now)
            bump_counter(conn, lifecycle_store.QUARANTINED, n)

    def _next_batch(self):
        """The rows of the next batch and how many samples the identity cap deferred
        (``learner.data.sample_queue.next_batch``), or ``(None, 0)`` while none is full."""
        return sample_queue.next_batch(
            self.db, self.config.batch_size, self.config.max_identity_share, self.keys_db
        )

    def _step(self, batch) -> dict:
        started = time.time()
        metrics = self.algorithm.step(batch)
        # Unix s: with step_time_s, where the step sat between its batch's join and its commit.
        metrics["step_started_at"] = started
        stale = batch.token_staleness[batch.action_mask.bool()]
        metrics["staleness_mean"] = stale.float().mean().item()
        metrics["staleness_max"] = int(stale.max().item())
        metrics["staleness_hist"] = {
            str(int(k)): int(v) for k, v in zip(*torch.unique(stale, return_counts=True), strict=True)
        }
        return metrics

    def _step_failed(self, rows, exc: Exception) -> bool:
        """Count a failed step of the batch ``rows``; at the ``MAX_TRIES``-th failure in a row
        of the same batch, set it aside and return True (the caller goes on), else False."""
        ids = tuple(r.id for r in rows)
        tries = self._failed_batch[1] + 1 if self._failed_batch[0] == ids else 1
        self._failed_batch = (ids, tries)
        if tries < MAX_TRIES:
            return False
        self._failed_batch = ((), 0)
        reason = f"its batch's step failed {tries} times: {describe(exc)}"
        sample_queue.set_aside_samples(self.db, rows, reason, tries)
        return True

    def _run_gate(self):
        """The gate on the policy just stepped, against the version it was trained from
        (``learner.guard.guard.Guard.run_gate``); None when the guard is off or no gate is configured."""
        return self.guard.run_gate(self.algorithm.policy, self.weights_version)

    def _back_to(self, version: int) -> None:
        """Put the policy back to ``version``'s published weights (its folder, as a rollback
        loads them) with fresh optimizer moments; an error drops the in-memory models."""
        self._restore(Path(publish.version_path(self.db, version)))
        self.weights_version = version

    # ------------------------------------------------------- rollback, guard
    def rollback(
        self,
        version: int,
        request: Flag | None = None,
        actor: str = "operator",
        also: AlsoCommit | None = None,
    ) -> int | None:
        """Publish a new version whose weights are those of ``version`` (``learner.guard.rollback``).

        The new version is recorded ``promoted``, its event by ``actor``, together with
        ``also(conn, version, now)`` (the guard's rejection of the lineage). ``request``: the
        ``rollback_to`` flag as read when it was taken up (None: read now, and taken only if it
        asks for ``version``); it is cleared in the new version's commit only if it still holds
        that request. Optimizer moments are reset. A version unknown, rejected, or whose weights
        were pruned is refused: its request is cleared, the ``rollback_refused`` counter bumped
        and None returned (retrying could never succeed). As in ``train_step``, an error before
        the commit drops the in-memory models. After the publish, version folders are pruned to
        ``keep_versions``.
        """
        order = rollback.Order.take(self.db, version, request, actor, also)
        row = rollback.restorable(self.db, version)
        if row is None:
            order.refuse(self.db)
            return None
        kept = self._read_state(version)
        if kept is None:
            log.warning(
                "no learner state kept for version %d: its weights only, fresh optimizer moments", version
            )
            self._restore(Path(row.path))
        else:
            self._restore_state(kept["learner"])
        # The restored state is the new version's, kept before its commit: a crash right after
        # the commit resumes from it (learner.resume.newest_state), not from the rejected
        # lineage's checkpoint.
        new_version = self.version + 1
        try:
            self._write_state(new_version, self.algorithm)
        except BaseException:
            self.algorithm = None
            raise
        self._publish(new_version, version, {"rollback_to": version}, order.commit)
        fault_point("after_rollback_commit")
        self._announce_latest()
        self._prune()
        log.info("rolled back to version %d: its weights are published as version %d", version, new_version)
        return new_version

    def _requested_rollback(self) -> bool:
        """Carry out the ``rollback_to`` request if there is one (``learner.guard.rollback.requested``:
        a value that is not a version number is refused like an unknown version)."""
        found = rollback.requested(self.db)
        if found is None:
            return False
        version, request = found
        self.rollback(version, request)
        return True

    def measure_drift(self, version: int) -> float | None:
        """The drift veto's figure of ``version``, the newest of a lineage the guard is about to
        promote (``learner.guard.guard.DriftProbe``; docs/guard.md, "The drift veto"): the
        policy's KL to the base (``Algorithm.reference_kl``: the KL anchor's k3 estimate over
        the action tokens, nats per token, no gradient, every rank taking part) on the next batch
        ``train_step`` would train, taken without consuming it: samples no version has trained
        on (a step's commit deletes its samples). None when it cannot now: no batch is full, a
        sample of it does not parse (``train_step`` sets it aside), or the policy does not hold
        ``version``'s weights (the loop's policy is the lineage's newest version; a step that
        failed before its commit dropped the models until the next iteration reloads them)."""
        if self.algorithm is None or version != self.weights_version:
            return None
        rows, _ = self._next_batch()
        if rows is None:
            return None
        try:
            samples = [Sample.from_json(json.loads(r.payload)) for r in rows]
        except (ValueError, TypeError, KeyError):
            return None
        return self.algorithm.reference_kl(collate(samples, self.version))

    def guard_check(self) -> Decision | None:
        """Judge the lineage on probation and carry out the verdict now
        (``learner.guard.guard.Guard.check``); the decision, None when there was nothing to judge."""
        return self.guard.check()

    # ------------------------------------------------------------------ loop
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
        rollback, or lets the guard judge (``learner.guard.guard.Guard.tick``), or waits while paused,
        or trains. On a clean stop (``stop`` set, ``max_steps`` reached, KeyboardInterrupt) the
        checkpoint is written at the last committed version (``checkpoint_on_stop``).
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
                    self.guard.tick()
                    if get_flag(self.db, PAUSED) == "1":
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


def _log_step(plan: StepPlan) -> None:
    """Log the step of ``plan``: its version and headline figures."""
    m = plan.metrics
    log.info(
        "version %d: reward %.3f kept %.3f EV %s loss %.4f (%.1fs)",
        plan.version,
        m["reward_mean"],
        m["kept_fraction"],
        m.get("explained_variance"),
        m["policy_loss"],
        m["step_time_s"],
        extra={"version": plan.version},
    )


def run_learner(
    settings: Settings,
    config: LearnerConfig,
    stop: threading.Event | None = None,
    make_learner: Callable[[Settings, LearnerConfig], Learner] = Learner,
) -> Learner:
    """Migrate, build (``make_learner``: rank 0's ``learner.distributed.RankedLearner`` with N
    ranks), and run a learner in this thread (``saoserve learn``), on
    ``settings.learner_threads`` torch threads where that is set (``core.cores``)."""
    prepare_process(settings, config)
    migrate(settings.resolved_database_url)
    log.info("learner config: %s", config.model_dump_json())
    learner = make_learner(settings, config)
    learner.load()
    run_until_stopped(learner.run, stop)
    return learner


def prepare_process(settings: Settings, config: LearnerConfig) -> None:
    """What a learner process does before it builds its models: ``settings.learner_threads``
    torch threads where that is set (``core.cores``), and the warning of a bf16 config on a CPU
    without bf16 units (``core.hardware.bf16_warning``)."""
    if settings.learner_threads is not None:
        torch.set_num_threads(settings.learner_threads)
    if config.bf16 or config.autocast_bf16:
        warning = bf16_warning("the learner's models")
        if warning:
            log.warning("%s", warning)


def run_until_stopped(run: Callable[[threading.Event], None], stop: threading.Event | None) -> None:
    """``run(stop)`` in this thread, with SIGTERM (docker stop, systemd) a clean stop as Ctrl-C
    is: the loop ends and the checkpoints are written. Only the main thread may set a handler,
    so elsewhere only ``stop`` ends it (None: a new event)."""
    stop = stop or threading.Event()
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set()) if main else None
    try:
        run(stop)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
