"""Many policies trained in one learner process on one shared frozen base (``saoserve learn
--tenants a,b``; issue 39, item 3; docs/tenants.md, "Many tenants in one learner").

Each policy named (a tenant policy of ``SAOSERVE_TENANT_POLICIES``, or ``global``) gets its own
``TenantLearner``: the unchanged ``learner.process.Learner`` on that policy's namespace
(``Settings.for_tenant``: its database, log and policy folder), so its joins, samples, versions,
evidence, pause flag, rollback requests, guard and checkpoint stay its own, as with one process
per tenant. Only its models differ: they are built on views of one ``learner.shared_base.
SharedBase`` (its LoRA adapter, its critic's adapter and value head, its optimizer states; the
base tensors once for all).

Scheduling (``visit_order``): the learners take turns in rounds. A round visits every policy
once, in the order of the list rotated by one place a round; a visit is one pass of
``Learner.run``'s loop (load or announce, join, a requested rollback, the guard's tick, the pause
flag) and at most one step. A busy tenant therefore takes at most one step per round however much
it has waiting, and a quiet tenant's ready batch waits at most 2(N − 1) other steps (ready just
after its visit as the round's first, it is the next round's last). A paused tenant, or one whose visit failed (its database or log out), is passed over for
that round (a failure: for ``max(poll_s, 2)`` seconds) without holding the others up. A round in
which nobody stepped is followed by a wait of ``poll_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from core.control import PAUSED, get_flag
from core.db import migrate
from core.policies import GLOBAL
from core.settings import Settings
from learner.algo.algorithm import Algorithm
from learner.config import LearnerConfig, LoraPolicy
from learner.process import Learner, prepare_process, run_until_stopped
from learner.shared_base import SharedBase

log = logging.getLogger(__name__)


def visit_order(names: Sequence[str], round_no: int) -> list[str]:
    """The order in which round ``round_no`` (0, 1, …) visits the policies ``names``: the list
    rotated left by ``round_no mod N`` places, so each policy is first once every N rounds.
    ``names`` empty: an empty list. E.g. ``["a", "b", "c"]``, round 4 → ``["b", "c", "a"]``."""
    if not names:
        return []
    k = round_no % len(names)
    return list(names[k:]) + list(names[:k])


def policy_names(settings: Settings, tenants: str | None, every: bool) -> list[str]:
    """The policies ``saoserve learn`` trains in one process: ``tenants`` (comma-separated: tenant
    policies of ``settings.tenant_policies``, or ``global``), or with ``every`` each tenant policy.

    Raises:
        ValueError: both or neither given, a name given twice or not a policy (``Settings.
            for_tenant``'s message), an empty list, or ``every`` with no tenant policy configured.
    """
    if (tenants is None) == (not every):
        raise ValueError("give --tenants A,B or --all-tenants")
    if every:
        if not settings.tenant_policies:
            raise ValueError(
                "--all-tenants: no tenant policy is configured (SAOSERVE_TENANT_POLICIES is empty)"
            )
        return list(settings.tenant_policies)
    names = [t.strip() for t in tenants.split(",") if t.strip()]
    if not names:
        raise ValueError("--tenants names no policy")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--tenants names {', '.join(twice)} more than once")
    for name in names:
        if name != GLOBAL:
            settings.for_tenant(name)
    return names


def namespace_of(settings: Settings, name: str) -> Settings:
    """The settings of policy ``name``'s namespace: ``settings`` for ``global``, else
    ``settings.for_tenant(name)`` (which raises ValueError for a name without a policy)."""
    return settings if name == GLOBAL else settings.for_tenant(name)


class TenantLearner(Learner):
    """A ``Learner`` of policy ``name`` whose models are built on ``base`` (``SharedBase.build``)
    instead of a base of its own; everything else is the ``Learner``'s."""

    def __init__(self, name: str, settings: Settings, config: LearnerConfig, base: SharedBase) -> None:
        super().__init__(settings, config)
        self.name = self.policy_name = name
        self.base = base

    def _build_algorithm(self, load_policy) -> Algorithm:
        """The config's learner on views of the shared base (``SharedBase.build``); the
        ``Learner``'s own loader, ``load_policy``, is not used."""
        return self.base.build(self.config)

    def done(self) -> bool:
        """Whether the config's ``max_steps`` are done (never, without ``max_steps``)."""
        limit = self.config.max_steps
        return limit is not None and self.algorithm is not None and self.algorithm.steps >= limit

    def visit(self) -> bool:
        """One pass of ``Learner.run``'s loop without its waits: load (first visit, or after a
        step failed before its commit) or announce, join (a failed join is logged), carry out a
        requested rollback, or the guard's tick and then, unless paused, at most one step.
        Returns whether it published a version (a step or a rollback). Raises what the loop's
        body raises (an outage of the database or log)."""
        if self.algorithm is None:
            self.load()
        elif self._unannounced:
            self._announce_latest()
        self._poll()
        if self._requested_rollback():
            return True
        self.guard.tick()
        if get_flag(self.db, PAUSED) == "1":
            return False
        return self.train_step() is not None


class TenantLearners:
    """The learners of ``names`` in this process, on one ``SharedBase`` (module docstring).

    Args (constructor):
        settings: the process's settings (the global namespace).
        names: the policies (``policy_names``), in the order of round 0.
        config: the one learner config of them all (a LoRA policy).
        base: the shared base; None: loaded from ``settings.resolved_model_dir``.

    Raises (constructor): ValueError for a full-weights config or a name without a policy.
    """

    def __init__(
        self, settings: Settings, names: Sequence[str], config: LearnerConfig, base: SharedBase | None = None
    ) -> None:
        if not isinstance(config.policy, LoraPolicy):
            raise ValueError("learners on a shared base train LoRA adapters: the config's policy is 'full'")
        self.config = config
        self.base = base or SharedBase.load(settings.resolved_model_dir)
        self.learners = {n: TenantLearner(n, namespace_of(settings, n), config, self.base) for n in names}
        self.round_no = 0
        self._retry_at: dict[str, float] = {}

    def load(self) -> None:
        """Load every learner's committed state (``Learner.load``).

        Raises:
            TenantLoadError: the first policy whose state does not load, with its name and the
                cause (e.g. a state written by a learner of its own, whose critic has a body: the
                two modes' critics differ, docs/tenants.md).
        """
        for name, learner in self.learners.items():
            try:
                learner.load()
            except (ValueError, RuntimeError, OSError) as exc:
                raise TenantLoadError(f"policy {name!r} cannot be loaded: {exc}") from exc

    def run_round(self, stop: threading.Event | None = None) -> int:
        """Visit each policy not done once, in ``visit_order``; returns how many published a
        version (each logged with the policy's name). A paused policy is passed over; a visit that raises is logged with the policy's
        name and that policy passed over for ``max(poll_s, 2)`` seconds."""
        active = [n for n, lrn in self.learners.items() if not lrn.done()]
        order = visit_order(active, self.round_no)
        self.round_no += 1
        published = 0
        for name in order:
            if stop is not None and stop.is_set():
                break
            if time.monotonic() < self._retry_at.get(name, 0.0):
                continue
            learner = self.learners[name]
            try:
                if learner.visit():
                    published += 1
                    # The learner's own lines do not name its policy.
                    log.info(
                        "%s: version %d published", name, learner.version, extra={"version": learner.version}
                    )
            except Exception:
                log.exception("%s: learner visit failed; retrying", name)
                self._retry_at[name] = time.monotonic() + max(self.config.poll_s, 2.0)
        return published

    def run(self, stop: threading.Event | None = None) -> None:
        """Rounds until ``stop`` is set or every policy has done ``max_steps``; a round with no
        version published is followed by a wait of ``poll_s``. At the end each learner writes
        its checkpoint (``Learner.checkpoint_on_stop``, which logs its own failure)."""
        stop = stop or threading.Event()
        try:
            while not stop.is_set() and not all(lrn.done() for lrn in self.learners.values()):
                if self.run_round(stop) == 0:
                    stop.wait(self.config.poll_s)
        finally:
            for learner in self.learners.values():
                learner.checkpoint_on_stop()


class TenantLoadError(RuntimeError):
    """A policy's committed state could not be loaded into the shared-base learner; the message
    names the policy and the cause."""


def run_tenants(
    settings: Settings, names: Sequence[str], config: LearnerConfig, stop: threading.Event | None = None
) -> TenantLearners:
    """Migrate every namespace (and the global one), build and load the learners of ``names`` on one base, and run
    them in this thread (``saoserve learn --tenants``), prepared and stopped as one learner is
    (``learner.process.prepare_process``, ``run_until_stopped``: SIGTERM is a clean stop)."""
    prepare_process(settings, config)
    for name in {GLOBAL, *names}:  # the global database holds the API keys
        migrate(namespace_of(settings, name).resolved_database_url)
    log.info("learner config (policies %s): %s", ", ".join(names), config.model_dump_json())
    learners = TenantLearners(settings, names, config)
    learners.load()
    run_until_stopped(learners.run, stop)
    return learners
