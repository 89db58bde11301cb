"""What the openai SDK (unchanged) meets on the real app without generating
(``testing.fakes.FakeEngine``; issue 23 findings 3, 5 and 10): the ``developer`` role is the
system role, and ``client.models.retrieve(name)`` the model's card (another name 404
``model_not_found``). On the engine: tests/system/test_real_clients.py."""

from __future__ import annotations

import openai
import pytest

from server.chat.protocol import ChatCompletionRequest
from server.chat.serving import messages_of
from testing.fakes import FakeEngine
from testing.servers import MODEL, make_settings, running_server, sdk


def test_the_developer_role_is_the_system_role():
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    )
    as_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert messages_of(req) == as_system


async def test_models_retrieve(tmp_path):
    async with running_server(make_settings(tmp_path), FakeEngine(version=7), watch_policy=False) as url:
        client = sdk(url, max_retries=0)
        card = await client.models.retrieve(MODEL)
        assert (card.id, card.object, card.owned_by) == (MODEL, "model", "saoserve")
        assert card.model_extra["policy_version"] == 7
        for other in ("gpt-4o", "org/name"):
            with pytest.raises(openai.NotFoundError) as e:
                await client.models.retrieve(other)
            assert e.value.body == {
                "message": f"model {other!r} does not exist; this server serves {MODEL!r}",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
            assert e.value.response.headers["x-should-retry"] == "false"
