"""The OpenAI wire format: request models (validated strictly) and response/chunk builders.

Why strict: a client that sends `"max_tokens": "10"` or `"temperature": "hot"` has a bug, and the
OpenAI API answers it with a 400; silently coercing would hide the bug and make our server accept
what the real API refuses. Unknown fields are ignored (clients send `user`, `metadata`, ...), but
known OpenAI features we do not implement must have their neutral value, or the request is refused
rather than half-served.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_STOP_STRINGS = 16


class APIError(Exception):
    """An error the client caused (or that the server reports), rendered as OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


# OpenAI features we do not implement, with the values that mean "not used".
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
}


class _GenerationRequest(_Strict):
    """Fields shared by both endpoints."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # extension (vLLM's): -1 or 0 = off
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: bool | None = None  # extension: False decodes one token per step; None: the server's default
    # Present only so that non-neutral values are refused instead of ignored.
    frequency_penalty: Any = None
    presence_penalty: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None
    tools: Any = None
    functions: Any = None
    best_of: Any = None
    echo: Any = None
    suffix: Any = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported (one sequence per request)")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stop

    @model_validator(mode="after")
    def _unsupported(self) -> _GenerationRequest:
        for name, neutral in _NEUTRAL.items():
            value = getattr(self, name)
            if value is not None and not any(value == v and type(value) is type(v) for v in neutral):
                # Not a ValueError: pydantic would wrap it; this names the field and says what is wrong.
                raise APIError(
                    400,
                    f"{name}={json.dumps(value)[:40]} is not supported by this server",
                    param=name,
                    code="unsupported_parameter",
                )
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def completion_limit(self) -> int | None:
        return self.max_tokens


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str]

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, prompt: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if isinstance(prompt[0], str) and len(prompt) != 1:
                raise ValueError("only one prompt per request is supported (batch size 1)")
        elif prompt == "":
            raise ValueError("prompt must not be empty")
        return prompt


def parse_request(model: type[_Strict], body: bytes) -> Any:
    """Validate a raw body; every failure becomes a 400 naming the offending field."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        return model.model_validate(data, strict=None)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        # Drop pydantic's union-branch tags ("prompt.str", "stop.list[str]") from the path.
        path = [str(p) for p in first["loc"] if not _is_type_tag(p)]
        message = first["msg"].removeprefix("Value error, ")
        param = path[0] if path else None
        raise APIError(400, f"{'.'.join(path)}: {message}" if path else message, param=param) from None


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and (part in {"str", "int", "float", "bool"} or "[" in part)


# ---- responses ------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseBuilder:
    """Builds the JSON objects of one response (chat or text completion, streamed or not).

    One class for both endpoints because they differ only in object names and where the text goes.
    """

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _choice(self, text: str | None, finish_reason: str | None, role: bool = False, delta: bool = False):
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        if delta:
            body: dict[str, Any] = {}
            if role:
                body["role"] = "assistant"
            if text is not None:
                body["content"] = text
            return {"index": 0, "delta": body, "logprobs": None, "finish_reason": finish_reason}
        return {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }

    def full(self, text: str, finish_reason: str, use: dict[str, int], stats: dict[str, Any]) -> dict[str, Any]:
        out = self._envelope("chat.completion" if self.chat else "text_completion", [self._choice(text, finish_reason)])
        out["usage"] = use
        out["mtp"] = stats
        return out

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        role: bool = False,
        include_usage: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        out = self._envelope(obj, [self._choice(text, finish_reason, role=role, delta=True)])
        if include_usage:
            out["usage"] = None
        if extra is not None:
            out["mtp"] = extra
        return out

    def usage_chunk(self, use: dict[str, int]) -> dict[str, Any]:
        out = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        out["usage"] = use
        return out


def sse(obj: dict[str, Any] | str) -> str:
    """One server-sent event (OpenAI sends `data: <json>` lines and a final `data: [DONE]`)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"
