"""The log of one policy's parts: its lines name the policy they are about."""

from __future__ import annotations

import logging


class PolicyLog(logging.LoggerAdapter):
    """``logger`` with each line prefixed by the policy it is about (``acme: ...``, the global
    policy's ``global: ...``, as /readyz names a tenant's problems) and the record's ``policy``
    attribute set: the log of a policy's watcher, canary router and state, and of the scrape's
    reads of its database."""

    def __init__(self, logger: logging.Logger, policy: str) -> None:
        super().__init__(logger, {"policy": policy})

    def process(self, msg, kwargs):
        msg, kwargs = super().process(msg, kwargs)
        return f"{self.extra['policy']}: {msg}", kwargs
