"""The chat family: ``POST /v1/chat/completions`` (OpenAI's chat completions, and this server's
extensions). ``api_router``: the route; ``protocol``: the request and answer models;
``serving``: the handler (``ChatHandler``: checks, dispatch, generation, the answer)."""
