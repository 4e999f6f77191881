"""The OpenAI-compatible HTTP endpoint of a rollout worker: FastAPI routes under uvicorn, on 127.0.0.1.

(FastAPI reads the routes' annotations to inject `Request`, so it is imported at module level:
the routes' string annotations resolve against this module's globals.)

It runs as a task on the event loop that also runs the worker's engine pump and its episodes,
so a call is one hop from HTTP to the engine's queue. Every refusal is an OpenAI-style JSON
error (`{"error": {"message", "type", "param", "code"}}`) naming what to fix; none of them
reaches the engine, and a failing request never stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from titanrl.agents.episodes import EndpointError, EpisodeRegistry
from titanrl.agents.handler import CallHandler

log = logging.getLogger(__name__)


def build_app(handler: CallHandler, registry: EpisodeRegistry, max_request_bytes: int) -> Any:
    """The FastAPI application: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`."""
    from titanrl.agents.protocol import ChatCompletionRequest, CompletionRequest

    app = FastAPI(title="TitanRL rollout endpoint", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(EndpointError)
    async def refused(_: Request, e: EndpointError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(Exception)
    async def failed(_: Request, e: Exception) -> JSONResponse:
        log.exception("agent endpoint: a call failed")
        body = EndpointError(500, f"the rollout worker failed to serve this call: {type(e).__name__}: {e}",
                             type="server_error").body()
        return JSONResponse(body, status_code=500)

    async def parsed(request: Request, model: Any) -> Any:
        """The body as `model`, once the caller is authorized (routes check the token before reading)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_request_bytes:
            raise _too_large(int(declared), max_request_bytes)
        body = await request.body()
        if len(body) > max_request_bytes:
            raise _too_large(len(body), max_request_bytes)
        try:
            return model.model_validate_json(body)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(part) for part in first["loc"]) or None
            message = "the request body is not valid JSON" if first["type"] == "json_invalid" else (
                f"{param}: {first['msg']}" if param else first["msg"])
            raise EndpointError(400, message, param=param) from None

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        episode = registry.authorize(request.headers.get("authorization"))
        body = await parsed(request, ChatCompletionRequest)
        return _json(await handler.chat(episode, body))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        episode = registry.authorize(request.headers.get("authorization"))
        body = await parsed(request, CompletionRequest)
        return _json(await handler.complete(episode, body))

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        registry.authorize(request.headers.get("authorization"))
        name = handler.settings.served_model_name
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "titanrl"}]}

    return app


def _json(model: Any) -> Response:
    """An `openai` response model as the body, serialized by pydantic at once (FastAPI's generic
    encoder would walk every logprob entry again)."""
    return Response(model.model_dump_json(exclude_unset=True), media_type="application/json")


def _too_large(size: int, limit: int) -> EndpointError:
    return EndpointError(413, f"the request body is {size} bytes; this endpoint reads at most {limit} "
                         "(agent.max_request_bytes)", code="request_too_large")


class EndpointServer:
    """uvicorn serving `app` on 127.0.0.1 (a free port) as a task of the running event loop."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield  # the worker's signals belong to Ray, not to the server inside it

        self._server = _Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                                              access_log=False))
        self._task: asyncio.Task[None] | None = None
        self.port: int | None = None

    @property
    def base_url(self) -> str:
        """What agents give their OpenAI client: `http://127.0.0.1:<port>/v1`."""
        if self.port is None:
            raise RuntimeError("EndpointServer.start() has not run")
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> None:
        """Starts serving on the running loop; returns once the socket listens. Idempotent."""
        if self._task is not None:
            return
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():  # it failed to start: raise its error
                await self._task
                raise RuntimeError("the agent endpoint stopped before it started")
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._task, timeout=10)
        self._task = None
