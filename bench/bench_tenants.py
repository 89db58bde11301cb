"""Two tenants with opposite preferences in one run on one engine (issue 20, "Tenants";
docs/tenants.md, "A policy per tenant").

One ``saoserve serve`` with ``SAOSERVE_TENANT_POLICIES=acme,beta`` and adapter serving, one API
key per tenant (``POST /admin/keys``), two ``saoserve learn --tenant T`` processes (or with
``--one-learner`` one ``saoserve learn --tenants global,acme,beta``: the three policies' learners
on one shared base in one process) (LoRA, the
``demo`` preset at batch ``--batch-size``, the guard off so every version serves all its
tenant's traffic), and two open-loop simulations at once, one per tenant, each sending its
tenant's key: acme's simulated users reward ``pirate`` answers, beta's ``poetic`` ones, judged
by the one offline judge. Both offer the same two styles in the system prompt, so at version 0
the tenants ask one policy the same question and a tenant's share of the OTHER tenant's style
(cross-talk) starts where its own target's does.

After ``--seconds`` (wall clock, the simulations' budget) the table has, per tenant: versions
reached (served at the end), its target's share among the answers of the first and of the last
``--window`` versions (default: a third of the versions that served answers, so each segment
holds about a third of the answers), the other tenant's style's share in the same two segments,
rated answers
(feedback posted) and the learner's median step time. A policy per tenant shows as each target
share rising while the cross-talk does not follow the other tenant's target. Records, details
and the table go to ``--out``; the servers' and learners' logs to ``--out/logs``.

    flock /tmp/saoserve-heavy.lock .venv/bin/python bench/bench_tenants.py --out /tmp/bench-tenants \\
        [--seconds 600] [--batch-size 8] [--concurrency 4] [--window N] [--seed 0] [--one-learner]

Every process started is stopped at the end, also on an error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from core.policies import GLOBAL
from judge.sim_config import SimulationConfig
from judge.sim_result import SimulationResult, save_records
from judge.simulate import Simulation
from judge.styles import Schedule, Segment, system_prompt, writing_requests
from learner.config import build_config
from saoserve.demo import sigterm_as_ctrl_c, wait_until_ready
from saoserve.model import prepare_model
from saoserve.ports import free_port
from saoserve.run_options import make_judge

TENANTS = {"acme": "pirate", "beta": "poetic"}
"""Each tenant and the style its simulated users reward."""
OFFERED = ("pirate", "poetic")
"""The styles both tenants' system prompt offers."""
NEVER_ENDS = 100_000
"""Steps of the constant schedule: the run ends on its time budget, not on the schedule."""
PROGRESS_S = 30.0
"""Seconds between two progress lines."""
MODEL_DIR = Path(__file__).resolve().parent.parent / "var" / "model"
"""The prepared model the tests use too (``saoserve.model.prepare_model``)."""


def learner_config(batch_size: int, lora_rank: int, guard: bool) -> str:
    """The tenants' learner config as JSON: the ``demo`` preset (bf16, policy lr 1e-4 → LoRA lr
    1e-3, critic 2e-4, β1 0.5, KL anchor 0.04; docs/log/2026-12-05-demo-runs.md) with a LoRA policy of ``lora_rank``
    (docs/lora.md), ``batch_size`` samples a step and the guard on or off (off: every version is
    promoted when recorded and serves all of its tenant's requests). Raises
    ``learner.config.ConfigError`` for a value the config refuses."""
    config = build_config(
        "demo",
        overrides={
            "batch_size": batch_size,
            "policy": {"kind": "lora", "rank": lora_rank},
            "guard": {"enabled": guard},
        },
    )
    return config.to_json()


class TenantServices:
    """One server and a learner per tenant as child processes of one home folder (SQLite and the
    SQL-table log under it; each tenant's namespace in ``<home>/tenants/<t>``)."""

    def __init__(self, home: Path, log_dir: Path, learner_threads: int):
        self.home = home
        self.log_dir = log_dir
        self.port = free_port()
        self.admin_key = secrets.token_hex(16)
        self.learner_threads = learner_threads
        self.env = os.environ | {
            "SAOSERVE_HOME": str(home),
            "SAOSERVE_FEEDBACK_SECRET": secrets.token_hex(16),
            "SAOSERVE_ADMIN_KEY": self.admin_key,
            "SAOSERVE_TENANT_POLICIES": ",".join(TENANTS),
            "SAOSERVE_ADAPTER_SERVING": "adapter",
            # Three slots a policy (core.settings.SLOTS_PER_POLICY), three policies.
            "SAOSERVE_MAX_CPU_LORAS": "9",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
        }
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        exe = Path(sys.executable).with_name("saoserve")
        with open(self.log_dir / f"{name}.log", "w") as out:
            self.procs[name] = subprocess.Popen(
                [str(exe), *args], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def start_server(self, timeout_s: float = 600) -> None:
        """Start ``saoserve serve`` and wait for ``/readyz``. Raises RuntimeError if it exits,
        TimeoutError if it is not ready within ``timeout_s``."""
        self._spawn("server", ["serve", "--port", str(self.port)], self.env)
        wait_until_ready(self.url, self.procs["server"], self.log_dir / "server.log", timeout_s)

    def start_learner(self, tenant: str, config: Path) -> None:
        """``saoserve learn --tenant TENANT --config CONFIG``, on ``learner_threads`` threads
        (two learners and the engine share the machine's cores)."""
        env = self.env | {"OMP_NUM_THREADS": str(self.learner_threads)}
        self._spawn(f"learner-{tenant}", ["learn", "--tenant", tenant, "--config", str(config)], env)

    def start_one_learner(self, policies: list[str], config: Path) -> None:
        """``saoserve learn --tenants P1,P2,… --config CONFIG``: every policy's learner in one
        process on one shared base (``learner.tenants``, docs/tenants.md "Many tenants in one
        learner"), on ``learner_threads`` threads."""
        env = self.env | {"OMP_NUM_THREADS": str(self.learner_threads)}
        self._spawn("learner", ["learn", "--tenants", ",".join(policies), "--config", str(config)], env)

    def create_key(self, tenant: str) -> str:
        """A new API key of ``tenant`` (``POST /admin/keys``), trusted: it sends the ratings of
        every simulated user of the tenant, which the guard's vote cap would otherwise hold to
        one a window (docs/guard.md, "Who votes"). Raises httpx.HTTPStatusError."""
        r = httpx.post(
            f"{self.url}/admin/keys",
            json={"tenant": tenant, "trusted": True},
            headers={"Authorization": f"Bearer {self.admin_key}"},
            timeout=30,
        )
        r.raise_for_status()
        return r.json()["key"]

    def check_key(self, tenant: str, key: str) -> dict:
        """The model card ``key`` is served (``GET /v1/models``). Raises RuntimeError unless it
        names ``tenant``'s policy (a server without a policy per tenant serves every key by the
        global one, and the run would measure nothing)."""
        r = httpx.get(f"{self.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        r.raise_for_status()
        card = r.json()["data"][0]
        if card.get("policy") != tenant:
            raise RuntimeError(
                f"the key of {tenant!r} is served by policy {card.get('policy')!r}, not its own "
                f"(GET /v1/models: {card}); does the server serve SAOSERVE_TENANT_POLICIES?"
            )
        return card

    def exited(self) -> str | None:
        """A line naming the first child that has exited (and its log), or None while all run."""
        for name, p in self.procs.items():
            code = p.poll()
            if code is not None:
                why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                return f"{name} exited ({why}); see {self.log_dir / name}.log"
        return None

    def stop(self) -> None:
        """SIGTERM every child's process group (learners first), SIGKILL after 30 s; SIGTERM as
        ``saoserve.demo.Services.stop``: a child of a background job ignores SIGINT."""
        for p in reversed(self.procs.values()):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs.values()):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs.clear()


def segment(records: list[dict], steps: range, target: str, other: str) -> dict:
    """The answers generated by the versions ``steps`` (``record["step"]``: first token's
    version minus the version at the start): their count, the shares detected as ``target`` and
    as ``other`` (None when there is no answer) and the mean reward."""
    seg = [r for r in records if r["step"] in steps]
    n = len(seg)
    return {
        "steps": [steps.start, steps.stop - 1],
        "answers": n,
        "target_share": sum(r["detected_style"] == target for r in seg) / n if n else None,
        "other_share": sum(r["detected_style"] == other for r in seg) / n if n else None,
        "reward_mean": statistics.fmean(r["reward"] for r in seg) if n else None,
    }


def tenant_row(tenant: str, result: SimulationResult, window: int | None = None) -> dict:
    """One tenant's line of the table: versions reached (the version served at the end minus
    the one at the start), the first and the last ``window`` versions' segments (None: a third
    of the versions that served answers, at least 1; ``segment``:
    target = the tenant's style, other = the other tenant's), rated answers (feedback posted),
    the learner's steps and their median ``step_time_s``."""
    target = TENANTS[tenant]
    (other,) = (s for t, s in TENANTS.items() if t != tenant)
    records = result.records
    last_step = max((r["step"] for r in records), default=0)
    window = window or max(1, (last_step + 1) // 3)
    served = result.timeline[-1]["version"] if result.timeline else result.start_version
    times = [s["step_time_s"] for s in result.learner_steps if "step_time_s" in s]
    return {
        "tenant": tenant,
        "target": target,
        "other": other,
        "versions": served - result.start_version,
        "answers": len(records),
        "rated": sum(r.get("t_feedback") is not None for r in records),
        "window": window,
        "first": segment(records, range(0, window), target, other),
        "last": segment(records, range(max(0, last_step - window + 1), last_step + 1), target, other),
        # Fewer than two windows of versions: the two segments share answers.
        "overlap": last_step - window + 1 < window,
        "learner_steps": len(result.learner_steps),
        "step_time_median_s": statistics.median(times) if times else None,
        "request_failures": result.request_failures,
        "judge_failures": result.judge_failures,
    }


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    head = (
        "| tenant (rewards) | versions | target share first → last | other's style (cross-talk) "
        "first → last | answers first / last | rated | learner steps | step s (median) |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        f, la = r["first"], r["last"]
        step = "–" if r["step_time_median_s"] is None else f"{r['step_time_median_s']:.1f}"
        lines.append(
            f"| {r['tenant']} ({r['target']}) | {r['versions']} "
            f"| {_pct(f['target_share'])} (v{f['steps'][0]}–{f['steps'][1]}) → {_pct(la['target_share'])} "
            f"(v{la['steps'][0]}–{la['steps'][1]}) "
            f"| {r['other']}: {_pct(f['other_share'])} → {_pct(la['other_share'])} "
            f"| {f['answers']} / {la['answers']} | {r['rated']} of {r['answers']} "
            f"| {r['learner_steps']} | {step} |"
        )
    return head + "\n".join(lines) + "\n"


def simulations(args: argparse.Namespace, url: str, admin_key: str, keys: dict[str, str]) -> dict:
    """One open-loop simulation per tenant, with its key and policy: a constant schedule of its
    target, seed ``args.seed + i`` for the i-th tenant, both offering ``OFFERED``."""
    judge = make_judge("offline")
    # Load the judge's embedding model now, not while the first answers wait on the clock.
    judge.judge_many([(writing_requests()[0], "Ahoy matey, the treasure be ours!", OFFERED[0])])
    sims = {}
    for i, (tenant, style) in enumerate(TENANTS.items()):
        cfg = SimulationConfig(
            base_url=url,
            schedule=Schedule((Segment(style, NEVER_ENDS),)),
            batch_size=args.batch_size,
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
            seed=args.seed + i,
            admin_key=admin_key,
            api_key=keys[tenant],
            policy=tenant,
            mode="async",
            max_seconds=args.seconds,
            # The demo's cap: at most two batches waiting for the learner (docs/log/2026-12-05-demo-runs.md).
            max_backlog=2 * args.batch_size,
        )
        sim = Simulation(cfg, judge)
        # Both tenants are offered both styles (a constant schedule offers its one style only).
        sim.system = system_prompt(OFFERED)
        sims[tenant] = sim
    return sims


async def drive(sims: dict[str, Simulation], services: TenantServices) -> str | None:
    """Run the simulations together until their budget ends, printing progress; if a child
    process exits first, cancel them (their results keep what was measured) and return why."""
    tasks = {t: asyncio.ensure_future(s.run()) for t, s in sims.items()}
    t0 = time.monotonic()
    next_line = PROGRESS_S
    why = None
    while not all(task.done() for task in tasks.values()):
        await asyncio.wait(set(tasks.values()), timeout=2.0)
        why = None if all(task.done() for task in tasks.values()) else services.exited()
        if why:
            print(f"{why}: stopping the simulations", file=sys.stderr)
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            break
        if time.monotonic() - t0 >= next_line:
            next_line += PROGRESS_S
            parts = []
            for t, s in sims.items():
                recent = s.result.records[-16:]
                share = (
                    sum(r["detected_style"] == TENANTS[t] for r in recent) / len(recent) if recent else 0.0
                )
                served = s.result.timeline[-1]["version"] if s.result.timeline else 0
                parts.append(
                    f"{t}: v{served}, {len(s.result.records)} answers, "
                    f"{TENANTS[t]} {100 * share:.0f}% of the last {len(recent)}"
                )
            print(f"{time.monotonic() - t0:5.0f} s  " + "; ".join(parts), file=sys.stderr)
    for task in tasks.values():
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()
    return why


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/bench-tenants"))
    p.add_argument("--seconds", type=float, default=600.0, help="simulation budget, wall-clock s (600)")
    p.add_argument("--batch-size", type=int, default=8, help="learner batch, samples a step (8)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight per tenant (4)")
    p.add_argument("--max-tokens", type=int, default=48, help="answer tokens (48, as the demo)")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument(
        "--window", type=int, default=None, help="versions in the first and last segment (a third of them)"
    )
    p.add_argument("--seed", type=int, default=0, help="acme's seed; beta's is the next one")
    p.add_argument("--learner-threads", type=int, default=1, help="torch threads per learner (1)")
    p.add_argument("--guard", action="store_true", help="run the learners' guard (canary split) too")
    p.add_argument(
        "--one-learner",
        action="store_true",
        help="one `saoserve learn --tenants global,acme,beta` process instead of one per tenant",
    )
    p.add_argument(
        "--model-dir", type=Path, default=MODEL_DIR, help="prepared model (var/model of the checkout)"
    )
    p.add_argument("--keep-home", action="store_true", help="keep the run's home (databases, adapters)")
    args = p.parse_args(argv)
    if (args.window is not None and args.window < 1) or args.seconds <= 0:
        p.error("--window must be >= 1 and --seconds > 0")
    config = learner_config(args.batch_size, args.lora_rank, args.guard)
    model_dir = prepare_model(args.model_dir).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="bench-tenants-"))
    (home / "model").symlink_to(model_dir, target_is_directory=True)
    (home / "learner.json").write_text(config, encoding="utf-8")
    services = TenantServices(home, args.out / "logs", args.learner_threads)
    sims: dict[str, Simulation] = {}
    stopped_by = None
    started = time.time()
    with sigterm_as_ctrl_c():
        try:
            print(f"starting the server in {home} …", file=sys.stderr)
            services.start_server()
            keys = {t: services.create_key(t) for t in TENANTS}
            cards = {t: services.check_key(t, k) for t, k in keys.items()}
            if args.one_learner:
                services.start_one_learner([GLOBAL, *TENANTS], home / "learner.json")
            else:
                for t in TENANTS:
                    services.start_learner(t, home / "learner.json")
            sims = simulations(args, services.url, services.admin_key, keys)
            print(
                f"server ready, cards {cards}; running the tenants for {args.seconds:.0f} s", file=sys.stderr
            )
            try:
                stopped_by = asyncio.run(drive(sims, services))
            except KeyboardInterrupt:
                stopped_by = "interrupted"
        finally:
            services.stop()
            if not args.keep_home:
                shutil.rmtree(home, ignore_errors=True)
    rows = [tenant_row(t, sims[t].result, args.window) for t in sims]
    for t, sim in sims.items():
        save_records(args.out / f"records-{t}.jsonl", sim.result.records)
        (args.out / f"details-{t}.json").write_text(json.dumps(sim.result.details(), default=str))
    text = table(rows)
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "started_at": started,
        "wall_s": time.time() - started,
        "stopped_by": stopped_by,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "learner_config": json.loads(config),
        "tenants": rows,
    }
    (args.out / "result.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    (args.out / "table.md").write_text(text, encoding="utf-8")
    print(text)
    if stopped_by:
        print(f"partial: {stopped_by}", file=sys.stderr)
    return 1 if stopped_by else 0


if __name__ == "__main__":
    sys.exit(main())
