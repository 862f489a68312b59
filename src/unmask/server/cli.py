"""`unmask serve`: every flag can also be set through an UNMASK_* environment variable.

Imports nothing heavy at import time: fastapi, uvicorn and torch load inside `serve`.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Optional

import typer

from unmask.defaults import (CUDA_GRAPHS_HELP, DEVICE_HELP, DTYPE_HELP, KV_CACHE_DTYPE_HELP, KV_CACHE_DTYPES,
                             KV_POOL_TOKENS_HELP, MEMORY_UTILIZATION_HELP, STATIC_STEP_HELP, COMPILE_STEP_HELP)


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's levels


ABORT_GRACE_S = 5.0  # after the drain timeout, time for aborted requests to send their 503 before uvicorn cancels


def _server_class(uvicorn):
    class DrainingServer(uvicorn.Server):
        """uvicorn cancels the request tasks still open when its graceful timeout ends, which cuts a stream
        without an error frame or [DONE] and turns a plain request into a bare 500. So the engine aborts them
        first, `drain_timeout` after the signal: each gets its 503 in the error envelope while uvicorn still
        waits (ABORT_GRACE_S more)."""

        def __init__(self, config, drain_timeout: float):
            super().__init__(config)
            self.drain_timeout, self._timer = drain_timeout, None

        def handle_exit(self, sig, frame) -> None:
            if self._timer is None:
                self._timer = threading.Timer(self.drain_timeout, self._abort_all)
                self._timer.daemon = True
                self._timer.start()
            super().handle_exit(sig, frame)

        def _abort_all(self) -> None:
            serving = getattr(self.config.app.state, "serving", None)
            if serving is not None:
                serving.engine.abort_all()

    return DrainingServer


def default_served_name(model: Path) -> str:
    """The API's model id when --served-model-name is not given: the directory's name, or for the `model/`
    folder that `unmask train` and `unmask finetune` export into, the run directory's (runs/sft/model -> sft)."""
    path = model.resolve()
    return path.parent.name if path.name == "model" and path.parent.name else path.name


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def _data_dir(given: Path | None) -> Path:
    from unmask.store import default_data_dir

    path = given if given is not None else default_data_dir()
    try:  # an unwritable directory fails here, in one line, rather than at the first upload
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _fail(f"cannot create the data directory {path}: {e.strerror}")
    return path


def serve(
    model: Optional[Path] = typer.Option(None, "--model", "-m", envvar="UNMASK_MODEL",
                                         help="Model directory (default: the built-in unmask-tiny)."),
    host: str = typer.Option("127.0.0.1", envvar="UNMASK_HOST", help="Interface to listen on."),
    port: int = typer.Option(8000, min=0, max=65535, envvar="UNMASK_PORT", help="Port to listen on (0: any free one)."),
    api_key: list[str] = typer.Option([], "--api-key", envvar="UNMASK_API_KEY",
                                      help="Require 'Authorization: Bearer KEY' on every route but /health "
                                           "(repeatable; in the variable, keys separated by spaces)."),
    max_num_seqs: int = typer.Option(64, min=1, envvar="UNMASK_MAX_NUM_SEQS",
                                     help="Requests decoded together (one per choice)."),
    max_queue: int = typer.Option(256, min=0, envvar="UNMASK_MAX_QUEUE",
                                  help="Requests waiting for a slot; beyond that: 429 with Retry-After."),
    chat_template: Optional[Path] = typer.Option(None, envvar="UNMASK_CHAT_TEMPLATE",
                                                 help="Jinja chat template file (default: the model's)."),
    cors_origin: list[str] = typer.Option([], "--cors-origin", envvar="UNMASK_CORS_ORIGIN",
                                          help="Allowed browser origin (repeatable; none by default)."),
    max_body_bytes: int = typer.Option(4 * 2**20, min=1, envvar="UNMASK_MAX_BODY_BYTES",
                                       help="Largest request body accepted."),
    max_prompt_tokens: Optional[int] = typer.Option(None, min=1, envvar="UNMASK_MAX_PROMPT_TOKENS",
                                                    help="Longest prompt accepted (default: the model's context)."),
    default_max_tokens: int = typer.Option(1024, min=1, envvar="UNMASK_DEFAULT_MAX_TOKENS",
                                           help="max_tokens of requests that name none (capped by the context)."),
    force_include_usage: bool = typer.Option(False, envvar="UNMASK_FORCE_INCLUDE_USAGE",
                                             help="End every stream with a usage chunk, asked for or not."),
    dtype: Optional[str] = typer.Option(None, envvar="UNMASK_DTYPE",
                                        help=DTYPE_HELP),
    kv_cache_dtype: str = typer.Option("auto", envvar="UNMASK_KV_CACHE_DTYPE", help=KV_CACHE_DTYPE_HELP),
    device: str = typer.Option("auto", envvar="UNMASK_DEVICE", help=DEVICE_HELP),
    static_step: Optional[bool] = typer.Option(None, "--static-step/--no-static-step", help=STATIC_STEP_HELP),
    compile_step: Optional[bool] = typer.Option(None, "--compile-step/--no-compile-step", help=COMPILE_STEP_HELP),
    cuda_graphs: Optional[bool] = typer.Option(None, "--cuda-graphs/--no-cuda-graphs", help=CUDA_GRAPHS_HELP),
    gpu_memory_utilization: Optional[float] = typer.Option(None, envvar="UNMASK_GPU_MEMORY_UTILIZATION",
                                                           help=MEMORY_UTILIZATION_HELP),
    kv_pool_tokens: Optional[int] = typer.Option(None, envvar="UNMASK_KV_POOL_TOKENS", help=KV_POOL_TOKENS_HELP),
    served_model_name: Optional[str] = typer.Option(None, envvar="UNMASK_SERVED_MODEL_NAME",
                                                    help="Model id in the API (default: the directory name; for a "
                                                         "training run's model/ folder, the run's name)."),
    root_path: str = typer.Option("", envvar="UNMASK_ROOT_PATH",
                                  help="Path prefix a reverse proxy serves this server under and strips "
                                       "(e.g. /unmask); the OpenAPI document and the playground at / follow it."),
    drain_timeout: float = typer.Option(30.0, min=0, envvar="UNMASK_DRAIN_TIMEOUT",
                                        help="On shutdown, seconds to let running requests finish."),
    data_dir: Optional[Path] = typer.Option(None, envvar="UNMASK_DATA_DIR",
                                            help="Directory of the files and batches database (default: "
                                                 "$XDG_DATA_HOME/unmask, else ~/.local/share/unmask)."),
    max_file_bytes: int = typer.Option(512 * 2**20, min=1, envvar="UNMASK_MAX_FILE_BYTES",
                                       help="Largest file accepted by POST /v1/files."),
    embedding_model: Optional[str] = typer.Option(None, envvar="UNMASK_EMBEDDING_MODEL",
                                                  help="Sentence-transformers directory served by /v1/embeddings "
                                                       "(default: the packaged all-MiniLM-L6-v2; 'off': none)."),
    batch_max_inflight: int = typer.Option(0, min=0, envvar="UNMASK_BATCH_MAX_INFLIGHT",
                                           help="Batch API lines decoded at once, below interactive requests "
                                                "(0: three quarters of --max-num-seqs, at least 1)."),
    database_url: Optional[str] = typer.Option(None, envvar="UNMASK_DATABASE_URL",
                                               help="postgresql://user@host:port/db: files (their bytes too), "
                                                    "batches and vector stores in Postgres, shared by every server "
                                                    "naming it (default: SQLite in the data directory)."),
    vector_store: Optional[str] = typer.Option(None, envvar="UNMASK_VECTOR_STORE",
                                               help="postgresql://user@host:port/db (pgvector 0.8+) for the vector "
                                                    "stores' chunks (default: SQLite in the data directory)."),
    log_level: str = typer.Option("info", envvar="UNMASK_LOG_LEVEL",
                                  help="critical | error | warning | info | debug | trace."),
    on_ray: bool = typer.Option(False, "--ray", envvar="UNMASK_RAY",
                                help="Serve engine replicas on a Ray cluster behind this endpoint (docs/scale-out.md)."),
    replicas: int = typer.Option(1, min=1, envvar="UNMASK_REPLICAS", help="With --ray: engine replicas."),
    autoscale: Optional[str] = typer.Option(None, envvar="UNMASK_AUTOSCALE", metavar="MIN,MAX",
                                            help="With --ray: autoscale between MIN and MAX replicas on queue length."),
    num_cpus: float = typer.Option(1.0, min=0, envvar="UNMASK_NUM_CPUS", help="With --ray: CPUs per replica."),
    num_gpus: float = typer.Option(0.0, min=0, envvar="UNMASK_NUM_GPUS", help="With --ray: GPUs per replica."),
    address: Optional[str] = typer.Option(None, envvar="UNMASK_RAY_ADDRESS",
                                          help="With --ray: the cluster to join (default: start a local one)."),
):
    """Serve a model over an OpenAI-compatible HTTP API."""
    import logging

    import uvicorn

    from unmask.server.app import ServerArgs, create_app

    if model is None:
        from unmask.defaults import default_model_path

        model = default_model_path()
        if not model.is_dir():
            _fail(f"the built-in model is not installed at {model}; pass --model DIR")
    elif not model.is_dir():
        _fail(f"model directory {model} does not exist")
    if log_level.lower() not in LOG_LEVELS:
        _fail(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}")
    from unmask.models.loader import DTYPES

    if dtype is not None and dtype not in ("auto", *DTYPES):  # checked before the port is bound
        _fail(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}")
    if kv_cache_dtype != "auto" and kv_cache_dtype not in KV_CACHE_DTYPES:
        _fail(f"unknown --kv-cache-dtype {kv_cache_dtype!r}; choose one of auto, {', '.join(KV_CACHE_DTYPES)}")
    from unmask.cli_util import static_step_options

    fast = static_step_options(static_step, cuda_graphs, gpu_memory_utilization, kv_pool_tokens, compile_step,
                               serving=True)
    from unmask.errors import UnmaskError
    from unmask.models.loader import check_device, load_spec, resolve_device

    try:  # a directory that is no model, or a device there is not, fails here rather than after the port is up
        load_spec(model)
        check_device(resolve_device(device))
    except UnmaskError as e:
        _fail(str(e))
    template = None
    if chat_template is not None:
        try:
            template = chat_template.read_text(encoding="utf-8")
        except OSError as e:
            _fail(f"cannot read the chat template {chat_template}: {e.strerror}")
        except UnicodeDecodeError:
            _fail(f"the chat template {chat_template} is not UTF-8 text")
        from jinja2 import TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        try:  # a syntax error is the server's fault: refuse to start rather than answer every chat with a 400
            ImmutableSandboxedEnvironment().parse(template)
        except TemplateSyntaxError as e:
            _fail(f"the chat template {chat_template} does not parse: {e.message} (line {e.lineno})")
    logging.basicConfig(level=logging.DEBUG if log_level.lower() == "trace" else log_level.upper(), format="%(levelname)s %(name)s: %(message)s")

    if vector_store is not None and not vector_store.startswith(("postgresql://", "postgres://")):
        _fail(f"--vector-store must be a postgresql:// URL, got {vector_store!r}")
    if database_url is not None and not database_url.startswith(("postgresql://", "postgres://")):
        _fail(f"--database-url must be a postgresql:// URL, got {database_url!r}")
    if embedding_model not in (None, "off") and not Path(embedding_model).is_dir():
        _fail(f"embedding model directory {embedding_model} does not exist")
    args = ServerArgs(model=model, served_model_name=served_model_name or default_served_name(model),
                      api_keys=list(api_key), cors_origins=list(cors_origin),
                      max_num_seqs=max_num_seqs, max_queue=max_queue, max_body_bytes=max_body_bytes,
                      max_prompt_tokens=max_prompt_tokens, default_max_tokens=default_max_tokens,
                      force_include_usage=force_include_usage, chat_template=template, dtype=dtype,
                      device=device, drain_timeout=drain_timeout, max_file_bytes=max_file_bytes,
                      data_dir=_data_dir(data_dir), batch_max_inflight=batch_max_inflight)
    args.embedding_model, args.vector_store, args.database_url = embedding_model, vector_store, database_url
    args.kv_cache_dtype = kv_cache_dtype
    args.static_step, args.cuda_graphs = fast["static_step"], fast["cuda_graphs"]
    args.compile_step = fast["compile_step"]
    args.memory_utilization, args.kv_pool_tokens = fast["memory_utilization"], fast["kv_pool_tokens"]
    if on_ray:
        from unmask.cluster.cli import serve_on_ray

        return serve_on_ray(args, host, port, root_path, address, replicas, autoscale, num_cpus, num_gpus)
    app = create_app(args)
    server = _server_class(uvicorn)(uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                                                   timeout_graceful_shutdown=drain_timeout + ABORT_GRACE_S,
                                                   root_path=root_path.rstrip("/")),
                                    drain_timeout)
    app.state.on_fatal = lambda: setattr(server, "should_exit", True)
    server.run()
    if app.state.load_error:
        _fail(app.state.load_error)
