"""The ``prompt_evidence`` table: persistent event-time evidence per prompt (SPO++, docs/design.md §5.4).

The server reads a prompt's evidence when it dispatches a request (:meth:`EvidenceStore.read`)
and logs it in the trajectory (dispatch freeze); the learner adds results inside the
transaction that also commits its consumer offsets (:meth:`EvidenceStore.add_results`,
docs/design.md §8); operators initialise prompts from offline rollouts (:func:`init_from_file`).

Row layout (migration 0002). The prior (``alpha0``, ``beta0`` at ``prior_version``) and the
online evidence are separate columns. Online evidence is ``alpha_ref = Σ_i ρ^(ref - v_i)·R_i``
and ``beta_ref = Σ_i ρ^(ref - v_i)·(1 - R_i)`` with ``ref = ref_version`` the newest version
among the prompt's results, exactly :class:`core.evidence.EvidenceState`. A read at version
``v_q`` merges prior and online state and re-expresses it by ``ρ^(v_q - ·)``, which is the
formula ``α_q = e^{-(z_q - z_0)} α_0 + Σ_i e^{-(z_q - z_i)} R_i`` of SPO++ (write-up §2.2).

Why a per-row reference version: a fixed table-wide reference (say version 0) would store
``Σ ρ^(-v_i) R_i``, which overflows a double after ~5300 versions; a log-scaled store would
need log-add-exp in SQL. Keeping each row at its newest version keeps every weight <= 1, so
terms can only underflow (harmlessly). PostgreSQL raises an error on float underflow
(``exp(-800)``, ``1e-200 * 1e-200``), so the SQL flushes terms below ``e^-700`` to 0 itself.

The default prior. A prompt never initialised offline gets Jeffreys(0 of 0) = (4, 4), placed at
the earliest version that generated one of its results (``min`` is order-free, so the state
stays a function of the *set* of results). Reading a prompt without a row returns that prior
at the reading version (value 0.5). Offline initialisation replaces the prior columns, pins
``prior_version`` (``offline_n`` is then not NULL) and leaves the online columns alone.

Concurrency (no lost update). Each batch of results becomes one
``INSERT ... ON CONFLICT (prompt_id) DO UPDATE`` per prompt whose ``SET`` clause computes the
new state from the row's *current* values: there is no read-modify-write in Python.

* PostgreSQL, READ COMMITTED (the default): the upsert locks the row; a writer that finds the
  row changed by a concurrent commit re-evaluates ``SET`` against the committed version, and
  a concurrent first insert of the same prompt makes the second writer wait and take the
  update path. Under REPEATABLE READ or SERIALIZABLE PostgreSQL raises a serialization
  failure instead and the caller retries its transaction. Prompts are written in sorted
  ``prompt_id`` order, so two ``add_results`` transactions lock rows in the same order and
  cannot deadlock on each other.
* SQLite: writers are serialised by the database write lock; ``busy_timeout`` (set by
  :func:`core.db.make_engine`) makes them wait. A transaction that reads before its first
  write can fail with "database is locked" when another writer committed in between (WAL
  snapshot upgrade); make the evidence write the first statement or begin with
  ``BEGIN IMMEDIATE``. Needs SQLite >= 3.35 built with math functions (``ln``, ``exp``), as
  Python 3.11's bundled SQLite is.

The state is a sum, so adding the same results in any order and any batching gives the same
row up to floating-point summation order (tested to 1e-9 relative on both databases).

Prompt ids (:func:`stored_prompt_id`). A prompt id a client chose is stored as a keyed hash,
never in clear, here and everywhere else (docs/privacy.md, "Prompt ids").
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from sqlalchemy import delete, select, text, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from core.db import PromptEvidence
from core.evidence import (
    JEFFREYS_MASS,
    RHO,
    EvidenceState,
    check_reward,
    check_rho,
    check_version,
    decay,
    event_coordinate,
    jeffreys_prior,
    uncertainty_weight,
)
from core.records import FrozenBaseline, utcnow

DEFAULT_PRIOR = jeffreys_prior(0, 0)
"""Prior of prompts not initialised offline: Jeffreys of 0 successes in 0 rollouts = (4, 4)."""

PROMPT_ID_MAX = 128
"""Longest prompt id the table holds (``prompt_evidence.prompt_id`` is VARCHAR(128))."""

# Terms below e^-700 (~1e-304) are flushed to 0: PostgreSQL raises on float underflow, and
# such a term is at least 700/-log(ρ) ≈ 5200 versions old.
_LOG_FLOOR = -700.0

_T = "prompt_evidence"
# The newest version of the stored row and the incoming batch: the row's new reference version.
_NEW_REF = (
    f"(CASE WHEN excluded.ref_version > {_T}.ref_version THEN excluded.ref_version ELSE {_T}.ref_version END)"
)


def _decayed(x: str, k: str) -> str:
    """SQL for ``x·ρ^k`` (``k >= 0``) that never underflows to an error on PostgreSQL."""
    return (
        f"(CASE WHEN {x} <= 0 THEN 0.0"
        f" WHEN ({k}) * :log_rho < {_LOG_FLOOR} THEN 0.0"
        f" WHEN ln({x}) + ({k}) * :log_rho < {_LOG_FLOOR} THEN 0.0"
        f" ELSE {x} * exp(({k}) * :log_rho) END)"
    )


_ADD_SQL = text(
    f"""
INSERT INTO {_T} (prompt_id, alpha0, beta0, prior_version, alpha_ref, beta_ref, ref_version,
                  n_results, reward_sum, offline_n, offline_successes, created_at, updated_at)
VALUES (:prompt_id, :alpha0, :beta0, :first_version, :alpha, :beta, :last_version,
        :n, :reward_sum, NULL, NULL, :now, :now)
ON CONFLICT (prompt_id) DO UPDATE SET
  alpha_ref = {_decayed(f"{_T}.alpha_ref", f"{_NEW_REF} - {_T}.ref_version")}
            + {_decayed("excluded.alpha_ref", f"{_NEW_REF} - excluded.ref_version")},
  beta_ref = {_decayed(f"{_T}.beta_ref", f"{_NEW_REF} - {_T}.ref_version")}
           + {_decayed("excluded.beta_ref", f"{_NEW_REF} - excluded.ref_version")},
  ref_version = {_NEW_REF},
  prior_version = CASE WHEN {_T}.offline_n IS NULL AND excluded.prior_version < {_T}.prior_version
                       THEN excluded.prior_version ELSE {_T}.prior_version END,
  n_results = {_T}.n_results + excluded.n_results,
  reward_sum = {_T}.reward_sum + excluded.reward_sum,
  updated_at = excluded.updated_at
"""
)

_INIT_SQL = text(
    f"""
INSERT INTO {_T} (prompt_id, alpha0, beta0, prior_version, alpha_ref, beta_ref, ref_version,
                  n_results, reward_sum, offline_n, offline_successes, created_at, updated_at)
VALUES (:prompt_id, :alpha0, :beta0, :version, 0.0, 0.0, :version,
        0, 0.0, :n, :successes, :now, :now)
ON CONFLICT (prompt_id) DO UPDATE SET
  alpha0 = excluded.alpha0,
  beta0 = excluded.beta0,
  prior_version = excluded.prior_version,
  offline_n = excluded.offline_n,
  offline_successes = excluded.offline_successes,
  updated_at = excluded.updated_at
"""
)


CLIENT_PROMPT_PREFIX = "h-"
"""How a stored client prompt id begins: ``h-`` + 32 hex digits (34 characters)."""

_PROMPT_HASH_DOMAIN = b"saoserve.prompt_id/1\x00"
# What the server makes itself (core.records.prompt_id_for, p-<32 hex>, a hash of the messages)
# and what stored_prompt_id makes: no personal data in clear. Any other stored id is a client's
# own id kept in clear before revision 0015.
_HASHED_ID = re.compile(r"[ph]-[0-9a-f]{32}")
_MESSAGES_ID = re.compile(r"p-[0-9a-f]{32}")


def stored_prompt_id(secret: str, prompt_id: str) -> str:
    """The prompt id stored for a client's own ``prompt_id``: ``h-`` + the first 32 hex digits
    (128 bits) of HMAC-SHA256 under the server's secret (``SAOSERVE_FEEDBACK_SECRET``, with a
    domain prefix of its own, so no feedback token is ever equal to it).

    Why a keyed hash, and not a refusal of personal data: a client may name a prompt by anything
    (an e-mail address, a ticket number, a customer's name), and no rule can tell which strings
    are personal. The hash is equal for equal ids, so a prompt's evidence still aggregates, its
    records still share a partition, and the operator (who has the id) still looks it up
    (:func:`lookup_prompt_ids`); without the secret an id cannot be confirmed by guessing it,
    which an unkeyed hash of a short id (an e-mail address) would allow. The server hashes the
    id when the chat comes in (``server.chat``), so the record, the log key, the index, the
    evidence, the feedback and the learner's rows only ever hold the hash. Changing the secret
    starts every client prompt's evidence afresh (docs/privacy.md).

    An id of the server's own form (``p-`` + 32 hex digits, ``core.records.prompt_id_for``, a
    hash of the messages that a client or an offline rollouts file may compute too) is kept as
    it is, so it names the same prompt whoever computed it.
    """
    if _MESSAGES_ID.fullmatch(prompt_id):
        return prompt_id
    digest = hmac.new(secret.encode(), _PROMPT_HASH_DOMAIN + prompt_id.encode(), hashlib.sha256)
    return CLIENT_PROMPT_PREFIX + digest.hexdigest()[:32]


def lookup_prompt_ids(secret: str, prompt_id: str) -> list[str]:
    """The stored ids an operator's ``prompt_id`` may be held under, first match wins: the hash
    of a client's id, then the id as given (a server-made ``p-…`` id, a stored ``h-…`` id, or a
    client id stored in clear before revision 0015)."""
    return [stored_prompt_id(secret, prompt_id), prompt_id]


def is_hashed_prompt_id(prompt_id: str) -> bool:
    """Whether a stored prompt id holds no client text in clear (``p-``/``h-`` + 32 hex)."""
    return _HASHED_ID.fullmatch(prompt_id) is not None


def _check_prompt_id(prompt_id: str) -> str:
    if not isinstance(prompt_id, str) or not prompt_id or len(prompt_id) > PROMPT_ID_MAX:
        raise ValueError(
            f"prompt_id must be a non-empty string of at most {PROMPT_ID_MAX} characters, got {prompt_id!r}"
        )
    return prompt_id


@dataclass(frozen=True)
class StoredEvidence:
    """A snapshot of one ``prompt_evidence`` row.

    ``prior``: the prior at its version; ``online``: the results at their newest version
    (zero mass if none); ``offline_n``/``offline_successes``: the offline rollouts the prior
    came from, ``None`` for the default prior; ``n_results``/``reward_sum``: undecayed count and
    reward sum of the online results.
    """

    prompt_id: str
    prior: EvidenceState
    online: EvidenceState
    n_results: int
    reward_sum: float
    offline_n: int | None
    offline_successes: int | None
    created_at: datetime
    updated_at: datetime

    @property
    def state(self) -> EvidenceState:
        """Prior and results together, expressed at the newest of their versions."""
        return self.prior.merge(self.online)


class EvidenceStore:
    """Reads and writes ``prompt_evidence`` (see the module docstring for the arithmetic).

    Args:
        engine: engine of a database migrated to revision 0002 or later.
        rho: per-version retention ρ in (0, 1) (SPO++: 0.875). It is a property of the stored
            data: every writer and reader of one database must use the same ρ.
        default_prior: ``(alpha0, beta0)`` of prompts not initialised offline
            (default Jeffreys of 0 successes in 0 rollouts = (4, 4)).
    """

    def __init__(
        self,
        engine: Engine,
        rho: float = RHO,
        default_prior: tuple[float, float] = DEFAULT_PRIOR,
    ) -> None:
        self.engine = engine
        self.rho = check_rho(rho)
        self._log_rho = math.log(self.rho)
        EvidenceState(*default_prior, 0, self.rho)  # validates the pair
        if sum(default_prior) <= 0:
            raise ValueError(f"default_prior must have positive mass, got {default_prior!r}")
        self.default_prior = (float(default_prior[0]), float(default_prior[1]))

    def add_results(self, conn: Connection | Session, results: Iterable[tuple[str, float, int]]) -> int:
        """Add ``(prompt_id, reward, version)`` results inside the caller's transaction.

        ``reward`` in [0, 1]; ``version`` (int >= 0) is the policy version that generated the
        trajectory (its event coordinate, SPO++ write-up §2.2). Nothing is committed here: the
        learner commits its consumer offsets and this evidence together (docs/design.md §8). Results of
        one prompt are first summed at their newest version (the same sum as adding them one
        by one), then each prompt gets one atomic upsert, in sorted prompt order.

        Args:
            conn: a SQLAlchemy ``Connection`` or ``Session`` with a transaction in progress (or
                autobegin).
            results: the results; an empty iterable does nothing.

        Returns:
            The number of results added.

        Raises:
            ValueError: a bad prompt id, reward or version; nothing is written then.
        """
        per_prompt: dict[str, list[tuple[float, int]]] = {}
        for prompt_id, reward, version in results:
            per_prompt.setdefault(_check_prompt_id(prompt_id), []).append(
                (check_reward(reward), check_version(version))
            )
        now = utcnow()
        params = []
        for prompt_id in sorted(per_prompt):
            items = per_prompt[prompt_id]
            last = max(v for _, v in items)
            params.append(
                {
                    "prompt_id": prompt_id,
                    "alpha0": self.default_prior[0],
                    "beta0": self.default_prior[1],
                    "first_version": min(v for _, v in items),
                    "last_version": last,
                    "alpha": math.fsum(decay(r, last - v, self.rho) for r, v in items),
                    "beta": math.fsum(decay(1.0 - r, last - v, self.rho) for r, v in items),
                    "n": len(items),
                    "reward_sum": math.fsum(r for r, _ in items),
                    "now": now,
                    "log_rho": self._log_rho,
                }
            )
        # One statement per prompt, in order: a multi-row upsert may not touch a row twice on
        # PostgreSQL, and the fixed order keeps concurrent writers from deadlocking.
        for p in params:
            conn.execute(_ADD_SQL, p)
        return sum(p["n"] for p in params)

    def init_from_rollouts(
        self, rows: Iterable[tuple[str, int, int]], version: int = 0, mass: float = JEFFREYS_MASS
    ) -> int:
        """Set the prior of prompts from offline rollouts, in one transaction of its own.

        Each ``(prompt_id, successes, n)`` becomes the Jeffreys prior
        ``α_0 = mass·(s + 0.5)/(n + 1)``, ``β_0 = mass - α_0`` placed at ``version`` (SPO++
        write-up §3.1; docs/design.md §5.4: at the initial version, 0). Rows of the same prompt are
        summed first. An existing prompt keeps its online results; its prior is replaced, so
        running the same initialisation twice is idempotent.

        Returns the number of prompts initialised. Raises ``ValueError`` on a bad prompt id,
        counts or version (nothing is written then).
        """
        version = check_version(version)
        counts: dict[str, tuple[int, int]] = {}
        for prompt_id, successes, n in rows:
            jeffreys_prior(successes, n, mass)  # validates the counts
            s0, n0 = counts.get(_check_prompt_id(prompt_id), (0, 0))
            counts[prompt_id] = (s0 + successes, n0 + n)
        now = utcnow()
        params = []
        for prompt_id in sorted(counts):
            successes, n = counts[prompt_id]
            alpha0, beta0 = jeffreys_prior(successes, n, mass)
            params.append(
                {
                    "prompt_id": prompt_id,
                    "alpha0": alpha0,
                    "beta0": beta0,
                    "version": version,
                    "n": n,
                    "successes": successes,
                    "now": now,
                }
            )
        with self.engine.begin() as conn:
            for p in params:
                conn.execute(_INIT_SQL, p)
        return len(params)

    def get(self, prompt_id: str) -> StoredEvidence | None:
        """The stored row of ``prompt_id``, or ``None`` if it has none."""
        with self.engine.connect() as conn:
            row = conn.execute(
                select(PromptEvidence.__table__).where(PromptEvidence.prompt_id == prompt_id)
            ).one_or_none()
        return None if row is None else self._stored(row)

    def find(self, secret: str, prompt_id: str) -> tuple[str, StoredEvidence | None]:
        """The stored id and row of an operator's ``prompt_id`` (:func:`lookup_prompt_ids`: the
        keyed hash of a client's id first, then the id as given); (the hashed id, None) when
        neither has a row."""
        candidates = lookup_prompt_ids(secret, prompt_id)
        for stored in candidates:
            row = self.get(stored)
            if row is not None:
                return stored, row
        return candidates[0], None

    @staticmethod
    def rekey_clear_ids(conn: Connection, secret: str, prompt_ids: Iterable[str]) -> int:
        """In the caller's transaction: move each row among ``prompt_ids`` still keyed by a
        client's id in clear (stored before revision 0015) to its keyed hash
        (:func:`stored_prompt_id`), where new results of that prompt already land; a row the hash
        already has is newer, and the clear one is deleted. Returns the rows re-keyed or deleted.
        A forget calls it for the prompts of the records it removes."""
        n = 0
        for clear in sorted({p for p in prompt_ids if not is_hashed_prompt_id(p)}):
            hashed = stored_prompt_id(secret, clear)
            t = PromptEvidence.__table__
            if conn.execute(select(t.c.prompt_id).where(t.c.prompt_id == hashed)).first() is None:
                n += conn.execute(update(t).where(t.c.prompt_id == clear).values(prompt_id=hashed)).rowcount
            else:
                n += conn.execute(delete(t).where(t.c.prompt_id == clear)).rowcount
        return n

    def read(self, prompt_id: str, version: int) -> FrozenBaseline:
        """The baseline a request for ``prompt_id`` dispatched at ``version`` freezes.

        ``alpha``/``beta`` are the evidence seen from ``version`` (SPO++ write-up §2.2),
        ``value`` = α/(α+β) computed from the stored state (identical for every reading
        version, and exact even where α and β at ``version`` underflow), ``z`` = -version·log ρ.
        A prompt without a row gets the default prior at ``version`` (value 0.5 for (4, 4)).

        A read never fails on stored data: if ``version`` lies so many (thousands of) versions
        before the prompt's newest result that α would overflow, α and β are capped by one
        common factor (:meth:`EvidenceState.at_bounded`; the value stays exact). Raises
        ``ValueError`` for a bad version.
        """
        version = check_version(version)
        stored = self.get(prompt_id)
        state = EvidenceState(*self.default_prior, version, self.rho) if stored is None else stored.state
        return self._baseline(state, version)

    def top_uncertain(self, n: int, version: int) -> list[tuple[str, FrozenBaseline]]:
        """The ``n`` stored prompts with the largest sampler weight ``sqrt(v̂(1-v̂) + 0.05)``.

        The weight of SPO++'s uncertainty sampler (write-up §2.4), largest first, ties broken by
        prompt id; baselines are read at ``version``. Scans the whole table (O(rows)): meant for
        the simulation's prompt pool, not for millions of prompts. Prompts without a row are
        not listed. Raises ``ValueError`` for ``n < 0`` or a bad version.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        version = check_version(version)
        with self.engine.connect() as conn:
            rows = conn.execute(select(PromptEvidence.__table__)).all()
        scored = []
        for row in rows:
            state = self._stored(row).state
            scored.append((uncertainty_weight(state.value), row.prompt_id, state))
        best = heapq.nsmallest(n, scored, key=lambda t: (-t[0], t[1]))
        return [(pid, self._baseline(state, version)) for _, pid, state in best]

    def _stored(self, row) -> StoredEvidence:
        return StoredEvidence(
            prompt_id=row.prompt_id,
            prior=EvidenceState(row.alpha0, row.beta0, row.prior_version, self.rho),
            online=EvidenceState(row.alpha_ref, row.beta_ref, row.ref_version, self.rho),
            n_results=row.n_results,
            reward_sum=row.reward_sum,
            offline_n=row.offline_n,
            offline_successes=row.offline_successes,
            created_at=row.created_at,
            updated_at=row.updated_at,
        )

    def _baseline(self, state: EvidenceState, version: int) -> FrozenBaseline:
        alpha, beta = state.at_bounded(version)
        return FrozenBaseline(
            alpha=alpha,
            beta=beta,
            value=state.value,
            version=version,
            z=event_coordinate(version, self.rho),
        )


def read_rollouts_file(path: str | Path) -> dict[str, tuple[int, int]]:
    """Offline rollout counts per prompt from a JSON-lines file.

    Each non-blank line is one object, either one rollout ``{"prompt_id": str, "reward": 0|1}``
    or a count ``{"prompt_id": str, "successes": int, "n": int}`` (``0 <= successes <= n``); a
    file may mix both, and lines of the same prompt add up.

    Returns ``{prompt_id: (successes, n)}``. Raises ``ValueError`` naming the file and line
    (1-based) of the first bad line; ``OSError`` if the file cannot be read.
    """
    counts: dict[str, tuple[int, int]] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg})") from None
            successes, n = _parse_rollout_line(obj, where)
            s0, n0 = counts.get(obj["prompt_id"], (0, 0))
            counts[obj["prompt_id"]] = (s0 + successes, n0 + n)
    return counts


def _parse_rollout_line(obj: object, where: str) -> tuple[int, int]:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object")
    try:
        _check_prompt_id(obj.get("prompt_id"))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    keys = set(obj)
    if keys == {"prompt_id", "reward"}:
        reward = obj["reward"]
        if isinstance(reward, bool) or reward not in (0, 1):
            raise ValueError(f"{where}: reward must be 0 or 1, got {reward!r}")
        return int(reward), 1
    if keys == {"prompt_id", "successes", "n"}:
        successes, n = obj["successes"], obj["n"]
        try:
            jeffreys_prior(successes, n)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        return successes, n
    raise ValueError(
        f"{where}: expected keys {{prompt_id, reward}} or {{prompt_id, successes, n}}, got {sorted(keys)}"
    )


def init_from_file(path: str | Path, engine: Engine, secret: str, version: int = 0, rho: float = RHO) -> int:
    """Initialise prompt priors from a rollouts file (the ``saoserve evidence-init FILE`` job).

    Reads the whole file first (:func:`read_rollouts_file`), so a bad line writes nothing, then
    calls :meth:`EvidenceStore.init_from_rollouts` at ``version`` with each prompt id stored as
    a chat's would be (:func:`stored_prompt_id` under the server's ``secret``). Returns the
    number of prompts initialised. Raises ``ValueError`` (naming the line) on bad input.
    """
    counts = read_rollouts_file(path)
    store = EvidenceStore(engine, rho=rho)
    return store.init_from_rollouts(
        ((stored_prompt_id(secret, pid), s, n) for pid, (s, n) in counts.items()), version=version
    )
