"""One chaos soak: sustained traffic while versions swap, the learner is killed, the database and
the broker go down and a replica restarts; audited from the database and the log (issue 23).

The parts are the existing harnesses: ``saoserve serve`` replicas and ``saoserve learn`` started
as a user starts them (tests/replicas.py), a PostgreSQL cluster of the soak's own that it stops
and starts (tests/dependencies.py ``PgCluster``, as tests/test_outages.py), a tansu broker it
pauses (``TansuBroker``), and the learner's named kill points (learner/faults.py,
``SAOSERVE_FAULT_POINT``). The model is a random 2-layer Llama with SmolLM2's tokenizer and
vocabulary (``tiny_model``), so that the learner publishes a version every few seconds and a
replica starts in seconds, not minutes: the soak is about the system, not the model.

Traffic: ``--clients`` loops, each sending chats (streamed or not, some with ``store: false``)
to a random replica and rating most answers through a random replica (some after the
learner's ``expire_s``). Chaos, drawn from the seed: the first learner lives each armed with a
kill point (it dies there, status 137) or planned for a SIGKILL (unarmed, killed 0.2-2 s after
its first join commit, a random moment of its cycle), one SIGKILL life per 75 s of traffic
interleaved with the armed ones from the second life on, each life restarted at once (the first
starts with the replicas); on a schedule, PostgreSQL stopped (``pg_ctl -m fast``) and started,
the broker paused (SIGSTOP) and resumed, one replica stopped and started again. Every outage is
recorded as a window with its timestamps. Then the traffic stops, the learner trains what is
left (padding with a few rated chats of its own to fill the last batch), and the audit checks:

- every 2xx chat has exactly one trajectory in the log and one index row in the database;
- every 202 feedback is trained exactly once, or listed with its reason: a dead letter
  (``trajectory_expired``...) or opted out (``store: false``); nothing is trained twice;
- every 5xx, connection failure or broken stream lies in an outage window (plus ``--grace-s``);
- versions never go backwards on a replica: each answer's version is at least every version
  that replica (its slot, across the restart) answered or reported in ``/readyz`` before the
  request was sent, and each record's token versions rise from its dispatch version; the
  restarted replica was 503 until it served the newest version recorded at its start;
- the versions in the database run 0..N, each the child of the one before, all published;
- no learner life ended other than by its kill, or at its start while the database was down
  (``saoserve learn`` migrates first and exits then; compose's restart policy, as the soak,
  starts it again; a replica the same); every planned SIGKILL was sent.

Prints the figures (requests, 2xx, 5xx in and out of the windows, trajectories, feedback
trained, kills, swaps, outages and their recovery times) and exits 1 if any check failed;
``--json FILE`` writes them. tests/test_chaos_soak.py runs a short soak (opt-in: ``SAOSERVE_SOAK=1``);
the measured runs are in docs/reliability.md, "The chaos soak".

    flock /tmp/saoserve-heavy.lock .venv/bin/python bench/chaos_soak.py \\
        [--duration 300] [--seeds 0[,1...]] [--clients 4] [--think-s 0.25] [--points all]
        [--replica-stop term|kill] [--grace-s 3] [--json FILE] [--keep]
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import UTC
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from tests.replicas import Deployment, Process, Replica

# The harness lives in tests/ (not an installed package): imported once ROOT is on the path.
ROOT = Path(__file__).resolve().parent.parent
PROMPTS = (
    "Name a colour.",
    "Write one line about the sea.",
    "Say hello to a pirate.",
    "Give me a word that rhymes with cat.",
    "Describe rain in five words.",
    "What is two plus two?",
)
# Files of the prepared model that a tiny model with the same tokenizer shares.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
BATCH = 16
EXPIRE_S = 30.0
SIGKILL = "sigkill"  # a life's plan: unarmed, SIGKILLed at a random moment of its cycle
SIGKILL_AFTER_S = (0.2, 2.0)  # that moment: seconds after the life's first join commit


def tiny_model(prepared: Path, out: Path) -> Path:
    """A random Llama (2 layers, hidden 64, 2 heads of 32) with the prepared model's tokenizer,
    vocabulary (49,152) and tied embeddings, saved in bfloat16 as ``prepare-model`` saves
    SmolLM2: 3.2 M parameters, a 12.6 MB float32 version."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from core.weights import weights_sha256
    from saoserve.model import MARKER

    src = json.loads((prepared / "config.json").read_text())
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=src["vocab_size"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=src["bos_token_id"],
        eos_token_id=src["eos_token_id"],
        pad_token_id=src.get("pad_token_id"),
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (prepared / name).is_file():
            shutil.copy2(prepared / name, out / name)
    # ``serve`` and ``learn`` prepare SAOSERVE_MODEL_DIR unless its marker names the shipped
    # GGUF: the marker says "prepared, keep it", with the tiny weights' own checksum.
    marker = json.loads((prepared / MARKER).read_text())
    info = {"source": "bench/chaos_soak.py tiny_model", "source_sha256": marker["source_sha256"]}
    (out / MARKER).write_text(json.dumps(info | {"sha256": weights_sha256(out)}))
    return out


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


@dataclass
class Window:
    """An outage: ``what`` was down from ``start`` to ``end`` (Unix s); ``slot`` None: every
    replica is affected, else only that replica; ``recovered_s``: from ``end`` to every replica
    answering ``/readyz`` 200."""

    what: str
    start: float
    end: float = 0.0
    slot: int | None = None
    recovered_s: float | None = None


@dataclass
class Life:
    """One learner life: its kill point (None: unarmed), whether it is planned for a SIGKILL, how
    it ended (``rc``: 137 at its point, -9 for a SIGKILL, None still running at the end);
    ``sigkill_at_s``: seconds from its start to the SIGKILL."""

    n: int
    point: str | None
    started: float
    planned_sigkill: bool = False
    ended: float | None = None
    rc: int | None = None
    sigkilled: bool = False
    sigkill_at_s: float | None = None


@dataclass
class Soak:
    args: argparse.Namespace
    seed: int
    home: Path
    dep: Deployment | None = None
    db: Engine | None = None
    replicas: list[Replica] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)
    lives: list[Life] = field(default_factory=list)
    ready_log: list[tuple[float, int, int | None, dict]] = field(default_factory=list)
    listening: dict[int, bool] = field(default_factory=dict)
    restarts: list[dict] = field(default_factory=list)
    swaps_before_restart: dict[int, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop_traffic: threading.Event = field(default_factory=threading.Event)
    stop_all: threading.Event = field(default_factory=threading.Event)
    learner: Process | None = None
    plans: list[str] = field(default_factory=list)  # the coming lives': a kill point or SIGKILL
    learner_args: list[str] = field(default_factory=list)

    # ------------------------------------------------------------------ traffic
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
                    data = [ln[6:] for ln in raw.splitlines() if ln.startswith("data: ")]
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

    # ------------------------------------------------------------------ the learner
    def _start_life(self) -> None:
        plan = self.plans.pop(0) if self.plans else None
        point = plan if plan != SIGKILL else None
        n = len(self.lives)
        self.learner = self.dep.learn(
            *self.learner_args, env={"SAOSERVE_FAULT_POINT": point or ""}, name=f"learner-{n}"
        )
        life = Life(n, point, time.time(), planned_sigkill=plan == SIGKILL)
        self.lives.append(life)
        if life.planned_sigkill:
            threading.Thread(target=self._sigkill_in_cycle, args=(life, self.learner), daemon=True).start()

    def supervise(self) -> None:
        """Restart the learner whenever a life ends, until the soak's end."""
        while not self.stop_all.is_set():
            proc = self.learner
            if proc is not None and not proc.alive():
                life = self.lives[-1]
                life.ended, life.rc = time.time(), proc.proc.returncode
                # Ended otherwise first (at its start, the database down): the next life takes its plan.
                if life.point and life.rc != 137:
                    self.plans.insert(0, life.point)
                elif life.planned_sigkill and life.rc != -9:
                    self.plans.insert(0, SIGKILL)
                self.dep.procs.remove(proc)
                self._start_life()
            time.sleep(0.2)

    def _sigkill_in_cycle(self, life: Life, proc: Process) -> None:
        """SIGKILL ``life`` a seeded 0.2-2 s after its first join commit (the learner's consumer
        offsets in the database advance), so that the kill lands at a random moment of its cycle
        (a join, a step, a version's write or commit...), not in its imports or its load."""
        from sqlalchemy import func, select
        from sqlalchemy.exc import DBAPIError

        from core.db import ConsumerOffset
        from learner.joiner import CONSUMER

        read = select(func.coalesce(func.sum(ConsumerOffset.next_offset), 0)).where(
            ConsumerOffset.consumer == CONSUMER
        )
        start = None
        while proc.alive() and not self.stop_all.is_set():
            with contextlib.suppress(DBAPIError), self.db.connect() as conn:
                offsets = conn.execute(read).scalar_one()
                if start is not None and offsets > start:
                    break
                start = offsets if start is None else start
            time.sleep(0.2)
        else:
            return
        time.sleep(random.Random(f"{self.seed}-life{life.n}").uniform(*SIGKILL_AFTER_S))
        if proc.alive():
            life.sigkilled, life.sigkill_at_s = True, round(time.time() - life.started, 1)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.proc.pid, signal.SIGKILL)

    # ------------------------------------------------------------------ chaos
    def outage(self, what: str, down, up, seconds: float) -> None:
        w = Window(what, time.time())
        self.windows.append(w)
        down()
        time.sleep(seconds)
        up()
        w.end = time.time()
        w.recovered_s = self.wait_all_ready(w.end) - w.end

    def wait_all_ready(self, since: float, timeout_s: float = 120) -> float:
        """The first time after ``since`` when every replica answered ``/readyz`` 200 (a replica
        being restarted is left out: its own window ends when it is ready)."""
        deadline = time.time() + timeout_s
        while time.time() < deadline and not self.stop_all.is_set():
            restarting = {w.slot for w in self.windows if w.slot is not None and not w.end}
            with self.lock:
                after = [e for e in self.ready_log if e[0] >= since]
            ok_at = {}
            for t, slot, code, _ in after:
                if code == 200 and slot not in ok_at:
                    ok_at[slot] = t
            if set(range(len(self.replicas))) - restarting <= ok_at.keys():
                return max(ok_at.values(), default=since)
            time.sleep(0.2)
        raise TimeoutError(f"the replicas were not all ready within {timeout_s:.0f} s of {since:.1f}")

    def restart_replica(self, slot: int, db) -> None:
        from tests.replicas import metric

        old = self.replicas[slot]
        with contextlib.suppress(httpx.HTTPError):
            page = httpx.get(f"{old.url}/metrics", timeout=5).text
            self.swaps_before_restart[slot] = metric(page, "saoserve_policy_swaps_total", result="ok") or 0.0
        w = Window(f"replica {old.name} restart", time.time(), slot=slot)
        self.windows.append(w)
        if self.args.replica_stop == "kill":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(old.proc.pid, signal.SIGKILL)
        old.stop()
        self.dep.procs.remove(old)
        newest = newest_published_retrying(db)
        spawned, exits = time.time(), []
        while not self.stop_all.is_set():
            # An orchestrator's restart policy: a replica that exits while starting (its
            # migration at start needs the database) is started again.
            name = f"{old.name.split('-life')[0]}-life{len(self.restarts) + 2}-{len(exits)}"
            new = self.dep.serve(name, self._bind(slot))
            self.replicas[slot] = new
            try:
                self.dep.wait_ready([new], timeout_s=240)
                break
            except RuntimeError as exc:
                exits.append(str(exc).splitlines()[0])
                self.dep.procs.remove(new)
                time.sleep(1.0)
        w.end = time.time()
        w.recovered_s = self.wait_all_ready(w.end) - w.end
        self.restarts.append(
            {
                "slot": slot,
                "stopped": w.start,
                "spawned": spawned,
                "ready": w.end,
                "newest_at_spawn": newest,
                "failed_starts": exits,
            }
        )

    def _bind(self, slot: int) -> dict[str, str]:
        # One core per replica (vLLM binds every engine's worker to core 0 by default).
        return {"VLLM_CPU_OMP_THREADS_BIND": str(slot % (os.cpu_count() or 1))}

    def schedule(self) -> list[tuple[float, str]]:
        """(seconds from the start of traffic, action), in time order: one replica restart per
        150 s of ``duration`` (at least one; slots in turn, the first 5 s in: a restart takes
        the longest), and pairs of a database outage and a broker pause in a seeded order, one
        pair per 75 s (at least one), spread evenly over the duration, none in its last 10 s.
        Restarts run beside the other actions, so their windows may overlap. The learner's
        SIGKILLs follow its lives, not the clock (``life_plans``)."""
        rng = random.Random(self.seed)
        d = self.args.duration
        restarts = max(1, int(d // 150))
        out = [(5.0 + k * d / restarts, f"replica:{k % self.args.replicas}") for k in range(restarts)]
        actions = []
        for _ in range(max(1, int(d // 75))):
            cycle = ["database", "broker"]
            rng.shuffle(cycle)
            actions += cycle
        gap = (d - 10) / (len(actions) + 1)
        out += [(gap * (k + 1) + rng.uniform(-0.2, 0.2) * gap, a) for k, a in enumerate(actions)]
        return sorted(out)

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        sys.path.insert(0, str(ROOT))
        from learner.config import build_config
        from learner.faults import CYCLE_POINTS
        from saoserve.model import prepare_model
        from tests.dependencies import PgCluster, TansuBroker
        from tests.replicas import Deployment

        t_begin = time.time()
        model_dir = tiny_model(prepare_model(ROOT / "var" / "model"), self.home / "model")
        cluster, broker = PgCluster(), TansuBroker()
        cluster.init()
        cluster.start()
        broker.start()
        db = None
        try:
            from core.db import make_engine

            self.dep = Deployment(
                home=self.home,
                database_url=cluster.url,
                log_url=broker.url,
                model_dir=model_dir,
                kv_cache_gib=0.1,
            )
            db = self.db = make_engine(cluster.url)
            config = build_config(
                "cpu",
                overrides={
                    "batch_size": BATCH,
                    "expire_s": EXPIRE_S,
                    "checkpoint_every": 3,
                    "poll_s": 0.25,
                },
            )
            (self.home / "learner.json").write_text(config.model_dump_json())
            self.learner_args = ["--config", str(self.home / "learner.json")]
            self.plans = life_plans(
                kill_points(self.args.points, self.seed, CYCLE_POINTS), max(1, int(self.args.duration // 75))
            )
            self.replicas = [
                self.dep.serve(f"replica-{chr(97 + s)}", self._bind(s)) for s in range(self.args.replicas)
            ]
            self._start_life()
            self.dep.wait_ready(self.replicas, timeout_s=240)
            threads = [
                threading.Thread(target=self.monitor, daemon=True),
                threading.Thread(target=self.supervise, daemon=True),
            ]
            clients = [
                threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(self.args.clients)
            ]
            for t in threads + clients:
                t.start()
            t_traffic = time.time()
            restarts = []
            for at, action in self.schedule():
                time.sleep(max(0.0, t_traffic + at - time.time()))
                dur = random.Random(f"{self.seed}-{at}").uniform(2.0, 5.0)
                if action == "database":
                    self.outage("database", cluster.stop, cluster.start, dur)
                elif action == "broker":
                    self.outage("broker", broker.pause, broker.resume, dur)
                else:
                    slot = int(action.split(":")[1])
                    restarts.append(
                        threading.Thread(target=self.restart_replica, args=(slot, db), daemon=True)
                    )
                    restarts[-1].start()
            for t in restarts:
                t.join(400)
            # The traffic goes on for the duration, and at least 5 s after the last restart.
            last = max((r["ready"] for r in self.restarts), default=0.0) + 5.0
            time.sleep(max(0.0, t_traffic + self.args.duration - time.time(), last - time.time()))
            self.stop_traffic.set()
            for t in clients:
                t.join(90)
            t_traffic_end = time.time()
            drained = self.drain(db)
            t_drained = time.time()
            report = self.audit(db, model_dir)
            report["seconds"] = {
                "setup": round(t_traffic - t_begin, 1),
                "traffic": round(t_traffic_end - t_traffic, 1),
                "drain": round(t_drained - t_traffic_end, 1),
                "total": round(time.time() - t_begin, 1),
            }
            report["drained"] = drained
            return report
        except BaseException:
            if self.dep is not None:
                print(self.dep.tails(), file=sys.stderr)
            raise
        finally:
            self.stop_all.set()
            self.stop_traffic.set()
            if self.dep is not None:
                # SIGTERM to every process group at once, then the harness's stop (waits, SIGKILL).
                for proc in self.dep.procs:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.proc.pid, signal.SIGTERM)
                self.dep.stop()
            if db is not None:
                db.dispose()
            broker.kill()
            cluster.remove()

    def drain(self, db, timeout_s: float = 120) -> bool:
        """Let the learner train what was rated: while samples wait, fill the last batch with
        rated chats of the drain's own (``pad``); True once nothing waits and every accepted
        feedback is trained, set aside or opted out. False after ``timeout_s`` from the drain's
        start or the latest learner life's, whichever is later: armed lives left when the
        traffic ends die during the drain, and each restart costs a life's start."""
        from sqlalchemy import func, select

        from core.db import LearnerSample

        start = time.time()
        n = 0
        last, since = -1, time.time()
        with httpx.Client(timeout=60) as http:
            while time.time() < max(start, self.lives[-1].started) + timeout_s:
                missing = self.unaccounted(db)
                with db.connect() as conn:
                    waiting = conn.execute(select(func.count()).select_from(LearnerSample)).scalar_one()
                if not missing and waiting == 0:
                    return True
                if waiting != last:
                    last, since = waiting, time.time()
                elif waiting and time.time() - since > 6.0:
                    # As many samples waiting for 6 s: less than a batch. Fill it once.
                    since = time.time() + 15.0
                    for _ in range(BATCH - waiting % BATCH):
                        body = {
                            "messages": [{"role": "user", "content": "Pad the last batch."}],
                            "max_tokens": 4,
                            "user": f"pad-{n}",
                        }
                        n += 1
                        answer = self._chat(http, n % len(self.replicas), body, "pad")
                        if answer.id is not None:
                            self._feedback(http, n % len(self.replicas), answer, 1.0, "pad")
                time.sleep(1.0)
        return False

    # ------------------------------------------------------------------ the audit
    def accepted(self) -> list[Call]:
        return [c for c in self.calls if c.kind == "feedback" and c.status == 202]

    def accounted(self, db) -> tuple[Counter, dict[str, str]]:
        """Trained trajectory ids (with multiplicity) and the dead letters' ids with their kinds."""
        from sqlalchemy import select

        from core.db import DeadLetter, LearnerStep

        with db.connect() as conn:
            steps = conn.execute(select(LearnerStep.metrics)).scalars().all()
            letters = conn.execute(select(DeadLetter.kind, DeadLetter.key, DeadLetter.payload)).all()
        trained = Counter(sid for m in steps for sid in (m or {}).get("sample_ids", []))
        dead = {}
        for kind, key, payload in letters:
            tid = None
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                tid = json.loads(payload).get("trajectory_id")
            for ident in (tid, key, (key or "").removeprefix("t:")):
                if ident:
                    dead[ident] = kind
        return trained, dead

    def unaccounted(self, db) -> list[str]:
        trained, dead = self.accounted(db)
        return [c.id for c in self.accepted() if c.store and c.id not in trained and c.id not in dead]

    def in_window(self, c: Call) -> Window | None:
        g = self.args.grace_s
        for w in self.windows:
            if (w.slot is None or w.slot == c.slot) and c.t0 <= w.end + g and c.t1 >= w.start:
                return w
        return None

    def audit(self, db, model_dir: Path) -> dict:
        from sqlalchemy import select

        from core.db import PolicyVersion, TrajectoryIndex
        from core.logbus import open_log
        from core.records import (
            TOPIC_FEEDBACK,
            TOPIC_POLICY,
            TOPIC_TRAJECTORIES,
            FeedbackRecord,
            PolicyEvent,
            TrajectoryRecord,
        )
        from tests.logutil import read_topic
        from tests.replicas import metric

        problems: list[str] = []
        log = open_log(self.dep.log_url)
        try:
            records = [
                TrajectoryRecord.model_validate_json(e.value) for e in read_topic(log, TOPIC_TRAJECTORIES)
            ]
            feedback = [FeedbackRecord.model_validate_json(e.value) for e in read_topic(log, TOPIC_FEEDBACK)]
            events = [PolicyEvent.model_validate_json(e.value) for e in read_topic(log, TOPIC_POLICY)]
        finally:
            log.close()
        with db.connect() as conn:
            indexed = Counter(conn.execute(select(TrajectoryIndex.id)).scalars().all())
            versions = conn.execute(
                select(PolicyVersion.version, PolicyVersion.parent_version, PolicyVersion.status).order_by(
                    PolicyVersion.version
                )
            ).all()
            created = sorted(aware_ts(t) for t in conn.execute(select(PolicyVersion.created_at)).scalars())

        chats = [c for c in self.calls if c.kind == "chat"]
        ok = [c for c in chats if c.status == 200 and not c.broken]
        by_id = Counter(r.id for r in records)
        rec_of = {r.id: r for r in records}

        # Every 2xx chat: exactly one trajectory in the log, one index row.
        for c in ok:
            if by_id[c.id] != 1:
                problems.append(f"2xx chat {c.id} has {by_id[c.id]} trajectories in the log")
            if indexed[c.id] != 1:
                problems.append(f"2xx chat {c.id} has {indexed[c.id]} index rows")
        answered = {c.id for c in self.calls if c.kind in ("chat", "pad") and c.id}
        orphans = [r.id for r in records if r.id not in answered]

        # Every 202 feedback trained once, or set aside with its reason, or opted out.
        trained, dead = self.accounted(db)
        twice = [k for k, n in trained.items() if n > 1]
        problems += [f"trajectory {k} trained {trained[k]} times" for k in twice]
        accepted = self.accepted()
        fate = Counter()
        for c in accepted:
            if not c.store:
                fate["opted out"] += 1
                if c.id in trained:
                    problems.append(f"opted-out {c.id} was trained")
            elif c.id in trained:
                fate["trained"] += 1
            elif c.id in dead:
                fate[f"dead letter: {dead[c.id]}"] += 1
            else:
                fate["unaccounted"] += 1
                problems.append(f"202 feedback for {c.id} neither trained nor set aside")
        fb_log = Counter((f.trajectory_id, f.reward) for f in feedback)
        for c in accepted:
            if fb_log[(c.id, c.reward)] < 1:
                problems.append(f"202 feedback for {c.id} is not in the log")

        # Failures only inside the outage windows.
        failures = [
            c for c in self.calls if c.kind != "pad" and (c.status is None or c.status >= 500 or c.broken)
        ]
        outside = [c for c in failures if self.in_window(c) is None]
        problems += [
            f"{c.kind} to slot {c.slot} at {c.t0:.2f}–{c.t1:.2f}: {c.status} {c.error[:160]} outside every window"
            for c in outside
        ]
        client_errors = [c for c in self.calls if c.status is not None and 400 <= c.status < 500]
        problems += [f"{c.kind} answered {c.status}: {c.error[:160]}" for c in client_errors]

        # Versions never go backwards, per replica slot (across its restart).
        floors = version_floors(
            [(c.t1, c.slot, c.version) for c in chats if c.version is not None]
            + [(t, s, b["policy_version"]) for t, s, code, b in self.ready_log if code == 200]
        )
        for c in ok:
            floor = floors(c.slot, c.t0)
            if c.version < floor:
                problems.append(f"{c.id} on slot {c.slot} answered from version {c.version} after {floor}")
            rec = rec_of.get(c.id)
            if rec is not None:
                spans = [v for v, _ in rec.token_versions]
                if spans != sorted(spans) or (spans and spans[0] < rec.dispatch_version):
                    problems.append(
                        f"{c.id}: token versions {rec.token_versions} from dispatch {rec.dispatch_version}"
                    )
        for r in self.restarts:
            seen = [
                (t, code, b)
                for t, s, code, b in self.ready_log
                if s == r["slot"] and r["spawned"] <= t <= r["ready"] + 2
            ]
            answers = [(t, code, b) for t, code, b in seen if code is not None]
            first_ok = next((k for k, (_, code, _) in enumerate(answers) if code == 200), None)
            if first_ok is None:
                problems.append(f"restarted slot {r['slot']}: no 200 seen")
                continue
            before = answers[:first_ok]
            r["unready_answers"] = len(before)
            r["reasons"] = sorted({b.get("policy", "") for _, _, b in before})
            if answers[first_ok][2]["policy_version"] < r["newest_at_spawn"]:
                problems.append(
                    f"restarted slot {r['slot']} ready at version {answers[first_ok][2]['policy_version']} "
                    f"below the newest at its start ({r['newest_at_spawn']})"
                )
            r["ready_version"] = answers[first_ok][2]["policy_version"]

        # The versions: 0..N, each the child of the one before, all published.
        numbers = [v for v, _, _ in versions]
        if numbers != list(range(len(numbers))):
            problems.append(f"versions are not 0..N: {numbers[:20]}…")
        problems += [f"version {v} has parent {p}" for v, p, _ in versions if v and p != v - 1]
        problems += [f"version {v} is {st}" for v, _, st in versions if st != "published"]
        announced = {e.version for e in events}
        problems += [f"version {v} has no policy event" for v in numbers if v and v not in announced]

        # Learner lives: each ended by its kill, or at its start while the database was down
        # (``saoserve learn`` migrates first and exits: compose's restart policy starts it again).
        db_windows = [w for w in self.windows if w.what == "database"]
        exits_in_outage = 0
        for life in self.lives:
            if life.rc is None:
                continue
            if life.point and life.rc == 137 or life.sigkilled and life.rc == -9:
                continue
            log_text = (self.home / f"learner-{life.n}.log").read_text(errors="replace")
            in_outage = any(life.started <= w.end and w.start <= life.ended for w in db_windows)
            if life.rc == 1 and in_outage and "Connection refused" in log_text:
                exits_in_outage += 1
                continue
            problems.append(f"learner life {life.n} ({life.point or 'unarmed'}) ended with {life.rc}")

        missed = sum(plan == SIGKILL for plan in self.plans) + sum(
            life.planned_sigkill and not life.sigkilled and life.rc is None for life in self.lives
        )
        if missed:
            problems.append(f"{missed} planned learner SIGKILL(s) not sent")

        # A killed learner is back when its next life commits a version.
        back = []
        for life in self.lives:
            if life.ended is not None:
                k = bisect.bisect_right(created, life.ended)
                if k < len(created):
                    back.append(created[k] - life.ended)

        swaps = 0.0
        with httpx.Client(timeout=10) as http:
            for r in self.replicas:
                swaps += (
                    metric(http.get(f"{r.url}/metrics").text, "saoserve_policy_swaps_total", result="ok")
                    or 0.0
                )
        swaps += sum(self.swaps_before_restart.values())
        in_windows = Counter(
            self.in_window(c).what.split(" ")[0] for c in failures if self.in_window(c) is not None
        )
        return {
            "seed": self.seed,
            "requests": {
                "chats": len(chats),
                "chats_2xx": len(ok),
                "chats_503": sum(c.status == 503 for c in chats),
                "no_answer": sum(c.status is None for c in self.calls if c.kind != "pad"),
                "broken_streams": sum(c.broken for c in chats),
                "feedback": sum(c.kind == "feedback" for c in self.calls),
                "feedback_202": len(accepted),
                "feedback_503": sum(c.kind == "feedback" and c.status == 503 for c in self.calls),
                "failures_in_windows": dict(in_windows),
                "failures_outside_windows": len(outside),
                "4xx": len(client_errors),
                "padding": sum(c.kind == "pad" for c in self.calls),
            },
            "log": {
                "trajectories": len(records),
                "trajectories_without_a_2xx": len(orphans),
                "feedback_records": len(feedback),
                "policy_events": len(events),
            },
            "feedback_fate": dict(fate),
            "versions": len(numbers) - 1,
            "swaps": swaps,
            "learner": {
                "lives": len(self.lives),
                "point_kills": sum(life.point is not None and life.rc == 137 for life in self.lives),
                "points": [life.point for life in self.lives if life.point and life.rc == 137],
                "sigkills": sum(life.sigkilled and life.rc == -9 for life in self.lives),
                "sigkill_at_s": [
                    life.sigkill_at_s for life in self.lives if life.sigkilled and life.rc == -9
                ],
                "death_to_next_version_s": sorted(round(b, 1) for b in back),
                "exits_at_start_in_a_database_outage": exits_in_outage,
            },
            "windows": [asdict(w) for w in self.windows],
            "restarts": self.restarts,
            "grace_s": self.args.grace_s,
            "problems": problems,
        }


def kill_points(spec: str, seed: int, points: tuple[str, ...]) -> list[str]:
    """The kill points of the first learner lives, one life each: ``spec`` a comma-separated
    list of ``point:n`` (``SAOSERVE_FAULT_POINT`` values), or ``all``: every point once, from a
    seeded one on, each on its first or second pass."""
    if spec != "all":
        return [p for p in spec.split(",") if p]
    rng = random.Random(seed)
    first = rng.randrange(len(points))
    return [f"{points[(first + k) % len(points)]}:{rng.randint(1, 2)}" for k in range(len(points))]


def life_plans(points: list[str], sigkills: int) -> list[str]:
    """The first learner lives' plans: the armed ``points`` in their order with ``sigkills``
    SIGKILL lives among them, the first after one armed life (the first life starts before the
    traffic), the others spread evenly over the rest; ``life_plans(["a", "b", "c"], 2)`` is
    ``["a", SIGKILL, "b", SIGKILL, "c"]`` (after 1 + 0 * 2 // 2 = 1 and 1 + 1 * 2 // 2 = 2 armed
    lives)."""
    after = [min(len(points), 1 + i * max(0, len(points) - 1) // sigkills) for i in range(sigkills)]
    plans = list(points)
    for k in reversed(after):
        plans.insert(k, SIGKILL)
    return plans


def aware_ts(t) -> float:
    """Unix seconds of a database timestamp (SQLAlchemy gives PostgreSQL's with their zone)."""
    return t.timestamp() if t.tzinfo else t.replace(tzinfo=UTC).timestamp()


def version_floors(seen: list[tuple[float, int, int]]):
    """``floor(slot, t)``: the highest version seen on ``slot`` strictly before ``t``, from
    (time, slot, version) observations (0 when none)."""
    by_slot: dict[int, tuple[list[float], list[int]]] = {}
    for t, slot, v in sorted(seen):
        times, best = by_slot.setdefault(slot, ([], []))
        times.append(t)
        best.append(max(v, best[-1]) if best else v)

    def floor(slot: int, t: float) -> int:
        times, best = by_slot.get(slot, ([], []))
        k = bisect.bisect_left(times, t)
        return best[k - 1] if k else 0

    return floor


def newest_published_retrying(db, timeout_s: float = 60) -> int:
    """The newest published version in the database, waiting out an outage."""
    from sqlalchemy import func, select
    from sqlalchemy.exc import OperationalError

    from core.db import PolicyVersion

    deadline = time.time() + timeout_s
    while True:
        try:
            with db.connect() as conn:
                return conn.execute(
                    select(func.coalesce(func.max(PolicyVersion.version), 0)).where(
                        PolicyVersion.status == "published"
                    )
                ).scalar_one()
        except OperationalError:
            if time.time() > deadline:
                raise
            time.sleep(0.5)


def print_report(r: dict) -> None:
    q = r["requests"]
    print(f"\nchaos soak, seed {r['seed']}: {r['seconds']}")
    rows = [
        ("chats sent / 2xx / 503", f"{q['chats']} / {q['chats_2xx']} / {q['chats_503']}"),
        (
            "no answer (connection refused or cut) / broken streams",
            f"{q['no_answer']} / {q['broken_streams']}",
        ),
        ("feedback sent / 202 / 503", f"{q['feedback']} / {q['feedback_202']} / {q['feedback_503']}"),
        ("failures in windows (by window)", json.dumps(q["failures_in_windows"])),
        ("failures outside windows / 4xx", f"{q['failures_outside_windows']} / {q['4xx']}"),
        (
            "trajectories in the log (without a 2xx)",
            f"{r['log']['trajectories']} ({r['log']['trajectories_without_a_2xx']})",
        ),
        ("202 feedback by fate", json.dumps(r["feedback_fate"])),
        ("versions / swaps on the replicas", f"{r['versions']} / {r['swaps']:.0f}"),
        (
            "learner lives / point kills / SIGKILLs / exits at start (database down)",
            f"{r['learner']['lives']} / {r['learner']['point_kills']} / {r['learner']['sigkills']} / "
            f"{r['learner']['exits_at_start_in_a_database_outage']}",
        ),
        ("kill points passed", ", ".join(r["learner"]["points"])),
        ("SIGKILLs: seconds into the life", str(r["learner"]["sigkill_at_s"])),
        ("learner death → next version committed (s)", str(r["learner"]["death_to_next_version_s"])),
        ("padding requests (drain)", str(q["padding"])),
    ]
    for k, v in rows:
        print(f"  {k:<58}{v}")
    print(f"  outage windows (grace {r['grace_s']} s):")
    t0 = min(w["start"] for w in r["windows"]) if r["windows"] else 0.0
    for w in r["windows"]:
        print(
            f"    {w['what']:<34} +{w['start'] - t0:7.1f} s, {w['end'] - w['start']:5.1f} s down, "
            f"every replica ready {w['recovered_s']:.2f} s after"
        )
    for rs in r["restarts"]:
        print(
            f"    restarted slot {rs['slot']}: {rs['ready'] - rs['spawned']:.1f} s to ready, "
            f"{rs.get('unready_answers', '?')} answers 503 first {rs.get('reasons', '')}, ready at version "
            f"{rs.get('ready_version', '?')} (newest at its start {rs['newest_at_spawn']}); "
            f"failed starts: {rs['failed_starts'] or 'none'}"
        )
    print(f"  problems: {len(r['problems'])}")
    for p in r["problems"][:30]:
        print(f"    {p}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of traffic and chaos per seed")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds: one soak each")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--think-s", type=float, default=0.25, help="mean pause of a client between requests")
    ap.add_argument(
        "--grace-s", type=float, default=3.0, help="seconds after a window that still count in it"
    )
    ap.add_argument(
        "--points",
        default="all",
        help="kill points of the first learner lives: 'all' (each of the seven once, seeded order) or "
        "'point:n,...'",
    )
    ap.add_argument(
        "--replica-stop",
        choices=("term", "kill"),
        default="term",
        help="how the restarted replica is stopped: SIGTERM (a rolling restart: streams finish) or "
        "SIGKILL (a crash)",
    )
    ap.add_argument("--json", type=Path, help="write the reports here")
    ap.add_argument("--keep", action="store_true", help="keep the run's folder (the processes' logs)")
    args = ap.parse_args()
    reports = []
    for seed in (int(s) for s in args.seeds.split(",")):
        home = Path(tempfile.mkdtemp(prefix=f"chaos-soak-{seed}-"))
        try:
            report = Soak(args, seed, home).run()
        finally:
            if args.keep:
                shutil.rmtree(home / "policies", ignore_errors=True)
                print(f"logs kept in {home}")
            else:
                shutil.rmtree(home, ignore_errors=True)
        print_report(report)
        reports.append(report)
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1))
    return 1 if any(r["problems"] or not r["drained"] for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
