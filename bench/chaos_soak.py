"""One chaos soak: sustained traffic while versions swap, the learner is killed, the database and
the broker go down and a replica restarts; audited from the database and the log (issue 23).

The parts are the existing harnesses: ``saoserve serve`` replicas and ``saoserve learn`` started
as a user starts them (testing/replicas.py), a PostgreSQL cluster of the soak's own that it stops
and starts (testing/dependencies.py ``PgCluster``, as tests/system/test_outages.py), a tansu broker it
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
``--json FILE`` writes them. tests/system/test_chaos_soak.py runs a short soak (opt-in: ``SAOSERVE_SOAK=1``);
the command is in docs/reliability.md, "The chaos soak", its measured runs in
docs/log/2026-12-06-reliability-runs.md.

The run and its drain are here; the traffic is bench/soak_traffic.py, the faults
bench/soak_faults.py, the audit and the printed report bench/soak_audit.py (imported as this
script's neighbours).

    flock /tmp/saoserve-heavy.lock .venv/bin/python bench/chaos_soak.py \\
        [--duration 300] [--seeds 0[,1...]] [--clients 4] [--think-s 0.25] [--points all]
        [--replica-stop term|kill] [--grace-s 3] [--json FILE] [--keep]
"""

from __future__ import annotations

import argparse
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from soak_audit import SoakAudit, print_report
from soak_faults import Life, SoakFaults, Window, kill_points, life_plans
from soak_traffic import EXPIRE_S, Call, SoakTraffic

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from testing.replicas import Deployment, Process, Replica

# The harness lives in testing/ (installed with the package; found on the path from ROOT too).
ROOT = Path(__file__).resolve().parent.parent
# Files of the prepared model that a tiny model with the same tokenizer shares.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
BATCH = 16


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
class Soak(SoakTraffic, SoakFaults, SoakAudit):
    """One soak of ``seed`` in the folder ``home``: the deployment and its database, what the
    clients saw (``calls``), the outage windows, the learner's lives and plans, the monitor's
    ``/readyz`` log, the replica restarts; the traffic (bench/soak_traffic.py), the faults
    (bench/soak_faults.py) and the audit (bench/soak_audit.py) work on these fields, the
    threads under ``lock``."""

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

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        sys.path.insert(0, str(ROOT))
        from learner.config import build_config
        from learner.faults import CYCLE_POINTS
        from saoserve.model import prepare_model
        from testing.dependencies import PgCluster, TansuBroker
        from testing.replicas import Deployment

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
