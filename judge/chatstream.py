"""A streamed chat completion (server-sent events), put back into the non-streaming body.

The simulation streams its requests so that it knows when each answer's first text reached the
user (``t_first_token``, issue 10). The server's chunks follow OpenAI's
``chat.completion.chunk`` shape; its finish chunk also carries the extension fields the
feedback route needs (``policy_version``, ``feedback_token``). SSE lines end at ``"\\n"`` only:
httpx's ``aiter_lines`` would also split at U+2028, U+0085 and the like, which the server's
JSON (``ensure_ascii=False``) keeps raw, so lines are split here.
"""

from __future__ import annotations

import json
from collections.abc import Callable


class StreamError(ValueError):
    """The stream carried an error chunk, or a chunk that is not JSON (cut short)."""


class ChatStream:
    """Feed the response text as it arrives (``feed``), then ``close`` for the body.

    ``clock``: read once, when the first chunk with text arrives (``first_text_at``; None until
    then). ``close`` returns ``{"id", "policy_version", "feedback_token", "choices":
    [{"message": {"role": "assistant", "content"}, "finish_reason"}]}``, the content joined
    from the deltas and the rest from the finish chunk, or None if no finish chunk came.
    ``feed`` and ``close`` raise ``StreamError`` on an error chunk or a line that is not JSON.
    """

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self._pending = ""
        self._parts: list[str] = []
        self._final: dict | None = None
        self.first_text_at: float | None = None

    def feed(self, text: str) -> None:
        *lines, self._pending = (self._pending + text).split("\n")
        for line in lines:
            self._take(line.rstrip("\r"))

    def close(self) -> dict | None:
        if self._pending:
            self._take(self._pending.rstrip("\r"))
            self._pending = ""
        final = self._final
        if final is None:
            return None
        return {
            "id": final["id"],
            "policy_version": final["policy_version"],
            "feedback_token": final["feedback_token"],
            "choices": [
                {
                    "message": {"role": "assistant", "content": "".join(self._parts)},
                    "finish_reason": final["choices"][0]["finish_reason"],
                }
            ],
        }

    def _take(self, line: str) -> None:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        try:
            chunk = json.loads(line[len("data: ") :])
        except json.JSONDecodeError as exc:
            raise StreamError(f"a chunk that is not JSON: {line[:80]!r}") from exc
        if "error" in chunk:
            raise StreamError(f"error chunk: {chunk['error']}")
        for choice in chunk.get("choices") or []:
            text = (choice.get("delta") or {}).get("content") or ""
            if text and self.first_text_at is None:
                self.first_text_at = self._clock()
            self._parts.append(text)
            if choice.get("finish_reason") is not None:
                self._final = chunk
