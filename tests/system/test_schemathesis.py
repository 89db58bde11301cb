"""schemathesis against the running server's own OpenAPI spec: every operation, with and
without the admin key, answers no 5xx, and the spec says what the server does (no schema
mismatch: valid requests accepted, invalid ones refused, answers and statuses as declared).

The fuzzer runs as its CLI in a subprocess (it is synchronous; the server and the shared
vLLM engine run in this test's event loop). The server caps ``max_tokens`` at 8 so that
accepted chat requests stay cheap; the spec it serves states that bound.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from testing.servers import ADMIN, make_settings, running_server

pytestmark = pytest.mark.engine

SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
# Examples per operation and phase: bounds the run (accepted chat requests generate tokens).
MAX_EXAMPLES = 12


async def fuzz(url: str, report: Path, headers: dict[str, str]) -> tuple[list[dict], Counter]:
    """Run schemathesis on ``url``'s spec; return its findings (see ``findings_of``)."""
    args = [
        str(SCHEMATHESIS),
        "run",
        f"{url}/openapi.json",
        "--checks",
        "all",
        # Keep testing an operation after a finding, so a 5xx is not hidden behind a
        # schema mismatch found first.
        "--continue-on-failure",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--seed",
        "1",
        "--workers",
        "1",
        "--phases",
        "examples,coverage,fuzzing",
        "--suppress-health-check",
        "all",
        "--request-timeout",
        "120",
        "--report",
        "ndjson",
        "--report-ndjson-path",
        str(report),
        "--no-color",
    ]
    for k, v in headers.items():
        args += ["-H", f"{k}: {v}"]
    # In the report's folder: schemathesis keeps a cache folder in its working directory.
    proc = await asyncio.create_subprocess_exec(
        *args, cwd=report.parent, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    text = out.decode(errors="replace")
    print(text[-6000:])
    assert report.is_file(), text[-3000:]
    return findings_of(report)


def findings_of(report: Path) -> tuple[list[dict], Counter]:
    """The failed checks of a schemathesis NDJSON report (check, code, operation, status,
    message) and the count of every response status it received."""
    failures: list[dict] = []
    statuses: Counter = Counter()
    for line in report.read_text().splitlines():
        scenario = json.loads(line).get("ScenarioFinished")
        if not scenario:
            continue
        recorder = scenario["recorder"]
        interactions = recorder.get("interactions", {})
        for interaction in interactions.values():
            if interaction.get("response"):
                statuses[interaction["response"]["status_code"]] += 1
        for case_id, checks in recorder.get("checks", {}).items():
            response = (interactions.get(case_id) or {}).get("response") or {}
            for check in checks:
                if check.get("status") != "failure":
                    continue
                info = (check.get("failure_info") or {}).get("failure") or {}
                failures.append(
                    {
                        "check": check["name"],
                        "code": info.get("code"),
                        "operation": info.get("operation") or recorder.get("label"),
                        "status": response.get("status_code"),
                        "message": (info.get("message") or "")[:300],
                    }
                )
    return failures, statuses


# Findings the spec cannot express, each (check, operation, status):
KNOWN = {
    # A weights directory must exist and hold the serving model's tensors with the given
    # checksum: a well-formed body naming anything else is refused (422, swap_refused).
    ("positive_data_acceptance", "POST /admin/load_policy", 422),
    # Only a version recorded in policy_versions is served (404 for any other number).
    ("positive_data_acceptance", "POST /admin/load_policy", 404),
    # One model is served: any other name is 404 model_not_found.
    ("positive_data_acceptance", "GET /v1/models/{model}", 404),
}
# Not about the spec: a response slower than schemathesis's default limit (speed belongs in
# bench/, and this machine's cores are shared with the engine).
NOT_SPEC_CHECKS = {"max_response_time"}


def spec_mismatches(failures: list[dict]) -> list[dict]:
    """The findings that say the spec and the server disagree, less the known ones above."""
    return [
        f
        for f in failures
        if f["check"] not in NOT_SPEC_CHECKS and (f["check"], f["operation"], f["status"]) not in KNOWN
    ]


@pytest.mark.parametrize("admin", [True, False], ids=["admin-key", "no-key"])
async def test_no_operation_answers_5xx_or_disagrees_with_the_spec(policy_engine, tmp_path, admin):
    settings = make_settings(tmp_path, max_tokens_limit=8, default_max_tokens=4)
    async with running_server(settings, policy_engine, watch_policy=False) as url:
        failures, statuses = await fuzz(url, tmp_path / "events.ndjson", ADMIN if admin else {})
    print("responses by status:", dict(statuses))
    for key, n in Counter((f["code"], f["check"], f["operation"], f["status"]) for f in failures).items():
        print("schemathesis finding:", n, key)
    assert sum(statuses.values()) > 0
    server_errors = [f for f in failures if f["check"] == "not_a_server_error" or (f["status"] or 0) >= 500]
    assert server_errors == [] and not any(s >= 500 for s in statuses), (server_errors, statuses)
    assert spec_mismatches(failures) == []
