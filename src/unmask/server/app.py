"""The FastAPI application: routes of a few lines, one error envelope, security middleware, and a
lifespan that loads the model in a background thread so that the socket (and /health, 503 until
the model is ready) is up at once.

Heavy modules (torch, the engine, serving.py) are imported by the loader thread, not here.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import re
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Match

from unmask.errors import UnmaskError
from unmask.server import logsafe, openapi
from unmask.server.admission import AdmissionGate
from unmask.server.metrics import Metrics
from unmask.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EditRequest,
                                    FIMCompletionRequest, TokenizeRequest)
from unmask.server.protocol_responses import ResponsesRequest
from unmask.server.security import APIKeyMiddleware, BodyLimitMiddleware
from unmask.retrieval import file_search_chat
from unmask.retrieval import routes as retrieval
from unmask.store import DEFAULT_MAX_FILE_BYTES, LazyStore, StoreUnavailable
from unmask.store import routes as file_routes
from unmask.batch import routes as batch_routes
from unmask.batch.runner import BatchRunner, default_batch_inflight
from unmask.web.routes import router as page_router

logger = logging.getLogger("unmask.server")


@dataclass
class ServerArgs:
    model: Path
    served_model_name: str
    api_keys: list[str] = field(default_factory=list)
    cors_origins: list[str] = field(default_factory=list)
    max_num_seqs: int = 64
    max_queue: int = 256
    max_body_bytes: int = 4 * 2**20
    max_prompt_tokens: int | None = None
    default_max_tokens: int = 1024
    force_include_usage: bool = False
    chat_template: str | None = None     # template text (read from --chat-template FILE by the CLI)
    dtype: str | None = None
    kv_cache_dtype: str = "auto"
    device: str = "cpu"
    drain_timeout: float = 30.0
    embedding_model: str | None = None   # a directory, "off", or None: the packaged default (unmask.retrieval)
    vector_store: str | None = None      # postgresql://... for the vector stores' chunks; None: SQLite
    data_dir: Path | None = None         # files and batches (unmask.store); None: a temporary directory
    database_url: str | None = None      # postgresql://... : the store in Postgres, shared across machines
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    batch_max_inflight: int = 0          # batch lines decoded at once (0: default_batch_inflight(max_num_seqs))
    # the block-causal fast path (engine/static_step.py): None = UNMASK_STATIC_STEP / UNMASK_CUDA_GRAPHS
    static_step: bool | None = None
    cuda_graphs: bool | None = None
    compile_step: bool | str | None = None   # CPU steps compiled per count of requests; "auto": the one-request
                                             # step only, where it can be (unmask serve's default; engine/compiled_step.py)
    memory_utilization: float = 0.9      # of the memory free after loading, for the static step's KV pool
    kv_pool_tokens: int | None = None    # or the pool's size in tokens


def load_serving(app: FastAPI, args: ServerArgs) -> None:
    """Loader thread: build the engine, then publish `app.state.serving` (health turns 200)."""
    try:
        from unmask.engine.async_engine import AsyncEngine
        from unmask.engine.llm import LLM
        from unmask.models.loader import dtype_name
        from unmask.server.serving import OpenAIServing, ServingConfig
        from unmask.server.serving_edit import EditServing
        from unmask.server.serving_responses import ResponsesServing

        t0 = time.perf_counter()
        llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
                  chat_template=args.chat_template, kv_cache_dtype=args.kv_cache_dtype, static_step=args.static_step,
                  cuda_graphs=args.cuda_graphs, memory_utilization=args.memory_utilization,
                  kv_pool_tokens=args.kv_pool_tokens, compile_step=args.compile_step)
        if llm.tokenizer.has_chat_template:  # load the template's tokenizer now, not in the first chat request
            try:                              # (0.9 s with the built-in model on 2 CPU cores)
                llm.tokenizer.apply_chat_template([{"role": "user", "content": "warm-up"}])
            except Exception as e:  # noqa: BLE001 - a template that refuses this conversation still serves others
                logger.warning("chat template warm-up: %s", e)
        # admission is counted once, by the server (admission.py); no second bound in the engine, whose queue
        # still holds requests the server has released (aborted, removed at the next step) and would refuse
        # admitted requests mid-stream
        engine = AsyncEngine(llm.engine, max_queue=sys.maxsize)
        cfg = ServingConfig(model_name=args.served_model_name, max_num_seqs=args.max_num_seqs,
                            max_queue=args.max_queue, max_prompt_tokens=args.max_prompt_tokens,
                            default_max_tokens=args.default_max_tokens, force_include_usage=args.force_include_usage)
        app.state.metrics.attach(llm.engine)
        serving = OpenAIServing(llm, engine, app.state.metrics, cfg)
        app.state.editing = EditServing(serving)
        app.state.responses = ResponsesServing(serving)
        gc.collect()   # the ~210k long-lived objects of the loaded model leave the collector's view: a full pass
        gc.freeze()    # over them took 0.13 s on 2 busy cores, and a burst's allocations can set one off mid-answer
        app.state.serving = serving
        weights = llm.model.lm_head.weight
        logger.info("model %s loaded in %.1f s (%s on %s); ready", args.served_model_name, time.perf_counter() - t0,
                    dtype_name(weights.dtype), weights.device)
    except Exception as e:  # noqa: BLE001 - any load failure stops the server with one line
        app.state.load_error = str(e) if isinstance(e, UnmaskError) else f"{type(e).__name__}: {e}"
        logger.error("cannot load the model: %s", app.state.load_error)
        app.state.on_fatal()


# ---------------------------------------------------------------------------------------- routes
router = APIRouter()


def serving(request: Request):
    s = request.app.state.serving
    if s is None:
        raise APIError(503, "the model is still loading; retry when GET /health answers 200", code="model_loading")
    return s


def editing(request: Request):
    serving(request)  # 503 while loading
    return request.app.state.editing


def respond(result: BaseModel | AsyncIterator[str]) -> Response:
    if isinstance(result, BaseModel):
        return Response(result.model_dump_json(), media_type="application/json")
    return StreamingResponse(result, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return respond(await file_search_chat.chat(serving(request), body, request.app.state.retrieval,
                                               request.is_disconnected))   # plain chat without a file_search tool


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    serving(request)  # 503 while loading
    return respond(await request.app.state.responses.create(body, request.is_disconnected,
                                                            request.app.state.retrieval))  # for file_search


@router.api_route("/v1/responses/{response_id:path}", methods=["GET", "DELETE", "POST"])
async def stored_response(response_id: str) -> Response:
    response_id = response_id.split("/", 1)[0]   # also .../input_items and .../cancel
    raise APIError(404, f"response {response_id!r} was not stored: this server's /v1/responses is stateless "
                        "(send the whole conversation in `input`)", param="response_id", code="response_not_found")


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    if body.suffix:  # fill in the middle
        return respond(await editing(request).fim(body, request.is_disconnected))
    return respond(await serving(request).completion(body, request.is_disconnected))


@router.post("/v1/fim/completions")
async def fim_completions(body: FIMCompletionRequest, request: Request) -> Response:
    return respond(await editing(request).fim(body, request.is_disconnected))


@router.post("/v1/apply/completions")
async def apply_completions(body: EditRequest, request: Request) -> Response:
    return respond(await editing(request).apply(body, request.is_disconnected))


@router.post("/v1/edit/completions")
async def edit_completions(body: EditRequest, request: Request) -> Response:
    return respond(await editing(request).next_edit(body, request.is_disconnected))


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    return respond(serving(request).models())


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> Response:
    return respond(serving(request).model_card(model_id))


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    return respond(serving(request).tokenize(body))


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    return respond(serving(request).detokenize(body))


@router.api_route("/health", methods=["GET", "HEAD"])  # HEAD: probes that only read the status code
async def health(request: Request) -> Response:
    state = request.app.state
    if state.serving is None or not state.serving.engine.is_alive:
        status = "error" if state.load_error or state.serving is not None else "loading"
        return JSONResponse({"status": status}, status_code=503)
    if retrieval.loading(state):   # the embedding model too (src/unmask/retrieval/)
        return JSONResponse({"status": "loading"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


# ---------------------------------------------------------------------------------------- errors
_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none)$|[\[\-]")  # pydantic's union-branch loc entries


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    err = next((e for e in errors if e["type"] == "value_error"), errors[0])
    if err["type"] == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}",
                        code="invalid_json")
    loc = [str(x) for x in err["loc"][1:] if not _TYPE_TAG.search(str(x))]
    if not loc and err["type"] == "missing":
        return APIError(400, "the request body is empty; send a JSON object")
    if not loc:
        return APIError(400, f"request body must be a JSON object matching the API: {err['msg']}")
    param = ".".join(loc)
    return APIError(400, f"{param}: {err['msg']}", param=param)


def _leaf_routes(router) -> Iterator:
    """Every route, through included routers (FastAPI wraps each in a route holding `original_router`)."""
    for route in router.routes:
        inner = getattr(route, "original_router", None)
        yield from (_leaf_routes(inner) if inner is not None else (route,))


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: APIError) -> Response:
        if exc.status != 499:
            app.state.metrics.error(exc.status)
        return JSONResponse(exc.response().model_dump(), status_code=exc.status, headers=exc.headers)

    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        ctype = request.headers.get("content-type", "")
        if request.method == "POST" and ctype and "json" not in ctype.lower():
            # e.g. `curl -d` without -H sends a form type: refused rather than parsed anyway, so that a browser
            # page cannot POST a form or text/plain body here without a CORS preflight
            return await api_error(request, APIError(
                400, f"send the request body as JSON with 'Content-Type: application/json' (got '{ctype}')",
                code="invalid_content_type"))
        return await api_error(request, validation_error(exc))

    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:   # Starlette's Allow names only the first matching route's methods; a path
            # served by several routes (GET and POST /v1/files) allows all of theirs
            methods = {m.strip() for m in headers.get("Allow", "").split(",") if m.strip()}
            for route in _leaf_routes(request.app.router):
                if isinstance(route, APIRoute) and route.matches(request.scope)[0] != Match.NONE:
                    methods |= route.methods
            headers["Allow"] = ", ".join(sorted(methods))
            return await api_error(request, APIError(
                405, f"method {request.method} is not allowed here; allowed: {headers['Allow']}",
                code="method_not_allowed", headers=headers))
        return await api_error(request, APIError(exc.status_code, str(exc.detail), headers=headers))

    async def store_down(request: Request, exc: StoreUnavailable) -> Response:   # --database-url's server
        logger.error("%s %s: %s", request.method, logsafe.clean(request.url.path, 200), exc)
        return await api_error(request, APIError(503, "the server's database is unavailable; retry shortly",
                                                 code="store_unavailable", headers={"Retry-After": "5"}))

    async def unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, logsafe.clean(request.url.path, 200))
        return await api_error(request, APIError(500, "internal server error"))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(StoreUnavailable, store_down)
    app.add_exception_handler(Exception, unexpected)


# ---------------------------------------------------------------------------------------- the app
def create_app(args: ServerArgs, on_fatal: Callable[[], None] = lambda: None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=load_serving, args=(app, args), name="unmask-load", daemon=True).start()
        retrieval.start(app, args.embedding_model, args.vector_store)
        app.state.batches.start()   # resumes the batches a crash or a restart left active (unmask.batch)
        yield
        await asyncio.to_thread(retrieval.stop, app)   # the ingestion worker; unfinished files resume later
        await app.state.batches.stop()   # lines in flight are not saved: they run again after a restart
        s = app.state.serving
        if s is not None:  # uvicorn has already waited for open requests; let the engine finish too
            await asyncio.to_thread(s.engine.shutdown, True, args.drain_timeout)
        app.state.store.close()

    app = FastAPI(title="unmask", lifespan=lifespan)
    app.state.serving = None
    app.state.editing = None
    app.state.responses = None
    app.state.load_error = None
    app.state.metrics = Metrics()
    app.state.on_fatal = on_fatal
    app.state.store = LazyStore(args.data_dir, args.max_file_bytes, args.database_url)
    app.include_router(router)
    app.include_router(retrieval.router)  # embeddings (src/unmask/retrieval/)
    app.include_router(file_routes.router)  # /v1/files (src/unmask/store/)
    app.include_router(batch_routes.router)  # /v1/batches (src/unmask/batch/)
    app.state.batches = BatchRunner(app, app.state.store,
                                    args.batch_max_inflight or default_batch_inflight(args.max_num_seqs),
                                    args.max_body_bytes)
    app.include_router(page_router)  # the playground at / (src/unmask/web/)
    openapi.install(app)
    install_error_handlers(app)
    # the last added middleware runs first: CORS (answers preflights), then the key, then admission (429 before
    # the body is read), then the size
    app.add_middleware(BodyLimitMiddleware, limit=args.max_body_bytes, metrics=app.state.metrics,
                       route_limits=file_routes.body_limits(args.max_file_bytes))
    app.add_middleware(AdmissionGate, metrics=app.state.metrics,
                       admission=lambda: app.state.serving.admission if app.state.serving is not None else None)
    app.add_middleware(APIKeyMiddleware, keys=args.api_keys, metrics=app.state.metrics)
    if args.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=args.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["*"])  # the OpenAI SDKs add their own x-stainless-* headers
    return app
