"""The chat answers' shapes (``server.chat.ChatHandler``): OpenAI's ``chat.completion`` and
``chat.completion.chunk`` with this server's extension fields, which the OpenAPI document
gives as the 200 body of ``POST /v1/chat/completions`` (``server.routes.chat``).

A field that OpenAI's answer leaves out in some cases (``logprobs`` of a chunk when none were
asked, the episode token outside an episode) is ``exclude_if`` None, so the body has the key
only when it has a value.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

CompletionId = Annotated[str, Field(description="The completion's id, also its trajectory's id.")]
Created = Annotated[int, Field(description="Unix time (s) of the dispatch.")]
PolicyVersion = Annotated[int, Field(description="The policy version the request was dispatched at.")]
PromptId = Annotated[
    str, Field(description="The task identity: the request's prompt_id, or a hash of its messages.")
]
FeedbackToken = Annotated[
    str, Field(description="The token POST /v1/feedback takes with this id (HMAC-SHA256 of the id).")
]
EpisodeFeedbackToken = Annotated[
    str | None,
    Field(
        None,
        exclude_if=lambda v: v is None,
        description="Only for an episode's turns: the token that rates the episode and extends it "
        "(episode_token).",
    ),
]
FinishReason = Annotated[
    str,
    Field(
        description="Why the engine ended the answer: stop (end of sequence or a stop string), length (max_tokens)."
    ),
]


class TopLogprob(BaseModel):
    """One token in OpenAI's logprob shape (``server.chat.token_entry``): ``token`` its text, or
    ``bytes:\\x..`` for a token that ends inside a character; ``logprob`` in nats, -inf clamped
    to -9999; ``bytes`` its UTF-8 bytes (the bytes of consecutive tokens join into the answer)."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    """A sampled token with its processed logprob (the one logged for the learner) and the most
    likely tokens at its position by rank (empty unless ``top_logprobs`` was asked)."""

    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    """``choices[].logprobs``: one entry per sampled token (``server.chat.logprobs_body``)."""

    content: list[TokenLogprob]


class Usage(BaseModel):
    """Token counts of one answer: the rendered prompt's and the sampled ones (end-of-sequence
    token included)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    """The one choice of an answer (``n`` is 1); ``logprobs`` null unless the request asked."""

    index: Literal[0] = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None


class ChatCompletion(BaseModel):
    """``POST /v1/chat/completions`` answered whole (``stream`` false): OpenAI's
    ``chat.completion``, then this server's extension fields (also sent as ``x-`` headers,
    ``server.chat.ChatHandler.extension_headers``)."""

    id: CompletionId
    object: Literal["chat.completion"] = "chat.completion"
    created: Created
    model: str
    choices: list[Choice]
    usage: Usage
    policy_version: PolicyVersion
    prompt_id: PromptId
    feedback_token: FeedbackToken
    episode_feedback_token: EpisodeFeedbackToken


class Delta(BaseModel):
    """What a chunk adds to the message: the first chunk the role (and empty content), then
    text; the last chunk's delta may be empty."""

    role: Literal["assistant"] | None = Field(None, exclude_if=lambda v: v is None)
    content: str | None = Field(None, exclude_if=lambda v: v is None)


class ChunkChoice(BaseModel):
    """The choice of a chunk: ``finish_reason`` null until the last one; ``logprobs`` (for this
    chunk's tokens) only when the request asked."""

    index: Literal[0] = 0
    delta: Delta
    finish_reason: FinishReason | None
    logprobs: ChoiceLogprobs | None = Field(None, exclude_if=lambda v: v is None)


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed answer: OpenAI's ``chat.completion.chunk``, every one
    with the extension fields (the openai SDK builds a streamed completion's fields from the first
    chunk, LangChain from the last). With ``stream_options.include_usage`` every chunk has
    ``usage``: null, and a last chunk with no choices has the counts; without, no chunk has the
    key (``server.chat.ChatHandler.chunks`` leaves it out)."""

    id: CompletionId
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: Created
    model: str
    policy_version: PolicyVersion
    prompt_id: PromptId
    feedback_token: FeedbackToken
    episode_feedback_token: EpisodeFeedbackToken
    usage: Usage | None = None
    choices: list[ChunkChoice]
