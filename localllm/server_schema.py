"""The OpenAI wire format: request bodies (pydantic), the error envelope, response pieces.

Field names, defaults and limits follow OpenAI's Chat Completions and (legacy) Completions APIs,
plus the sampling extras vLLM accepts (`top_k`, `min_p`, `repetition_penalty`), so that a client
moves between localllm, vLLM and OpenAI without changes. Unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from localllm.tokenizer import Tokenizer

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16  # n: each choice is a sequence of its own on the engine


class APIError(Exception):
    """An error the client gets in OpenAI's envelope: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON body, as OpenAI sends it."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 invalid_request_error."""
    return APIError(400, message, param=param, code=code)


# -- requests -------------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class Message(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string, or a list of parts; only {"type": "text"} parts are accepted (see chat_messages).
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, sent back in turn
    tool_call_id: str | None = None  # a tool's result: the call it answers
    name: str | None = None


class _Sampling(_Request):
    """Fields both endpoints share. None means "not given": OpenAI's default applies."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling parameters (top_k -1 or 0 disables it, as in vLLM).
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # llama-server's and vLLM's: variables for the chat template (enable_thinking, ...), and
    # "none" to leave a thinking model's thoughts in content instead of reasoning_content.
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_format: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    # Legacy completions default to 16 tokens (OpenAI and vLLM alike).
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


def check_common(req: _Sampling) -> None:
    """400 for what is valid JSON but not served: too many stop strings."""
    stops = stop_strings(req.stop)
    if len(stops) > MAX_STOP_STRINGS or sum(len(s) for s in stops) > MAX_STOP_CHARS:
        raise bad_request(
            f"at most {MAX_STOP_STRINGS} stop strings of {MAX_STOP_CHARS} characters in all",
            param="stop",
        )


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """`stop` as a list, without empty strings (which would stop before the first token)."""
    if stop is None:
        return []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if s]


def chat_messages(messages: list[Message]) -> list[dict[str, str]]:
    """{"role", "content"} dicts for the chat template: text parts joined by newlines (as vLLM
    does), `developer` treated as `system` (chat templates do not know it)."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(
                        f"only text content parts are supported (got type {part.get('type')!r})",
                        param=f"messages[{i}].content[{j}]",
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        else:
            content = m.content or ""
        message: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": content,
        }
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


# -- responses ------------------------------------------------------------------------------


def completion_id(prefix: str) -> str:
    """A fresh id, e.g. `chatcmpl-<32 hex digits>`."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; prompt_tokens_details.cached_tokens: prompt tokens whose KV the
    prefix cache held (not prefilled again), as OpenAI reports its prompt caching."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def token_logprobs(
    tokenizer: Tokenizer, token: int, logits: np.ndarray, top_n: int
) -> dict[str, Any]:
    """One entry of Chat Completions' `logprobs.content` for `token`, sampled from
    logits float32[vocab] (after penalties, before temperature), with its top_n alternatives."""
    x = logits.astype(np.float64)  # float64[vocab]
    m = float(x.max())
    log_z = m + float(np.log(np.exp(x - m).sum()))
    top: list[dict[str, Any]] = []
    if top_n > 0:
        ids = np.argpartition(-x, top_n - 1)[:top_n]
        ids = ids[np.argsort(-x[ids], kind="stable")]
        top = [token_entry(tokenizer, int(i), float(x[i]) - log_z) for i in ids]
    entry = token_entry(tokenizer, token, float(x[token]) - log_z)
    entry["top_logprobs"] = top
    return entry


def token_entry(tokenizer: Tokenizer, token: int, logprob: float | None) -> dict[str, Any]:
    data = tokenizer.token_to_bytes(token)
    return {
        "token": data.decode("utf-8", errors="replace"),
        "logprob": logprob,
        "bytes": list(data),
    }


def _alternatives(top: list[dict[str, Any]] | None) -> dict[str, float] | None:
    return None if top is None else {t["token"]: t["logprob"] for t in top}


def legacy_logprobs(entries: list[dict[str, Any]], text_offset: int = 0) -> dict[str, Any]:
    """Completions' older logprobs shape, from chat-style entries: parallel lists of tokens,
    their logprobs, {token: logprob} alternatives and each token's offset in the text."""
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [_alternatives(e["top_logprobs"]) for e in entries],
        "text_offset": offsets,
    }
