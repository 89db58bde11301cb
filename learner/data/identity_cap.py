"""The identity cap: one identity contributes at most a share of a training batch (pure).

Issue 22, "Feedback that no cohort can steer unseen"; docs/tenants.md, "The identity cap". An
identity is who sent a sample (``TrajectoryRecord.identity``: ``key:<key id>`` or
``user:<user field>``). With ``max_share`` s and batch size B, each identity has at most
``k = max(1, ⌊s·B⌋)`` samples in a batch.

Selection: the waiting samples are scanned oldest first; a sample is taken unless its identity
already has k in the batch, and the scan stops once B are taken. A sample passed over is
*deferred*: it stays waiting (in ``learner_samples``, never deleted by the cap) and is first in
line for a later batch, whose scan reaches it before any younger sample of its identity. When
the waiting samples cannot fill a batch within the cap, no batch is formed: the learner waits
for more identities, as it waits for B samples. Each identity's chosen samples are its oldest.

A sample without an identity (no key and no ``user`` field, or joined before identities) is
its own identity: anonymous samples are never capped. Grouping them as one "anonymous" identity
would cap all of the embedded default's traffic (no keys, no ``user``) to a share of each batch
and stop it training; the price is that when keys are not required, a sender evades the cap by
leaving ``user`` out (or by varying it). The cap binds only identities a sender cannot choose:
API keys, with ``require_keys`` on.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass


def per_identity_limit(batch_size: int, max_share: float) -> int:
    """``k = max(1, ⌊max_share · batch_size⌋)``: the most samples one identity may have in a
    batch (the 1e-9 keeps 0.29·100 = 28.999… from flooring to 28). Raises ValueError unless
    ``batch_size`` ≥ 1 and ``max_share`` in (0, 1]."""
    if batch_size < 1 or not 0.0 < max_share <= 1.0:
        raise ValueError(f"need batch_size >= 1 and max_share in (0, 1], got {batch_size}, {max_share}")
    return max(1, math.floor(max_share * batch_size + 1e-9))


@dataclass(frozen=True)
class Selection:
    """Indices into the candidates (oldest first): ``chosen`` for the batch, ascending;
    ``deferred``: passed over because their identity was full, ascending. The candidates in
    neither were not reached (the batch filled before them). ``full``: B were chosen."""

    chosen: tuple[int, ...]
    deferred: tuple[int, ...]
    batch_size: int

    @property
    def full(self) -> bool:
        return len(self.chosen) == self.batch_size


def select_batch(identities: Sequence[str | None], batch_size: int, max_share: float | None) -> Selection:
    """The batch the cap admits from candidates whose identities are ``identities`` (oldest
    first; None: anonymous, its own identity). ``max_share`` None: no cap, the oldest
    ``batch_size``. Raises ValueError as ``per_identity_limit`` does."""
    if max_share is None:
        n = min(batch_size, len(identities))
        return Selection(tuple(range(n)), (), batch_size)
    limit = per_identity_limit(batch_size, max_share)
    taken: Counter[str] = Counter()
    chosen: list[int] = []
    deferred: list[int] = []
    for i, who in enumerate(identities):
        if len(chosen) == batch_size:
            break
        if who is not None and taken[who] >= limit:
            deferred.append(i)
            continue
        if who is not None:
            taken[who] += 1
        chosen.append(i)
    return Selection(tuple(chosen), tuple(deferred), batch_size)


def identity_shares(identities: Sequence[str | None], rewards: Sequence[float]) -> dict[str, float | None]:
    """A batch's concentration by identity (anonymous samples each their own), for the step
    metrics: ``identity_count`` (distinct identities), ``identity_top_share`` (the largest
    share of the batch's summed reward from one identity, in [0, 1]; None when the rewards sum
    to 0) and ``identity_top_sample_share`` (the largest share of its samples). Raises
    ValueError for lengths that differ or an empty batch."""
    if len(identities) != len(rewards) or not identities:
        raise ValueError(f"{len(identities)} identities for {len(rewards)} rewards (need the same, > 0)")
    keys = [who if who is not None else ("anonymous", i) for i, who in enumerate(identities)]
    reward_by: Counter = Counter()
    count_by: Counter = Counter(keys)
    for key, r in zip(keys, rewards, strict=True):
        reward_by[key] += r
    total = sum(rewards)
    return {
        "identity_count": len(count_by),
        "identity_top_share": max(reward_by.values()) / total if total > 0 else None,
        "identity_top_sample_share": max(count_by.values()) / len(keys),
    }


def admit_stream(identities: Sequence[str | None], window: int, max_share: float | None) -> tuple[int, ...]:
    """The identity cap on a stream of votes (the guard's ratings or answers of one arm, oldest
    first; docs/guard.md, "Who votes"): indices into ``identities`` in the order they count.

    The stream is cut into windows as the learner cuts batches: ``select_batch`` with batch
    size ``window`` on the candidates not yet admitted, again and again, each window's chosen
    ones admitted in ascending order; the last, partial, selection is admitted too (a vote
    counts as soon as it is in, where a batch waits to be full). So in every window an identity
    has at most ``k = max(1, ⌊max_share·window⌋)`` votes and a vote passed over is first in
    line for the next window. The first window that cannot be filled is the last: the votes it
    passed over wait for other identities' votes, as deferred samples wait for a batch, so an
    identity's votes beyond ``k`` per ``window`` of the stream never count. ``max_share`` None:
    every index, in order.

    Each window holds the ``window`` smallest indices among every identity's first ``k``
    remaining ones (and every anonymous one, None: its own identity), which is what scanning
    oldest first with a per-identity count takes; so a window costs O(identities + window · log
    identities) instead of a rescan of everything deferred. Raises ValueError as
    ``per_identity_limit`` does.
    """
    if max_share is None:
        return tuple(range(len(identities)))
    limit = per_identity_limit(window, max_share)
    queues: dict[str, deque[int]] = {}
    anonymous: deque[int] = deque()
    for i, who in enumerate(identities):
        (anonymous if who is None else queues.setdefault(who, deque())).append(i)
    out: list[int] = []
    while queues or anonymous:
        heads = [(q[0], who) for who, q in queues.items()]
        heapq.heapify(heads)
        taken: Counter[str] = Counter()
        chosen: list[int] = []
        while len(chosen) < window and (heads or anonymous):
            if anonymous and (not heads or anonymous[0] < heads[0][0]):
                chosen.append(anonymous.popleft())
                continue
            i, who = heapq.heappop(heads)
            queue = queues[who]
            queue.popleft()
            chosen.append(i)
            taken[who] += 1
            if not queue:
                del queues[who]
            elif taken[who] < limit:
                heapq.heappush(heads, (queue[0], who))
        out.extend(sorted(chosen))
        if len(chosen) < window:
            break
    return tuple(out)
