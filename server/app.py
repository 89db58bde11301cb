"""The HTTP server: OpenAI-compatible chat on the policy engine, feedback, admin routes.

Every chat request that reaches generation yields exactly one trajectory record, durable in
the log before the client receives its last byte (docs/design.md §4). FastAPI/pydantic do the HTTP
and validation work; the engine, the log and the database are injected so tests can share
one vLLM engine between apps with different log backends. The routes live in one package per
API family, as vLLM's server is organised (``server.chat``, ``server.feedback``, ``server.admin``,
``server.ops``: each with its ``api_router``, its ``protocol``...), the error shape and its
handlers in ``server.errors``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Iterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from core import tenant_store
from core.db import make_engine, migrate
from core.evidence_store import EvidenceStore
from core.forget import finish_pending
from core.logbus import LogTransport, open_log
from core.policies import GLOBAL
from core.records import FrozenBaseline, utcnow
from core.retention import sql_log_engine
from core.settings import AdapterServing, Settings, adapter_slots, get_settings, tenant_policy_limit
from server.admin import api_router as admin
from server.admin import keys_router as keys
from server.admin import lifecycle_router as lifecycle
from server.admin import tenants_router as tenant_policies
from server.auth import authenticate
from server.backpressure import Backpressure
from server.canary import CanaryRouter
from server.chat import api_router as chat
from server.chat.serving import ChatHandler
from server.engine import PolicyEngine, TenantPolicyRefused
from server.errors import install_error_handlers
from server.fate import Fate
from server.feedback import api_router as feedback
from server.health import Health
from server.limits import BodySizeLimit, max_body_bytes
from server.metrics import ServerMetrics, TenantPolicyMetrics
from server.ops import api_router as ops
from server.policy_watch import PolicyWatcher
from server.spool import Spool, WriteJournal
from server.state import BaselineReader, ServerState
from server.store import ServerStore

log = logging.getLogger(__name__)


def create_app(
    settings: Settings | None = None,
    engine: PolicyEngine | None = None,
    log_transport: LogTransport | None = None,
    read_baseline: BaselineReader | None = None,
    watch_policy: bool = True,
) -> FastAPI:
    """The FastAPI app. Without ``engine`` it starts (and stops) its own vLLM engine.

    One ``ServerState`` per policy (``open_policy``): the global policy's (``app.state.s``,
    ``app.state.chat``; ``log_transport`` and ``read_baseline`` replace its log and evidence
    reader) and each tenant policy's (``app.state.tenants``, ``app.state.tenant_chats``), each
    in its namespace (``Settings.for_tenant``), all sharing the engine (a tenant's through
    ``engine.view(tenant)``) and one ``ServerMetrics``. The tenant policies are the global
    database's list (``serve_listed_tenants``), followed while the app runs
    (``TenantPolicySync``, ``app.state.tenant_sync``). Those listed at start are opened by the
    start itself, before the app takes requests, each as one added at run time
    (``TenantPolicySync.open``); one that fails to open fails the start (what was opened is
    closed, the engine too if the app started it)."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        for url in settings.schema_urls:
            await asyncio.to_thread(migrate, url)
        await serve_listed_tenants(settings)
        app.state.adapter_slots, app.state.tenant_limit = tenant_slots(settings)
        own_engine = engine is None
        eng = engine or await PolicyEngine.start(settings)
        metrics = ServerMetrics()
        lt = log_transport or open_log(settings.resolved_log_url)
        state = open_policy(GLOBAL, settings, eng, lt, metrics, read_baseline)
        app.state.s, app.state.chat = state, chat_handler(state)
        app.state.tasks = {GLOBAL: await follow(state, watch_policy)}
        app.state.tenants, app.state.tenant_chats = {}, {}
        app.state.tenant_sync = sync = TenantPolicySync(app, settings, eng, metrics, watch_policy)
        # The listed tenant policies open as one added at run time does, each back in the list
        # once served. No slot check (``sync``'s): the slots were sized for this list.
        listed, settings.tenant_policies = settings.tenant_policies, []
        polling: list[asyncio.Task] = []
        try:
            for name in listed:
                await sync.open(name)
            polling.append(asyncio.create_task(sync.run(settings.tenant_poll_s)))
            yield
        finally:
            await stop(polling)
            await stop([t for ts in app.state.tasks.values() for t in ts])
            states = [state, *app.state.tenants.values()]
            for s in states:
                if s.canary is not None:
                    s.canary.release()
            for s in states:
                await close_policy(s, own_log=s is not state or log_transport is None)
            if own_engine:
                await eng.close()

    app = FastAPI(title="saoserve", version="0.1.0", lifespan=lifespan)
    app.state.backpressure = Backpressure(settings)
    app.add_middleware(
        BodySizeLimit,
        max_bytes=max_body_bytes(settings.max_model_len),
        read_timeout_s=settings.body_read_timeout_s,
    )
    install_error_handlers(app)
    # Registration order is the OpenAPI document's order: the operators' pages, then the API.
    # Chat and feedback take the caller's API key (server.auth; the model list does too, per route).
    app.include_router(ops.router)
    for family in (chat, feedback):
        app.include_router(family.router, dependencies=[Depends(authenticate)])
    for family in (admin, lifecycle, keys, tenant_policies):
        app.include_router(family.router)
    state_limits_in_openapi(app, settings)
    return app


async def serve_listed_tenants(settings: Settings) -> None:
    """At start: seed the global database's list of tenant policies from
    ``settings.tenant_policies`` (``core.tenant_store.seed``: names absent are added) and make
    ``settings.tenant_policies`` the list. ``settings`` is the process's: from here on its
    ``tenant_policies`` is the list this replica serves now, which ``TenantPolicySync`` changes
    and every reader (``server.auth.policy_of``, ``server.scope``, ``/metrics``) asks. Without
    adapter serving no tenant policy is served, and a list left by an earlier configuration is
    logged and left alone."""
    db = make_engine(settings.resolved_database_url)
    try:
        await asyncio.to_thread(tenant_store.seed, db, settings.tenant_policies)
        listed = await asyncio.to_thread(tenant_store.read, db)
    finally:
        db.dispose()
    if settings.adapter_serving is not AdapterServing.ADAPTER:
        if listed:
            log.warning(
                "the database lists tenant policies (%s), but adapter serving is off: this server "
                "serves none of them (SAOSERVE_ADAPTER_SERVING=adapter serves them)",
                ", ".join(listed),
            )
        return
    settings.tenant_policies = listed


def tenant_slots(settings: Settings) -> tuple[int, int]:
    """This replica's adapter slots and the most tenant policies they serve, fixed at its start
    (``core.settings.adapter_slots``, ``tenant_policy_limit``): (0, 0) without adapter serving."""
    if settings.adapter_serving is not AdapterServing.ADAPTER:
        return 0, 0
    slots = adapter_slots(settings, len(settings.tenant_policies))
    return slots, tenant_policy_limit(slots)


class TenantPolicySync:
    """Brings a running app's tenant policies to the global database's list, every ``poll_s``
    (``Settings.tenant_poll_s``; docs/tenants.md, "Adding and removing a tenant policy").

    A name added (``open``; the lifespan opens each name listed at start the same way): its
    namespace migrated, the engine told (``PolicyEngine.add_policy``: a name it serves since its
    start is left as it is), its state opened and its watcher, canary router and spool started,
    and only then its name put in ``settings.tenant_policies``, so no request is routed to it
    before its state is whole. Beyond ``app.state.tenant_limit``, or while the engine serves
    full weights (``TenantPolicyRefused``), it is not served (logged with what to do). A name
    removed: taken out of ``settings.tenant_policies`` first (its keys' next requests are the
    global policy's), then its tasks cancelled, its state closed (records in flight finish), and
    the engine told (``remove_policy``: once its load in flight has ended, its adapters removed
    once no request uses them), and its series taken off ``/metrics``
    (``ServerMetrics.forget_tenant_policy``). A read, a policy or a whole pass that fails is
    logged and tried again at the next poll; the other policies are unaffected, and whatever was
    opened for a policy that failed is closed."""

    def __init__(
        self, app: FastAPI, settings: Settings, eng: PolicyEngine, metrics: ServerMetrics, watch_policy: bool
    ) -> None:
        self.app, self.settings, self.engine, self.metrics = app, settings, eng, metrics
        self.watch_policy = watch_policy

    async def run(self, poll_s: float) -> None:
        """``sync`` every ``poll_s`` seconds until cancelled. A pass that raises is logged and the
        next runs as usual: this task is awaited only at shutdown, so ending here would leave the
        replica on a list it no longer follows, with nothing said."""
        while True:
            await asyncio.sleep(poll_s)
            try:
                await self.sync()
            except Exception:
                log.exception("tenant policies: a pass over the list failed; the next in %g s", poll_s)

    async def sync(self) -> None:
        """One pass: read the list, close the states of names gone, open those of names new."""
        if self.app.state.tenant_limit == 0:
            return
        try:
            listed = await asyncio.to_thread(tenant_store.read, self.app.state.s.store.engine)
        except Exception as exc:
            log.warning("the list of tenant policies could not be read (%s); serving the same ones", exc)
            return
        for name in [t for t in self.settings.tenant_policies if t not in listed]:
            await self.close(name)
        for name in [t for t in listed if t not in self.settings.tenant_policies]:
            if len(self.settings.tenant_policies) >= self.app.state.tenant_limit:
                log.error(
                    "%s: tenant policy not served: this server's %d adapter slots serve %d tenant "
                    "policies; restart it with more slots (SAOSERVE_TENANT_POLICY_HEADROOM)",
                    name,
                    self.app.state.adapter_slots,
                    self.app.state.tenant_limit,
                )
                continue
            try:
                await self.open(name)
            except TenantPolicyRefused as exc:
                log.error("%s: tenant policy not served: %s", name, exc)
            except Exception:
                log.exception("%s: tenant policy added, but its state could not be opened; retrying", name)

    async def open(self, name: str) -> None:
        """Serve tenant policy ``name`` (class docstring), added at run time (``sync``) or
        listed at start (the lifespan). Raises TenantPolicyRefused (the engine serves full
        weights: nothing opened) or what the migration, the log or the watcher's catch-up
        raise; then whatever was opened for it is closed (``discard``: its tasks, state,
        database engine, log and log threads) and the engine no longer serves it, so a retry
        every poll leaks nothing."""
        st = self.settings.model_copy(update={"tenant_policies": [name]}).for_tenant(name)
        for url in st.schema_urls:
            await asyncio.to_thread(migrate, url)
        await self.engine.add_policy(name)
        lt: LogTransport | None = None
        state: ServerState | None = None
        try:
            lt = open_log(st.resolved_log_url)
            state = open_policy(name, st, self.engine.view(name), lt, self.metrics.of_tenant_policy(name))
            tasks = await follow(state, self.watch_policy)
        except BaseException:
            await self.discard(name, state, lt, [])
            raise
        self.app.state.tasks[name] = tasks
        self.app.state.tenants[name] = state
        self.app.state.tenant_chats[name] = chat_handler(state)
        self.settings.tenant_policies = [*self.settings.tenant_policies, name]
        log.info("%s: tenant policy added: served at version %d", name, state.engine.version)

    async def close(self, name: str) -> None:
        """Stop serving tenant policy ``name`` (class docstring); its requests from now on are
        the global policy's. Never raises for a part that fails to close (``discard``)."""
        self.settings.tenant_policies = [t for t in self.settings.tenant_policies if t != name]
        state = self.app.state.tenants.pop(name)
        self.app.state.tenant_chats.pop(name)
        await self.discard(name, state, state.log, self.app.state.tasks.pop(name, []))
        log.info("%s: tenant policy removed: its keys are served by the global policy", name)

    async def discard(
        self, name: str, state: ServerState | None, lt: LogTransport | None, tasks: list[asyncio.Task]
    ) -> None:
        """Close what was opened for tenant policy ``name``: its ``tasks`` cancelled, its canary
        split's hold let go, its ``state`` closed (``close_policy``, its log ``lt`` with it) or,
        without a state, ``lt`` closed; then, whatever failed before, the engine told
        (``remove_policy``) and the series of ``name`` taken off ``/metrics``
        (``ServerMetrics.forget_tenant_policy``; the tasks that set them are stopped by then).
        Each failure is logged with the name, and the next part still closes."""
        try:
            await stop(tasks)
            if state is not None:
                if state.canary is not None:
                    with failure_logged(name, "letting go of its canary split's version"):
                        state.canary.release()
                with failure_logged(name, "closing its state"):
                    await close_policy(state, own_log=True)
            elif lt is not None:
                with failure_logged(name, "closing its log"):
                    await asyncio.to_thread(lt.close)
        finally:
            with failure_logged(name, "removing it from the engine"):
                await self.engine.remove_policy(name)
            with failure_logged(name, "taking its series off /metrics"):
                self.metrics.forget_tenant_policy(name)


async def stop(tasks: list[asyncio.Task]) -> None:
    """Cancel ``tasks`` and wait for their ends (what each raised is dropped: they are being
    stopped)."""
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t


@contextlib.contextmanager
def failure_logged(policy: str, what: str) -> Iterator[None]:
    """Log an Exception raised in the block (``policy: what failed``, with its traceback) and go
    on: one part of a policy that fails to close must not keep the next from closing."""
    try:
        yield
    except Exception:
        log.exception("%s: %s failed", policy, what)


def state_limits_in_openapi(app: FastAPI, settings: Settings) -> None:
    """The OpenAPI document states this deployment's ``max_tokens_limit`` as the bound of
    ``max_tokens`` and ``max_completion_tokens`` (a larger value is refused with 400 by
    ``ChatHandler.sampling_of``; the request model itself only knows the int32 bound)."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            props = build()["components"]["schemas"]["ChatCompletionRequest"]["properties"]
            for name in ("max_tokens", "max_completion_tokens"):
                for choice in props[name]["anyOf"]:
                    if choice.get("type") == "integer":
                        choice["maximum"] = settings.max_tokens_limit
        return app.openapi_schema

    app.openapi = openapi


def evidence_reader(store: EvidenceStore) -> BaselineReader:
    """Dispatch freeze (SPO++ §2.2): the prompt's evidence read at the dispatch version."""

    async def read(prompt_id: str, version: int) -> FrozenBaseline:
        return await asyncio.to_thread(store.read, prompt_id, version)

    return read


def open_policy(
    policy: str,
    settings: Settings,
    eng: PolicyEngine,
    lt: LogTransport,
    metrics: ServerMetrics | TenantPolicyMetrics,
    read_baseline: BaselineReader | None = None,
) -> ServerState:
    """The state of ``policy`` with ``settings`` (its namespace's; the database migrated),
    ``eng`` (the engine, or its view bound to the policy) and ``lt`` (its log): a database
    engine, a spool (``log_required`` off), the evidence reader (``read_baseline``, else the
    namespace's evidence store) and health; the served version in ``metrics``. Raises what
    making them raises (OSError for a folder that cannot be made), the database engine disposed;
    ``lt`` is the caller's to close."""
    db = make_engine(settings.resolved_database_url)
    try:
        spool = (
            None
            if settings.log_required
            else Spool(settings.home / "spool", lt, ServerStore(db), policy=policy)
        )
        journal = WriteJournal(settings.home / "deferred")
        reader = read_baseline or evidence_reader(EvidenceStore(db))
        health = Health(db, lt, settings.log_required, policy=policy)
    except BaseException:
        db.dispose()
        raise
    state = ServerState(settings, eng, lt, ServerStore(db), metrics, spool, reader, health, policy=policy)
    state.journal = journal
    metrics.policy_version.set(eng.version)
    return state


def chat_handler(state: ServerState) -> ChatHandler:
    """The ``ChatHandler`` of one policy's state."""
    return ChatHandler(
        state.settings,
        state.engine,
        state.store,
        state.metrics,
        open_fate=functools.partial(Fate, state),
        dispatch=state.dispatch,
        require_storage=state.require_storage,
        read_baseline=state.read_baseline,
    )


async def follow(state: ServerState, watch_policy: bool) -> list[asyncio.Task]:
    """Start one policy's background tasks: with ``watch_policy``, its watcher (caught up with
    its policy topic first, its readiness part of ``/readyz``) and, on an engine serving
    adapters, its canary router; its spool's sender. Raises what the catch-up raises, the tasks
    started so far stopped."""
    tasks: list[asyncio.Task] = []
    try:
        if watch_policy:
            watcher = PolicyWatcher(
                state.log, state.engine, state.metrics, state.settings.policy_poll_s, policy=state.policy
            )
            state.health.policy = watcher
            await watcher.catch_up()
            tasks.append(asyncio.create_task(watcher.run()))
            if state.engine.adapters is not None:
                state.canary = CanaryRouter(
                    state.store.engine,
                    state.engine,
                    state.metrics,
                    state.settings.canary_share,
                    policy=state.policy,
                    secret=state.settings.feedback_secret,
                )
                tasks.append(asyncio.create_task(state.canary.run(state.settings.policy_poll_s)))
        if state.spool is not None:
            tasks.append(asyncio.create_task(state.spool.run()))
        state.resume_deferred()
        tasks.append(asyncio.create_task(finish_forgets(state)))
    except BaseException:
        await stop(tasks)
        raise
    return tasks


async def finish_forgets(state: ServerState) -> None:
    """Finish the forget requests a crash left pending in ``state``'s namespace (recorded, not
    completed: the server stopped mid-way), once at start, so a forget answered or interrupted
    completes without waiting for the next forget or retention run (docs/privacy.md, "The
    receipt"). A failure is logged; the next forget, retention run or start finishes them."""
    try:
        receipts = await asyncio.to_thread(
            finish_pending,
            state.store.engine,
            sql_log_engine(state.log),
            state.settings.feedback_secret,
            utcnow(),
        )
    except Exception as exc:
        log.warning("%s: finishing the pending forget requests failed: %s", state.policy, exc)
        return
    if receipts:
        state.store.subject_keys.drop_cached()
    for r in receipts:
        log.info("%s: finished forget %s left pending (%d trajectories)", state.policy, r.id, r.trajectories)


async def close_policy(state: ServerState, own_log: bool) -> None:
    """At shutdown, once the tasks are cancelled: let the records in flight finish, stop the
    log threads, cancel deferred writes (their records are in the log, the writes in the
    journal: the next start does them), close the log if this app opened it (``own_log``) and
    the database. A log or database that fails to close is logged (``failure_logged``) and the
    rest still closes. Closing runs in a thread (a Kafka producer's close waits for the broker),
    so a tenant policy removed at run time does not hold the event loop."""
    if state.background:
        await asyncio.gather(*state.background, return_exceptions=True)
    state.log_pool.shutdown(wait=False)
    if state.deferred_writes:
        log.warning(
            "%s: %d deferred database writes not done at shutdown (the next start does them)",
            state.policy,
            len(state.deferred_writes),
        )
        for t in list(state.deferred_writes):
            t.cancel()
    if own_log:
        with failure_logged(state.policy, "closing its log"):
            await asyncio.to_thread(state.log.close)
    with failure_logged(state.policy, "closing its database engine"):
        await asyncio.to_thread(state.store.engine.dispose)
