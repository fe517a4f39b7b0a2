"""Every request body of the server (unknown fields are ignored, as OpenAI's are)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictFloat, StrictInt


def _encodable(value: str) -> str:
    """``value`` if it is valid Unicode text; a lone surrogate (valid JSON, ``"\\ud800"``) is refused."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = value[error.start : error.end].encode("unicode_escape").decode("ascii")
        raise ValueError(
            f"not valid Unicode text: a lone surrogate ({bad}) at character {error.start}; send UTF-8 text"
        ) from None
    return value


#: request text: any string that is valid Unicode (what the tokenizer can encode)
Text = Annotated[str, AfterValidator(_encodable)]
#: numbers are strict: a JSON boolean is not a number (``max_tokens: true`` is refused, not 1 token;
#: ``prompt: [true, false]`` is not the token ids [1, 0]); a float field takes an integer
Int = StrictInt
Float = StrictFloat


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: Text | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer"]
    content: Text | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content if part.type == "text")


class Compression(BaseModel):
    """The per-request compression options (within the server's limits)."""

    model_config = ConfigDict(extra="ignore")
    method: str | None = None
    budget: Float | None = None
    window: Int | None = None


class ContextCreate(Compression):
    text: Text
    #: ``False``: answer 202 at once with the id, compress in the background (``GET`` shows the status)
    wait: bool = True


class ChatRequest(Compression):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    stream: bool = False
    temperature: Float | None = None
    top_p: Float | None = None
    n: Int | None = None
    seed: Int | None = None
    stop: Any = None  # a string or a list (checked by serve.prepare.stops_of, which names the field)
    context_id: str | None = None


class CompletionRequest(Compression):
    """A legacy completions request: text, token ids, or a list of either (one choice each)."""

    model: str
    prompt: Text | list[Int] | list[Text] | list[list[Int]]
    max_tokens: Int | None = None  # left out: 16 (OpenAI's default), at most the server's cap
    temperature: Float | None = None
    top_p: Float | None = None
    seed: Int | None = None
    stop: Any = None
    logprobs: Int | None = None
    echo: bool = False
    n: Int | None = None
    stream: bool = False
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens tokens (benchmarks)
