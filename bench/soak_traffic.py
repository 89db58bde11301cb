"""The chaos soak's traffic (bench/chaos_soak.py): ``--clients`` loops, each sending chats
(streamed or not, some with ``store: false``) to a random replica that accepts connections and
rating most answers through a random replica (some only after the learner's ``expire_s``), and
a monitor that reads every replica's ``/readyz`` every 0.2 s. Every request is recorded as a
``Call``, as the client saw it, for the audit (bench/soak_audit.py).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

import httpx

PROMPTS = (
    "Name a colour.",
    "Write one line about the sea.",
    "Say hello to a pirate.",
    "Give me a word that rhymes with cat.",
    "Describe rain in five words.",
    "What is two plus two?",
)
# The learner's ``expire_s`` (seconds a trajectory waits for feedback): some ratings come later.
EXPIRE_S = 30.0


@dataclass
class Call:
    """One request as the client saw it (Unix seconds); ``status`` None: no HTTP answer
    (connection refused or cut); ``broken``: a 200 stream that did not end with ``[DONE]``."""

    kind: str  # chat | feedback | pad
    slot: int
    t0: float
    t1: float = 0.0
    status: int | None = None
    error: str = ""
    broken: bool = False
    tag: str = ""
    id: str | None = None
    token: str | None = None
    version: int | None = None
    stream: bool = False
    store: bool = True
    reward: float | None = None


class SoakTraffic:
    """The traffic methods of ``Soak`` (bench/chaos_soak.py), on its fields: ``replicas``,
    ``calls``, ``ready_log``, ``listening`` (under ``lock``), ``seed``, ``args`` and the
    ``stop_traffic`` and ``stop_all`` events."""

    def _chat(self, http: httpx.Client, slot: int, body: dict, kind: str) -> Call:
        call = Call(kind, slot, time.time(), tag=body["user"], stream=body.get("stream", False))
        call.store = body.get("store", True)
        url = f"{self.replicas[slot].url}/v1/chat/completions"
        try:
            if call.stream:
                with http.stream("POST", url, json=body) as r:
                    call.status = r.status_code
                    raw = r.read().decode()
                if r.status_code == 200:
                    # SSE lines end at "\n" only: the server's JSON keeps U+2028 and the like raw.
                    data = [ln[6:] for ln in raw.split("\n") if ln.startswith("data: ")]
                    if not data or data[-1] != "[DONE]" or any('"error"' in d for d in data):
                        call.broken = True
                    else:
                        last = json.loads(data[-2])
                        call.id, call.token = last["id"], last["feedback_token"]
                        call.version = int(r.headers["x-policy-version"])
            else:
                r = http.post(url, json=body)
                call.status = r.status_code
                if r.status_code == 200:
                    out = r.json()
                    call.id, call.token, call.version = (
                        out["id"],
                        out["feedback_token"],
                        out["policy_version"],
                    )
            if call.status != 200:
                call.error = r.text[:300] if not call.stream else raw[:300]
        except httpx.HTTPError as exc:
            if call.status == 200:
                call.broken = True
            call.error = f"{exc.__class__.__name__}: {exc}"[:300]
        call.t1 = time.time()
        with self.lock:
            self.calls.append(call)
        return call

    def _feedback(self, http: httpx.Client, slot: int, answer: Call, reward: float, kind: str) -> Call:
        call = Call(kind, slot, time.time(), tag=answer.tag, id=answer.id, reward=reward, store=answer.store)
        try:
            r = http.post(
                f"{self.replicas[slot].url}/v1/feedback",
                json={"id": answer.id, "feedback_token": answer.token, "reward": reward},
            )
            call.status = r.status_code
            if r.status_code != 202:
                call.error = r.text[:300]
        except httpx.HTTPError as exc:
            call.error = f"{exc.__class__.__name__}: {exc}"[:300]
        call.t1 = time.time()
        with self.lock:
            self.calls.append(call)
        return call

    def client(self, i: int) -> None:
        """One client loop: a chat to a random replica, then (mostly) its rating through a
        random replica, some only after the learner's ``expire_s``."""
        rng = random.Random(self.seed * 1000 + i)
        late: list[tuple[float, Call]] = []
        n = 0
        with httpx.Client(timeout=60) as http:
            while not self.stop_traffic.is_set():
                body = {
                    "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
                    "max_tokens": rng.randint(4, self.args.max_tokens),
                    "user": f"s{self.seed}-c{i}-{n}",
                    "stream": rng.random() < 0.5,
                }
                if rng.random() < 0.1:
                    body["store"] = False
                n += 1
                answer = self._chat(http, self.route(rng), body, "chat")
                if answer.id is not None and rng.random() < 0.75:
                    if rng.random() < 0.05:
                        late.append((time.time() + EXPIRE_S + 8, answer))
                    else:
                        self._feedback(http, self.route(rng), answer, rng.choice((0.0, 1.0)), "feedback")
                now = time.time()
                for due, a in [x for x in late if x[0] <= now]:
                    late.remove((due, a))
                    self._feedback(http, self.route(rng), a, 1.0, "feedback")
                time.sleep(rng.uniform(0.0, 2 * self.args.think_s))

    def route(self, rng: random.Random) -> int:
        """A random replica among those that accept connections, as a load balancer's TCP check
        routes: one whose last ``/readyz`` got no answer at all is skipped (a 503 is an answer:
        storage outages reach the clients)."""
        with self.lock:
            up = [s for s in range(len(self.replicas)) if self.listening.get(s, True)]
        return rng.choice(up or range(len(self.replicas)))

    def monitor(self) -> None:
        """Every 0.2 s, each replica's ``/readyz`` (status and body), for the readiness and
        version checks and the recovery times."""
        with httpx.Client(timeout=3) as http:
            while not self.stop_all.is_set():
                for slot, r in enumerate(list(self.replicas)):
                    t = time.time()
                    try:
                        resp = http.get(f"{r.url}/readyz")
                        entry = (t, slot, resp.status_code, resp.json())
                    except (httpx.HTTPError, ValueError):
                        entry = (t, slot, None, {})
                    with self.lock:
                        self.ready_log.append(entry)
                        self.listening[slot] = entry[2] is not None
                time.sleep(0.2)
