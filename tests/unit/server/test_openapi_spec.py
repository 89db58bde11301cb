"""The served OpenAPI document says what the server does: for each request below, the spec's
verdict (valid or not) is the server's (accepted or refused at the edge). Each case is a
schemathesis finding (issue 13, item 7) or a member of its class."""

from __future__ import annotations

from types import SimpleNamespace

import jsonschema
import pytest
from pydantic import ValidationError

from server.admin.protocol import CanaryShare, LoadPolicyRequest, VersionAction
from server.chat.protocol import MAX_SEED, ChatCompletionRequest
from server.feedback.protocol import FeedbackRequest
from testing.servers import make_settings

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    from server.app import create_app

    settings = make_settings(tmp_path_factory.mktemp("spec"), max_tokens_limit=8)
    return create_app(settings, engine=SimpleNamespace(), watch_policy=False).openapi()


def spec_accepts(spec: dict, model: str, body: dict) -> bool:
    schema = {"components": spec["components"], "$ref": f"#/components/schemas/{model}"}
    return jsonschema.Draft202012Validator(schema).is_valid(body)


def server_accepts(cls, body: dict) -> bool:
    try:
        cls.model_validate(body)
    except ValidationError:
        return False
    return True


CASES = [
    # episode_token needs episode_id (a string; null is no episode)
    (ChatCompletionRequest, {"messages": USER, "episode_token": "t"}, False),
    (ChatCompletionRequest, {"messages": USER, "episode_token": "t", "episode_id": None}, False),
    (ChatCompletionRequest, {"messages": USER, "episode_token": None}, True),
    (ChatCompletionRequest, {"messages": USER, "episode_token": "t", "episode_id": "e"}, True),
    # top_logprobs > 0 needs logprobs: true
    (ChatCompletionRequest, {"messages": USER, "top_logprobs": 2}, False),
    (ChatCompletionRequest, {"messages": USER, "top_logprobs": 2, "logprobs": False}, False),
    (ChatCompletionRequest, {"messages": USER, "top_logprobs": 0}, True),
    (ChatCompletionRequest, {"messages": USER, "top_logprobs": 2, "logprobs": True}, True),
    # penalties and logit bias: only their neutral values
    (ChatCompletionRequest, {"messages": USER, "presence_penalty": 0.5}, False),
    (ChatCompletionRequest, {"messages": USER, "frequency_penalty": -1}, False),
    (ChatCompletionRequest, {"messages": USER, "presence_penalty": 0, "frequency_penalty": 0.0}, True),
    (ChatCompletionRequest, {"messages": USER, "logit_bias": {"1": 1.0}}, False),
    (ChatCompletionRequest, {"messages": USER, "logit_bias": {}}, True),
    (ChatCompletionRequest, {"messages": USER, "logit_bias": None}, True),
    # stop strings: non-empty, at most 1024 characters, at most 16
    (ChatCompletionRequest, {"messages": USER, "stop": ""}, False),
    (ChatCompletionRequest, {"messages": USER, "stop": ["a", ""]}, False),
    (ChatCompletionRequest, {"messages": USER, "stop": ["a" * 1025]}, False),
    (ChatCompletionRequest, {"messages": USER, "stop": ["s"] * 17}, False),
    (ChatCompletionRequest, {"messages": USER, "stop": ["s"] * 16}, True),
    # seed: 2^63 - 1024 is the largest (2^63 - 1 would be read as the float 2^63)
    (ChatCompletionRequest, {"messages": USER, "seed": MAX_SEED}, True),
    (ChatCompletionRequest, {"messages": USER, "seed": MAX_SEED + 1}, False),
    # NUL: refused in every stored string, allowed in text for the model
    (ChatCompletionRequest, {"messages": [{**USER[0], "name": "a\x00"}]}, False),
    (ChatCompletionRequest, {"messages": USER, "user": "\x00"}, False),
    (ChatCompletionRequest, {"messages": USER, "stream_options": {"a\x00": True}}, False),
    # stream_options: OpenAI's two booleans, with stream: true only
    (
        ChatCompletionRequest,
        {"messages": USER, "stream": True, "stream_options": {"include_usage": True}},
        True,
    ),
    (
        ChatCompletionRequest,
        {
            "messages": USER,
            "stream": True,
            "stream_options": {"include_usage": False, "include_obfuscation": True},
        },
        True,
    ),
    (
        ChatCompletionRequest,
        {"messages": USER, "stream": True, "stream_options": {"include_usage": "false"}},
        False,
    ),
    (ChatCompletionRequest, {"messages": USER, "stream": True, "stream_options": {"bogus": 1}}, False),
    (ChatCompletionRequest, {"messages": USER, "stream_options": {"include_usage": True}}, False),
    (ChatCompletionRequest, {"messages": USER, "stream": False, "stream_options": None}, True),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "h\x00i"}]}, True),
    (ChatCompletionRequest, {"messages": USER, "stop": ["\x00"]}, True),
    (LoadPolicyRequest, {"version": 1, "path": "/w\x00", "sha256": "0" * 64}, False),
    (FeedbackRequest, {"id": "c\x00", "feedback_token": "t", "reward": 1}, False),
    # an operator's reason is stored with the lifecycle event (schemathesis found the NUL unstated)
    (VersionAction, {"version": 1, "reason": "r\x00"}, False),
    (VersionAction, {"version": 1, "reason": "off-tone \u00e9"}, True),
    # feedback: exactly one of id and episode_id, exactly one of reward and thumbs
    (FeedbackRequest, {"id": "c", "feedback_token": "t", "reward": 2, "thumbs": "up"}, False),
    (FeedbackRequest, {"id": "c", "feedback_token": "t", "reward": 0.5, "thumbs": "up"}, False),
    (FeedbackRequest, {"id": "c", "feedback_token": "t", "reward": 0.5, "thumbs": None}, True),
    (FeedbackRequest, {"id": "c", "feedback_token": "t", "reward": None, "thumbs": "down"}, True),
    (FeedbackRequest, {"id": "c", "episode_id": "e", "feedback_token": "t", "reward": 1}, False),
    (FeedbackRequest, {"id": None, "episode_id": "e", "feedback_token": "t", "reward": 1}, True),
    (FeedbackRequest, {"feedback_token": "t", "reward": 1}, False),
    # the canary share: [0.01, 0.99] (core.lifecycle.check_canary_share)
    (CanaryShare, {"share": 5e-324}, False),
    (CanaryShare, {"share": 0.0099}, False),
    (CanaryShare, {"share": 0.01}, True),
    (CanaryShare, {"share": 0.2}, True),
    (CanaryShare, {"share": 0.99}, True),
    (CanaryShare, {"share": 1}, False),
    (CanaryShare, {"share": 1.5}, False),
]


@pytest.mark.parametrize(("cls", "body", "valid"), CASES)
def test_the_spec_and_the_server_agree(spec, cls, body, valid):
    assert (spec_accepts(spec, cls.__name__, body), server_accepts(cls, body)) == (valid, valid)


def test_the_spec_states_this_deployments_max_tokens(spec):
    props = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    for name in ("max_tokens", "max_completion_tokens"):
        assert [c.get("maximum") for c in props[name]["anyOf"]] == [8, None]


def test_the_seed_bound_survives_a_float():
    # 2^63 - 1024 = 9223372036854774784 is a float64; 2^63 - 1 rounds up to 2^63 as one.
    assert int(float(MAX_SEED)) == MAX_SEED == 9223372036854774784
    assert int(float(2**63 - 1)) == 2**63


def test_load_policy_documents_its_refusals(spec):
    assert {"401", "403", "413", "422"} <= set(spec["paths"]["/admin/load_policy"]["post"]["responses"])


# ------------------------------------------------------------------ typed answers
TEXT_TYPES = {"text/plain", "text/html"}


def untyped_answers(spec: dict) -> list[str]:
    """The 2xx answers of ``spec`` whose JSON body is not a typed object: no schema, an
    inline one (a bare ``dict``: ``additionalProperties`` and no properties), or a component
    without properties. A page (text/html, text/plain) needs none."""
    schemas = spec.get("components", {}).get("schemas", {})
    found = []
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            for status, answer in op["responses"].items():
                if not status.startswith("2"):
                    continue
                content = answer.get("content", {})
                where = f"{method.upper()} {path} {status}"
                if "application/json" not in content:
                    if not content or not set(content) <= TEXT_TYPES:
                        found.append(f"{where}: no JSON body and no page")
                    continue
                ref = content["application/json"].get("schema", {}).get("$ref", "")
                component = schemas.get(ref.removeprefix("#/components/schemas/"), {})
                if not ref.startswith("#/components/schemas/") or not component.get("properties"):
                    found.append(f"{where}: {content['application/json'].get('schema')}")
    return found


def test_every_answer_of_every_route_is_typed(spec):
    assert untyped_answers(spec) == []


def test_an_untyped_answer_is_found():
    from fastapi import FastAPI

    app = FastAPI()
    # No annotation, a bare dict (annotations are strings here: the decorator says it), a model.
    app.get("/a")(lambda: {})
    app.post("/b", status_code=201, response_model=dict)(lambda: {})
    app.get("/c", response_model=LoadPolicyRequest)(lambda: None)
    found = untyped_answers(app.openapi())
    assert [f.split(":")[0] for f in found] == ["GET /a 200", "POST /b 201"]


# The admin routes' answers, as the server gives them, are what the spec says (the models only
# state the dicts core builds: tests/unit/server/test_lifecycle_server.py and tests/unit/server/test_api_keys.py read them).
ADMIN_CALLS = [
    ("get", "/admin/learner", None),
    ("get", "/admin/dead_letters", None),
    ("get", "/admin/dead_letters?payload=true", None),
    ("post", "/admin/lifecycle/promote", {"version": 2, "reason": "r"}),
    ("post", "/admin/lifecycle/reject", {"version": 3}),
    ("post", "/admin/lifecycle/pin", {"version": 2}),
    ("post", "/admin/lifecycle/unpin", None),
    ("post", "/admin/lifecycle/guard", {"on": False}),
    ("post", "/admin/lifecycle/canary", {"share": 0.25}),
    ("get", "/admin/lifecycle", None),
    ("get", "/admin/quarantine", None),
    ("post", "/admin/keys", {"tenant": "acme"}),
    ("get", "/admin/keys", None),
]


async def test_the_admin_answers_are_what_the_spec_says(tmp_path):
    import httpx
    from sqlalchemy import insert

    from core.db import LearnerCounter, LearnerStep, make_engine
    from core.dead_letters import Letter, set_aside
    from core.records import utcnow
    from testing.fakes import FakeEngine
    from testing.guard import seed
    from testing.servers import ADMIN, running_server

    settings = make_settings(tmp_path)
    seed(settings.resolved_database_url)
    db = make_engine(settings.resolved_database_url)
    with db.begin() as conn:
        metrics = {"reward_mean": 0.5, "kl_ref": 1, "sample_ids": ["t1"], "none": None}
        conn.execute(
            insert(LearnerStep).values(run_id="r", step=1, version=1, metrics=metrics, created_at=utcnow())
        )
        conn.execute(insert(LearnerCounter).values(name="expired", value=3))
        set_aside(conn, [Letter(kind="malformed", reason="bad", payload=b"x\xff")], utcnow())
    db.dispose()
    answers = {}
    async with running_server(settings, FakeEngine(), watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, headers=ADMIN) as http:
            spec = (await http.get("/openapi.json")).json()
            for method, path, body in ADMIN_CALLS:
                answers[(method, path)] = await http.request(method.upper(), path, json=body)
            key = answers[("post", "/admin/keys")].json()["id"]
            for method, path in (("patch", f"/admin/keys/{key}"), ("post", f"/admin/keys/{key}/revoke")):
                answers[(method, path)] = await http.request(method.upper(), path, json={"train": False})
    for (method, path), r in answers.items():
        route = path.split("?")[0].replace(key, "{key_id}")
        status = str(r.status_code)
        assert status.startswith("2"), (path, r.text)
        schema = spec["paths"][route][method]["responses"][status]["content"]["application/json"]["schema"]
        jsonschema.Draft202012Validator({"components": spec["components"], **schema}).validate(r.json())
    assert "payload" not in answers[("get", "/admin/dead_letters")].json()["dead_letters"][0]
    assert (
        answers[("get", "/admin/dead_letters?payload=true")].json()["dead_letters"][0]["payload"] == "x\\xff"
    )
    assert answers[("get", "/admin/learner")].json()["steps"][0]["sample_ids"] == ["t1"]
