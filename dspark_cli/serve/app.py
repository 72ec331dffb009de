"""The OpenAI-compatible HTTP surface of `dspark serve` (FastAPI).

    GET  /v1/models              the served model (and its context length)
    POST /v1/chat/completions    chat template + sampling; JSON or SSE (`stream: true`)
    GET  /health, /metrics       liveness and the batcher counters

Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 404 for an unknown
model, 400 for bad parameters, prompts longer than the context, or chats the template rejects.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .batcher import Batcher
from .engine import Engine, Sequence
from .sampling import SamplingParams

#: Most choices one request may ask for.
MAX_N = 16


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatRequest(BaseModel):
    """The request fields we honour; other OpenAI fields are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = None


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def _validation_message(errors: Any) -> APIError:
    """FastAPI's first validation error as a sentence that names the field (or says the body is
    not JSON / not an object), instead of `0: JSON decode error` or `None: Field required`."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    kind, msg = first.get("type", ""), first.get("msg", "invalid request")
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error") or msg
        where = f" at character {loc[0]}" if loc else ""
        return APIError(400, f"the request body is not valid JSON ({detail}{where}).")
    if not loc:
        return APIError(400, "the request body must be a JSON object with 'model' and 'messages' "
                             f"({msg.lower()}).")
    param = ".".join(loc)
    return APIError(400, f"{param}: {msg}", param)


def create_app(engine: Engine, model_names: list[str], batcher: Batcher | None = None,
               default_max_tokens: int = 512) -> FastAPI:
    """An app serving `engine` under `model_names` (the first is the one /v1/models lists)."""
    batcher = batcher or Batcher(engine)
    app = FastAPI(title="dspark serve")
    app.state.batcher = batcher
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(_validation_message(e.errors()).body(), status_code=400)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_names[0], "context_length": engine.context_length,
                "prepacked_linears": engine.prepacked, "queued": batcher.queued, **batcher.stats.to_dict()}

    @app.get("/metrics")
    async def metrics() -> dict[str, Any]:
        return batcher.stats.to_dict()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_names[0], "object": "model", "created": created,
                                            "owned_by": "dspark", "max_model_len": engine.context_length}]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatRequest) -> Any:
        if req.model not in model_names:
            raise APIError(404, f"The model `{req.model}` does not exist; this server serves "
                           f"`{model_names[0]}`.", "model", "model_not_found")
        if req.logprobs:
            raise APIError(400, "logprobs are not supported by dspark serve.", "logprobs")
        prompt_ids = _render(engine, req)
        room = engine.context_length - len(prompt_ids)
        if room <= 0:
            raise APIError(400, f"This model's maximum context length is {engine.context_length} tokens, "
                           f"but the prompt has {len(prompt_ids)} tokens.", "messages",
                           "context_length_exceeded")
        params = _sampling(req, min(room, default_max_tokens))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        events: asyncio.Queue[tuple[int, str, str | None]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        base_seed = req.seed if req.seed is not None else int.from_bytes(os.urandom(6), "little")
        sequences = [Sequence(prompt_ids, params, torch.Generator().manual_seed(base_seed + i),
                              _forward_to(loop, events, i)) for i in range(req.n)]
        batcher.submit(sequences)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream(rid, created_now(), req.model, sequences, events,
                                             include_usage, len(prompt_ids)),
                                     media_type="text/event-stream")
        try:
            await _until_done(sequences, events)
        except asyncio.CancelledError:
            for seq in sequences:
                seq.cancelled.set()
            raise
        if any(s.finish_reason == "error" for s in sequences):
            raise APIError(500, "generation failed on the server; see its log.", kind="server_error")
        return {
            "id": rid, "object": "chat.completion", "created": created_now(), "model": req.model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": s.text},
                         "logprobs": None, "finish_reason": s.finish_reason}
                        for i, s in enumerate(sequences)],
            "usage": _usage(len(prompt_ids), sequences),
        }

    return app


def created_now() -> int:
    return int(time.time())


def _render(engine: Engine, req: ChatRequest) -> list[int]:
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            if any(part.get("type") != "text" for part in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported.",
                               f"messages.{i}.content")
            content = "".join(str(part.get("text", "")) for part in content)
        messages.append({**(m.model_extra or {}), "role": m.role, "content": content or ""})
    try:
        return engine.render(messages, req.chat_template_kwargs or {})
    except Exception as e:  # jinja raises for chats the template does not accept
        raise APIError(400, f"the chat template rejected the messages: {e}", "messages") from e


def _sampling(req: ChatRequest, max_default: int) -> SamplingParams:
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if any(not s for s in stop):
        raise APIError(400, "stop strings must not be empty.", "stop")
    max_tokens = req.max_completion_tokens or req.max_tokens or max_default
    return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0),
                          min_p=req.min_p, max_tokens=max_tokens, stop=stop)


def _forward_to(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, index: int):
    """A Sequence callback (worker thread) that hands events to the request's event loop."""

    def on_event(delta: str, reason: str | None) -> None:
        loop.call_soon_threadsafe(events.put_nowait, (index, delta, reason))

    return on_event


async def _until_done(sequences: list[Sequence], events: asyncio.Queue) -> None:
    remaining = len(sequences)
    while remaining:
        _, _, reason = await events.get()
        remaining -= reason is not None


def _usage(prompt_tokens: int, sequences: list[Sequence]) -> dict[str, int]:
    completion = sum(s.generated for s in sequences)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


async def _stream(rid: str, created: int, model: str, sequences: list[Sequence],
                  events: asyncio.Queue, include_usage: bool, prompt_tokens: int) -> AsyncIterator[str]:
    """SSE chunks: a role delta per choice, content deltas, a finish chunk, [DONE]."""

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                                "model": model, "choices": choices}
        if include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    finished = 0
    try:
        for i in range(len(sequences)):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        while finished < len(sequences):
            index, delta, reason = await events.get()
            if reason == "error":
                error = APIError(500, "generation failed on the server; see its log.", kind="server_error")
                yield f"data: {json.dumps(error.body())}\n\n"
                return
            if delta:
                yield chunk([{"index": index, "delta": {"content": delta}, "logprobs": None,
                              "finish_reason": None}])
            if reason is not None:
                finished += 1
                yield chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}])
        if include_usage:
            yield chunk([], _usage(prompt_tokens, sequences))
        yield "data: [DONE]\n\n"
    finally:
        for seq in sequences:  # a client that hung up stops costing forward passes
            if not seq.done:
                seq.cancelled.set()
