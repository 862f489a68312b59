"""Routes of the retrieval API, mounted by server/app.py, and the loader of what they serve.

The embedding model loads in its own thread at startup (as the generation model does): until it is ready the
routes answer 503 and so does /health, and a server started with `--embedding-model off` answers 404 on
/v1/embeddings and the vector store routes (vector_store_routes.py, included in `router`). The same thread then
opens the vector stores; while their database does not answer (a Postgres `--database-url` or `--vector-store`
that is down when the server starts) it retries with backoff (store/db.py's retry_while_unavailable), the vector
store routes answer 503 `store_unavailable` meanwhile, as they do when the database goes away later, and
/v1/embeddings and /health answer as soon as the model is loaded.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from unmask.errors import UnmaskError
from unmask.retrieval import vector_store_routes
from unmask.retrieval.embeddings import EmbeddingRequest, embed
from unmask.retrieval.encoder import DEFAULT_ENCODER_NAME, SentenceEncoder, default_encoder_path
from unmask.retrieval.vector_stores import VectorStores
from unmask.server.protocol import APIError
from unmask.store import StoreUnavailable
from unmask.store.db import retry_while_unavailable

logger = logging.getLogger("unmask.retrieval")
OFF = "off"


@dataclass
class RetrievalState:
    encoder_path: Path | None          # None: embeddings are off
    encoder_name: str
    vector_store_url: str | None = None   # --vector-store (None: SQLite under the data directory)
    encoder: SentenceEncoder | None = None
    vector_stores: VectorStores | None = None
    load_error: str | None = None
    store_error: str | None = None        # the vector stores' database did not answer at the last try to open them
    stopping: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)   # publishing the vector stores against stop()

    def check_store(self) -> None:
        """While the vector stores wait for their database: StoreUnavailable (the app answers 503 with
        Retry-After, code store_unavailable)."""
        if self.vector_stores is None and self.store_error:
            raise StoreUnavailable(self.store_error)


def resolve_encoder(option: str | None) -> tuple[Path | None, str]:
    """`--embedding-model`: a directory, `off`, or unset (the packaged all-MiniLM-L6-v2 when installed)."""
    if option == OFF:
        return None, ""
    if option is None:
        path = default_encoder_path()
        return path, DEFAULT_ENCODER_NAME
    path = Path(option)
    return path, path.resolve().name


def load(state: RetrievalState, file_store) -> None:
    """Loader thread: the embedding model, then the vector stores (their ingestion resumes), retried until their
    database answers."""
    try:
        from unmask.tokenizer import from_transformers

        from_transformers()  # the package itself under the shared import lock, before its submodule
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        t0 = time.perf_counter()
        encoder = SentenceEncoder.load(state.encoder_path, state.encoder_name)
        logger.info("embedding model %s loaded in %.1f s (%d dimensions)", state.encoder_name,
                    time.perf_counter() - t0, encoder.dimension)

        def open_vector_stores() -> VectorStores:
            store = file_store.get()
            return VectorStores.open(store.root, encoder, store.files, state.vector_store_url)

        def unavailable(e: StoreUnavailable, retry_s: float) -> None:
            if state.encoder is None:
                state.encoder = encoder   # /v1/embeddings needs no database
            state.store_error = str(e)
            logger.warning("vector stores: %s; retrying in %.1f s", e, retry_s)

        vector_stores = retry_while_unavailable(open_vector_stores, state.stopping, unavailable)
        with state.lock:
            if vector_stores is None or state.stopping.is_set():   # the server stopped first
                if vector_stores is not None:
                    vector_stores.stop()   # not started: closes its connections
                return
            vector_stores.start()
            state.encoder, state.vector_stores = encoder, vector_stores
            state.store_error = None   # cleared after vector_stores is set: a request sees one or the other
    except Exception as e:  # noqa: BLE001 - the generation routes keep serving; /v1/embeddings reports it
        state.load_error = str(e) if isinstance(e, UnmaskError) else f"{type(e).__name__}: {e}"
        logger.error("cannot load the embedding model: %s", state.load_error)


def start(app: FastAPI, embedding_model: str | None, vector_store_url: str | None = None) -> None:
    path, name = resolve_encoder(embedding_model)
    app.state.retrieval = state = RetrievalState(encoder_path=path, encoder_name=name,
                                                 vector_store_url=vector_store_url)
    if path is not None:
        threading.Thread(target=load, args=(state, app.state.store), name="unmask-load-retrieval",
                         daemon=True).start()


def stop(app: FastAPI) -> None:
    state: RetrievalState | None = getattr(app.state, "retrieval", None)
    if state is None:
        return
    with state.lock:
        state.stopping.set()   # a loader still waiting for the database gives up
    if state.vector_stores is not None:
        state.vector_stores.stop()


def loading(app_state) -> bool:
    """Whether the embedding model is still loading, or the vector stores opening for the first time (/health
    answers 503 until they are open or their database is known not to answer)."""
    state: RetrievalState | None = getattr(app_state, "retrieval", None)
    return (state is not None and state.encoder_path is not None and state.vector_stores is None
            and not state.load_error and not state.store_error)


def encoder(request: Request) -> SentenceEncoder:
    state: RetrievalState = request.app.state.retrieval
    if state.encoder_path is None:
        raise APIError(404, "this server serves no embedding model (started with --embedding-model off)",
                       code="model_not_found")
    if state.load_error:
        raise APIError(503, f"the embedding model failed to load: {state.load_error}", code="model_load_failed")
    if state.encoder is None:   # published with the vector stores, or alone while their database does not answer
        raise APIError(503, "the embedding model is still loading; retry shortly", code="model_loading")
    return state.encoder


router = APIRouter()
router.include_router(vector_store_routes.router)


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
    result = await asyncio.to_thread(embed, body, encoder(request))
    return Response(result.model_dump_json(), media_type="application/json")
