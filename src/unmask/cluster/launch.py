"""Joining or starting a Ray cluster, and deploying `unmask serve --ray` on it (docs/scale-out.md)."""
from __future__ import annotations

import dataclasses
import json
import os
import socket
from dataclasses import dataclass, field

from unmask.cluster import ClusterError, require_ray

APP_NAME = "unmask"
OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM")
PASSED_ENV = ("OMP_WAIT_POLICY", "UNMASK_RAY_PIPE")   # passed on when set
# Ray Serve runs a replica's code, and a caller's router, on event loops of their own threads by default; on the
# same loop (Ray's RAY_SERVE_THROUGHPUT_OPTIMIZED mode sets both) each streamed piece skips two thread hand-offs.
# Measured on 2 cores, one replica against plain `unmask serve` (docs/scale-out.md): the replica's CPU for the same
# requests 1.14-1.15x -> 1.02-1.05x plain's; at 4 streams 0.78-0.92x -> 0.85-0.96x the throughput (medians 0.83x and
# 0.90x). The same mode's gRPC data path carries each handle call to the replica's own gRPC server instead of as a
# Ray actor task: with it (and replica.run_at on every thread), the first token's lead over plain serving went from
# +9.1-9.5 to +6.0-6.6 ms at one stream and from +24-27 to +6-12 ms at four (docs/scale-out.md, "Ray's own
# priorities and its gRPC path"). A value the user sets wins.
SERVE_LOOP_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
                  "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"}
# A local cluster that `unmask serve --ray` starts for itself (no dashboard) is lean: Serve's controller loop at 2 Hz
# rather than 10 and no Ray metrics, task events or event-loop statistics, which have nowhere to go there. On the
# 2-core machine of docs/scale-out.md Ray's processes took 26% of a core with no request in flight, 10% lean. A
# cluster joined with --address keeps its own settings; a value the user sets wins.
LEAN_CLUSTER_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", "RAY_enable_metrics_collection": "0",
                    "RAY_event_stats": "0", "RAY_task_events_report_interval_ms": "0"}


@dataclass
class Scale:
    replicas: int = 1
    autoscale: tuple[int, int] | None = None     # (min, max) replicas; None: a fixed `replicas`
    num_cpus: float = 1.0                        # per replica
    num_gpus: float = 0.0
    niceness: int | None = None                  # the engines' scheduling priority; None: Ray's (nice 15)
    autoscaling: dict = field(default_factory=dict)   # more keys of Ray Serve's autoscaling_config (delays, ...)

    @property
    def threads(self) -> int:
        """Torch threads per replica: its whole CPUs, at least one."""
        return max(1, int(self.num_cpus))


def parse_autoscale(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(",")
    try:
        low, high = int(lo), int(hi)
    except ValueError:
        raise ClusterError(f"--autoscale takes MIN,MAX replicas (e.g. 1,4), got {text!r}") from None
    if not sep or low < 0 or high < 1 or low > high:
        raise ClusterError(f"--autoscale takes MIN,MAX replicas with 0 <= MIN <= MAX and MAX >= 1, got {text!r}")
    return low, high


FIXED_AUTOSCALING = ("min_replicas", "max_replicas", "target_ongoing_requests")   # set by --autoscale, --max-num-seqs


def parse_autoscaling(value) -> dict:
    """UNMASK_AUTOSCALING_CONFIG (JSON) or the builder's `autoscaling_config` (a mapping or JSON): more keys of Ray
    Serve's `autoscaling_config` (`downscale_delay_s`, `upscale_delay_s`, `initial_replicas`, `look_back_period_s`,
    ...), checked against Ray's own model."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ClusterError(f"the autoscaling config must be a JSON object, got {value!r} ({e.msg})") from None
    if not isinstance(value, dict):
        raise ClusterError(f"the autoscaling config must be a JSON object, got {value!r}")
    fixed = sorted(set(value) & set(FIXED_AUTOSCALING))
    if fixed:
        raise ClusterError(f"the autoscaling config cannot set {', '.join(fixed)}: --autoscale MIN,MAX and "
                           "--max-num-seqs do")
    from pydantic import ValidationError
    from ray.serve.config import AutoscalingConfig

    known = set(AutoscalingConfig.model_fields) - set(FIXED_AUTOSCALING)
    unknown = sorted(set(value) - known)
    if unknown:
        raise ClusterError(f"unknown autoscaling key(s) {', '.join(unknown)}; Ray Serve's: {', '.join(sorted(known))}")
    try:
        AutoscalingConfig(min_replicas=0, max_replicas=10**6, **value)
    except ValidationError as e:
        first = e.errors()[0]
        raise ClusterError(f"autoscaling config: {'.'.join(map(str, first['loc'])) or 'value'}: {first['msg']}") from None
    return dict(value)


def autoscaling_config(scale: Scale, max_num_seqs: int) -> dict:
    """Ray Serve's autoscaling_config of the engine deployment: between MIN and MAX replicas, each aiming at a full
    batch of requests (a replica whose batch is full asks for another), with Ray's delays unless overridden."""
    low, high = scale.autoscale
    config = {"min_replicas": low, "max_replicas": high, "initial_replicas": max(low, 1),
              "target_ongoing_requests": max_num_seqs, **scale.autoscaling}
    if not low <= config["initial_replicas"] <= high:
        raise ClusterError(f"initial_replicas {config['initial_replicas']} is outside --autoscale {low},{high}")
    return config


def runtime_env() -> dict:
    """The offline switches reach the replicas on every node, whatever their raylet's environment, and so does an
    OpenMP wait policy set here (PASSIVE: torch's threads sleep rather than spin at each barrier, which on a
    machine with more runnable threads than cores made decoding many times faster: docs/scale-out.md)."""
    env = {k: os.environ.get(k, "false" if k == "TOKENIZERS_PARALLELISM" else "1") for k in OFFLINE_ENV}
    env.update({k: os.environ[k] for k in PASSED_ENV if k in os.environ})
    env.update(serve_loop_env())
    return {"env_vars": env}


def serve_loop_env() -> dict[str, str]:
    return {k: os.environ.get(k, v) for k, v in SERVE_LOOP_ENV.items()}


def use_serve_loops() -> None:
    """This process's Serve router on the caller's loop (SERVE_LOOP_ENV): before Ray Serve is first imported,
    which reads the switches once."""
    for k, v in SERVE_LOOP_ENV.items():
        os.environ.setdefault(k, v)


def reachable(address: str, timeout: float = 3.0) -> None:
    """A HOST:PORT that accepts no connection fails at once: ray.init would retry it for minutes."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return   # "auto", ray:// client addresses: left to Ray
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise ClusterError(f"no Ray cluster answers at {address} ({e.strerror or e}); start its head with "
                           "`ray start --head` or pass another --address") from None


def connect(address: str | None, num_cpus: int | None = None) -> bool:
    """Join the cluster at `address`, or start a local one (loopback only). True if this call started it."""
    require_ray()
    import ray

    if ray.is_initialized():
        return False
    if address:
        reachable(address)
    try:
        if address:
            ray.init(address=address, runtime_env=runtime_env(), logging_level="WARNING")
            return False
        # address "local": a new cluster, never one that an earlier `ray start` recorded in /tmp/ray; its processes
        # inherit this one's environment
        for k, v in LEAN_CLUSTER_ENV.items():
            os.environ.setdefault(k, v)
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, runtime_env=runtime_env(), logging_level="WARNING")
        return True
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
        raise ClusterError(f"cannot join {where}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def build(args, scale: Scale, ingress: bool = True):
    """The Serve application: engine replicas routed by routing.AffinityRouter, behind one `Ingress` replica
    (for Serve's HTTP proxy), or alone (`unmask serve --ray` calls them from its own front, front.py)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from unmask.cluster.ingress import Ingress
    from unmask.cluster.replica import EngineReplica
    from unmask.cluster.routing import AffinityRouter

    engine_args = dataclasses.replace(args, api_keys=[], cors_origins=[])   # the gateway checks both
    options = {"ray_actor_options": {"num_cpus": scale.num_cpus, "num_gpus": scale.num_gpus},
               # unmask's own admission answers 429 past its queue: Ray Serve must not queue in front of it
               "max_ongoing_requests": args.max_num_seqs + args.max_queue + 1,
               "request_router_config": RequestRouterConfig(request_router_class=AffinityRouter,
                                                             request_router_kwargs={"slots": args.max_num_seqs}),
               "graceful_shutdown_timeout_s": args.drain_timeout + 5, "health_check_period_s": 2.0,
               # the gateway's access log has every request already; the replica's copy of each line was written,
               # read back by Ray's log monitor and sent to the driver to print, on the engine's cores
               "logging_config": {"enable_access_log": False}}
    if scale.autoscale is not None:
        options["autoscaling_config"] = autoscaling_config(scale, args.max_num_seqs)
    else:
        options["num_replicas"] = scale.replicas
    if ingress:   # a config file's job did not go through `connect`: its replicas get the switches here
        options["ray_actor_options"]["runtime_env"] = runtime_env()
    engine = serve.deployment(EngineReplica, name="Engine", **options).bind(engine_args, scale.threads, scale.niceness)
    if not ingress:
        return engine
    return serve.deployment(Ingress, name="Ingress", num_replicas=1,
                            ray_actor_options={"num_cpus": 0, "runtime_env": runtime_env()},
                            max_ongoing_requests=100_000).bind(engine, args)


def deploy(args, scale: Scale, app_name: str = APP_NAME):
    """Run the engine replicas (no HTTP proxy: the caller serves HTTP, front.py) until every one is ready, and
    return the gateway that forwards requests to them."""
    from ray import serve

    from unmask.cluster.ingress import Gateway
    from unmask.cluster.pipe import wanted as pipe_wanted

    serve.start(proxy_location="Disabled")
    try:
        handle = serve.run(build(args, scale, ingress=False), name=app_name, route_prefix=None)
    except RuntimeError as e:
        raise ClusterError(f"the application did not start: {str(e).splitlines()[0]}") from None
    return Gateway(handle, args, app_name, direct=pipe_wanted())


def undeploy(app_name: str = APP_NAME, stop_serve: bool = False) -> None:
    """Remove the application (its replicas drain), its metrics board, and Serve itself if we started it."""
    import ray
    from ray import serve

    from unmask.cluster.replica import board_name

    serve.delete(app_name)
    try:
        ray.kill(ray.get_actor(board_name(app_name), namespace="unmask"))
    except ValueError:
        pass
    if stop_serve:
        serve.shutdown()


SERVER_KEYS = ("cors_origins", "max_num_seqs", "max_queue", "device", "dtype", "kv_cache_dtype", "embedding_model",
               "default_max_tokens", "drain_timeout")
# as the flags
STATIC_STEP_KEYS = ("static_step", "cuda_graphs", "gpu_memory_utilization", "kv_pool_tokens", "compile_step")
BUILDER_KEYS = {"model", "served_model_name", "api_keys", "data_dir", "database_url", "replicas", "autoscale", "autoscaling_config",
                "num_cpus", "num_gpus", *SERVER_KEYS, *STATIC_STEP_KEYS}


def _switch(key: str, value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise ClusterError(f"{key} must be true or false, got {value!r}")
    return text in ("1", "true", "yes", "on")


def static_step_args(config: dict) -> dict:
    """The builder's static-step keys (and the CPU's compile_step) as ServerArgs fields, checked as `unmask serve`
    checks the flags."""
    from unmask.engine.kv_pool import check_pool_options
    from unmask.errors import InvalidRequestError

    static = _switch("static_step", config["static_step"]) if "static_step" in config else None
    try:
        utilization = float(config["gpu_memory_utilization"]) if "gpu_memory_utilization" in config else None
    except (TypeError, ValueError):
        raise ClusterError(f"gpu_memory_utilization must be a number, got {config['gpu_memory_utilization']!r}") from None
    try:
        tokens = int(config["kv_pool_tokens"]) if config.get("kv_pool_tokens") is not None else None
    except (TypeError, ValueError):
        raise ClusterError(f"kv_pool_tokens must be a whole number, got {config['kv_pool_tokens']!r}") from None
    if not static and (utilization is not None or tokens is not None):
        raise ClusterError("gpu_memory_utilization and kv_pool_tokens size the static step's KV pool: add "
                           "static_step: true")
    try:
        check_pool_options(0.9 if utilization is None else utilization, tokens,
                           names=("gpu_memory_utilization", "kv_pool_tokens"))
    except InvalidRequestError as e:
        raise ClusterError(str(e)) from None
    fields = {"static_step": static, "kv_pool_tokens": tokens,
              "memory_utilization": 0.9 if utilization is None else utilization}
    for key in ("cuda_graphs", "compile_step"):
        if key in config:
            fields[key] = _switch(key, config[key])
    fields.setdefault("compile_step", "auto")   # as `unmask serve`: the one-request step compiled where it can be
    return fields


def builder_args(config: dict):
    """(ServerArgs, Scale) of an application builder's `args` (BUILDER_KEYS)."""
    from pathlib import Path

    from unmask.server.app import ServerArgs
    from unmask.server.cli import default_served_name

    unknown = sorted(set(config) - BUILDER_KEYS)
    if unknown:
        raise ClusterError(f"unknown application argument(s) {', '.join(unknown)}; known: {', '.join(sorted(BUILDER_KEYS))}")
    if "model" in config:
        model = Path(config["model"])
    else:
        from unmask.defaults import default_model_path

        model = default_model_path()
    keys = config.get("api_keys") or os.environ.get("UNMASK_API_KEY", "").split()
    args = ServerArgs(model=model, served_model_name=config.get("served_model_name") or default_served_name(model),
                      api_keys=[keys] if isinstance(keys, str) else list(keys),
                      **{k: config[k] for k in SERVER_KEYS if k in config}, **static_step_args(config))
    for key in ("max_num_seqs", "max_queue", "default_max_tokens"):
        setattr(args, key, int(getattr(args, key)))
    if config.get("data_dir"):
        args.data_dir = Path(config["data_dir"])
    if config.get("database_url"):
        args.database_url = str(config["database_url"])
    scale = Scale(replicas=int(config.get("replicas", 1)), num_cpus=float(config.get("num_cpus", 1.0)),
                  num_gpus=float(config.get("num_gpus", 0.0)),
                  autoscale=parse_autoscale(str(config["autoscale"])) if config.get("autoscale") else None,
                  autoscaling=parse_autoscaling(config.get("autoscaling_config") or {}))
    return args, scale


def application(config: dict):
    """An application builder for Ray Serve's config files (`serve run unmask.cluster.launch:application
    model=DIR`, KubeRay's serveConfigV2 `import_path` with `args`): the same application as `unmask serve --ray`,
    from the keys of BUILDER_KEYS (names as ServerArgs' fields and the Scale's, the static step's as its flags;
    `autoscale` as "MIN,MAX", `autoscaling_config` as more keys of Ray Serve's)."""
    return build(*builder_args(config))
