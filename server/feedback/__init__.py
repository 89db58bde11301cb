"""The feedback family: ``POST /v1/feedback``, a reward for a completion or an episode.
``api_router``: the route; ``protocol``: the request and answer models; ``serving``: the
handler (``accept_feedback``: the token, the claim, the log)."""
