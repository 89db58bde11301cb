"""judge.chatstream: a streamed chat completion put back together, fed in arbitrary pieces."""

from __future__ import annotations

import pytest

from judge.chatstream import ChatStream, StreamError

ROLE = 'data: {"id": "c1", "choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}\n\n'
TEXT = 'data: {"id": "c1", "choices": [{"delta": {"content": "Arr, ye"}, "finish_reason": null}]}\n\n'
FINISH = (
    'data: {"id": "c1", "choices": [{"delta": {"content": "!"}, "finish_reason": "stop"}], '
    '"policy_version": 2, "feedback_token": "t"}\n\ndata: [DONE]\n\n'
)


def test_pieces_cut_anywhere_give_the_same_body_and_one_clock_read() -> None:
    """The three chunks cut into 7-character pieces (lines split across feeds, "\\r\\n" kept out):
    content "" + "Arr, ye" + "!" = "Arr, ye!"; the clock is read once, at the first text."""
    reads = iter([4.0, 99.0])
    stream = ChatStream(lambda: next(reads))
    text = ROLE + TEXT.replace("\n\n", "\r\n\r\n") + FINISH
    for k in range(0, len(text), 7):
        stream.feed(text[k : k + 7])
    assert stream.close() == {
        "id": "c1",
        "policy_version": 2,
        "feedback_token": "t",
        "choices": [{"message": {"role": "assistant", "content": "Arr, ye!"}, "finish_reason": "stop"}],
    }
    assert stream.first_text_at == 4.0


def test_a_last_line_without_its_newline_is_read_at_close() -> None:
    stream = ChatStream(lambda: 1.0)
    stream.feed(TEXT + FINISH.split("\n")[0])
    assert stream.close()["choices"][0]["message"]["content"] == "Arr, ye!"


def test_no_finish_chunk_is_no_body() -> None:
    stream = ChatStream(lambda: 1.0)
    stream.feed(ROLE + TEXT)
    assert stream.close() is None and stream.first_text_at == 1.0


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('data: {"error": {"message": "log unavailable"}}\n\n', "error chunk"),
        ('data: {"id": "c1", "choi\n\n', "not JSON"),
    ],
    ids=["error-chunk", "cut-short"],
)
def test_an_error_chunk_or_a_broken_line_raises(text: str, needle: str) -> None:
    with pytest.raises(StreamError, match=needle):
        ChatStream(lambda: 1.0).feed(text)
