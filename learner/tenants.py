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

Following the list (``--all-tenants``; ``TenantLearners.follow``): the tenant policies are the
global database's list (``core.tenant_store``), read again at the start of every round. A name
added gets a learner built on the shared base as at start (its namespace migrated, its committed
state loaded); a name removed has its checkpoint written (``Learner.checkpoint_on_stop``) and its
learner dropped, which frees its adapter, critic and optimizer states (the base stays). An
explicit ``--tenants`` list stays fixed.
"""

from __future__ import annotations

import functools
import gc
import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from core import tenant_store
from core.control import PAUSED, get_flag
from core.db import make_engine, migrate
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


def policy_names(settings: Settings, tenants: str | None, every: bool) -> list[str] | None:
    """The policies ``saoserve learn`` trains in one process: ``tenants`` (comma-separated: tenant
    policies of ``settings.tenant_policies``, or ``global``), or with ``every`` None: the global
    database's list, followed while the process runs (``TenantLearners.follow``).

    Raises:
        ValueError: both or neither given, a name given twice or not a policy (``Settings.
            for_tenant``'s message), or an empty list.
    """
    if (tenants is None) == (not every):
        raise ValueError("give --tenants A,B or --all-tenants")
    if every:
        return None
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


def listed_namespace(settings: Settings, name: str) -> Settings:
    """The settings of tenant policy ``name``'s namespace when the name comes from the database's
    list (``core.tenant_store``) rather than ``settings.tenant_policies``. Raises ValueError as
    ``Settings.for_tenant`` does for a database or log that cannot hold a namespace."""
    return settings.model_copy(update={"tenant_policies": [name]}).for_tenant(name)


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

    def close(self) -> None:
        """Drop the models (adapter, critic, optimizer states: the shared base is not the
        learner's), close the log and dispose of the database engines."""
        self.algorithm = None
        self.log.close()
        if self.keys_db is not self.db:
            self.keys_db.dispose()
        self.db.dispose()


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
        self.settings = settings
        self.listed: Callable[[], list[str]] | None = None

    def follow(self, listed: Callable[[], list[str]]) -> None:
        """From the next round on, train the tenant policies ``listed()`` returns (the global
        database's list, ``core.tenant_store.read``), read at the start of each round
        (``refresh``)."""
        self.listed = listed

    def refresh(self) -> None:
        """Bring the learners to the list (``follow``): drop each learner whose name left it
        (``drop``), build and load one for each name that joined it (``add``). A list that cannot
        be read is logged and the learners stay as they are; a policy that cannot be built or
        loaded is logged with its name and tried again after ``max(poll_s, 2)`` seconds."""
        try:
            names = self.listed()
        except Exception as exc:
            log.warning(
                "the list of tenant policies could not be read (%s); the learners stay as they are", exc
            )
            return
        for name in [n for n in self.learners if n not in names]:
            self.drop(name)
        for name in names:
            if name in self.learners or time.monotonic() < self._retry_at.get(name, 0.0):
                continue
            try:
                self.add(name)
            except Exception as exc:
                log.error(
                    "%s: tenant policy added, but its learner could not be built: %s; retrying", name, exc
                )
                self._retry_at[name] = time.monotonic() + max(self.config.poll_s, 2.0)

    def add(self, name: str) -> TenantLearner:
        """Build tenant policy ``name``'s learner on the shared base as at start (its namespace
        migrated, its committed state loaded) and add it last in the rounds' list. Raises what
        ``migrate``, the ``Learner`` or its load raise; nothing is added then."""
        settings = listed_namespace(self.settings, name)
        migrate(settings.resolved_database_url)
        learner = TenantLearner(name, settings, self.config, self.base)
        try:
            learner.load()
        except BaseException:
            learner.close()
            raise
        self.learners[name] = learner
        self._retry_at.pop(name, None)
        log.info("%s: tenant policy added: learner built at version %d", name, learner.version)
        return learner

    def drop(self, name: str) -> None:
        """Write policy ``name``'s checkpoint (``Learner.checkpoint_on_stop``, which logs its own
        failure), then drop its learner and free what it held (its adapter, critic and optimizer
        states; memory returned to the device's allocator on a GPU)."""
        learner = self.learners.pop(name)
        self._retry_at.pop(name, None)
        learner.checkpoint_on_stop()
        learner.close()
        del learner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        log.info("%s: tenant policy removed: learner checkpointed and dropped", name)

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
        name and that policy passed over for ``max(poll_s, 2)`` seconds. Following the list, the
        learners are brought to it first (``refresh``)."""
        if self.listed is not None:
            self.refresh()
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
            # Following the list, an empty list (every tenant removed) waits for a name.
            while not stop.is_set() and not (
                self.learners and all(lrn.done() for lrn in self.learners.values())
            ):
                if self.run_round(stop) == 0:
                    stop.wait(self.config.poll_s)
        finally:
            for learner in self.learners.values():
                learner.checkpoint_on_stop()


class TenantLoadError(RuntimeError):
    """A policy's committed state could not be loaded into the shared-base learner; the message
    names the policy and the cause."""


def run_tenants(
    settings: Settings,
    names: Sequence[str] | None,
    config: LearnerConfig,
    stop: threading.Event | None = None,
) -> TenantLearners:
    """Migrate every namespace (and the global one), build and load the learners of ``names`` on one base, and run
    them in this thread (``saoserve learn --tenants``), prepared and stopped as one learner is
    (``learner.process.prepare_process``, ``run_until_stopped``: SIGTERM is a clean stop).

    ``names`` None (``--all-tenants``): the global database's list of tenant policies, seeded
    from ``settings.tenant_policies`` (``core.tenant_store.seed``) and followed while it runs
    (``TenantLearners.follow``)."""
    prepare_process(settings, config)
    migrate(settings.resolved_database_url)  # the global database holds the API keys and the list
    listed = None
    if names is None:
        global_db = make_engine(settings.resolved_database_url)
        tenant_store.seed(global_db, settings.tenant_policies)
        listed = functools.partial(tenant_store.read, global_db)
        names = listed()
        settings = settings.model_copy(update={"tenant_policies": list(names)})
    for name in names:
        migrate(namespace_of(settings, name).resolved_database_url)
    shown = ", ".join(names) or "none yet"
    log.info(
        "learner config (policies %s%s): %s",
        shown,
        ", following the list" * (listed is not None),
        config.model_dump_json(),
    )
    learners = TenantLearners(settings, names, config)
    learners.load()
    if listed is not None:
        learners.follow(listed)
    run_until_stopped(learners.run, stop)
    return learners
