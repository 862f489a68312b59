"""What `unmask serve --ray` and the application builder (Serve config files, KubeRay) hand the engine replicas,
without a cluster: the static step's settings and the autoscaling config, and their one-line errors."""
from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

pytest.importorskip("ray.serve", reason="Ray is optional: pip install 'unmask[ray]'")

from unmask.cluster import ClusterError  # noqa: E402
from unmask.cluster import launch  # noqa: E402


def test_the_builder_passes_the_static_step_and_store_settings_to_the_engine_args():
    args, scale = launch.builder_args({"static_step": "true", "cuda_graphs": False, "kv_pool_tokens": 4096,
                                       "gpu_memory_utilization": 0.5, "replicas": 3, "embedding_model": "off"})
    assert (args.static_step, args.cuda_graphs, args.kv_pool_tokens, args.memory_utilization) == (True, False, 4096,
                                                                                                   0.5)
    assert scale.replicas == 3 and scale.autoscale is None
    plain, _ = launch.builder_args({})
    assert (plain.static_step, plain.cuda_graphs, plain.kv_pool_tokens, plain.memory_utilization) == (None, None,
                                                                                                      None, 0.9)
    assert plain.database_url is None and plain.compile_step == "auto"
    compiled, _ = launch.builder_args({"compile_step": "on"})
    assert compiled.compile_step is True and compiled.static_step is None
    shared, _ = launch.builder_args({"database_url": "postgresql://unmask@db:5432/unmask", "data_dir": "/srv/u"})
    assert (shared.database_url, str(shared.data_dir)) == ("postgresql://unmask@db:5432/unmask", "/srv/u")


@pytest.mark.parametrize("config, message", [
    ({"kv_pool_tokens": 512}, "gpu_memory_utilization and kv_pool_tokens size the static step's KV pool: add "
                              "static_step: true"),
    ({"static_step": True, "gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in (0, 1], got 1.5"),
    ({"static_step": True, "kv_pool_tokens": 8}, "kv_pool_tokens must be at least 16 (one page of the KV pool), got 8"),
    ({"static_step": "maybe"}, "static_step must be true or false, got 'maybe'"),
    ({"compile_step": "sometimes"}, "compile_step must be true or false, got 'sometimes'"),
    ({"static_step": True, "kv_pool_tokens": "many"}, "kv_pool_tokens must be a whole number, got 'many'"),
    ({"static_step": True, "gpu_memory_utilization": "half"}, "gpu_memory_utilization must be a number, got 'half'"),
    ({"autoscale": "1,2", "autoscaling_config": {"min_replicas": 0}},
     "the autoscaling config cannot set min_replicas: --autoscale MIN,MAX and --max-num-seqs do"),
    ({"autoscale": "1,2", "autoscaling_config": {"downscale_delay": 5}}, "unknown autoscaling key(s) downscale_delay;"),
    ({"autoscale": "1,2", "autoscaling_config": {"downscale_delay_s": -1}}, "autoscaling config: downscale_delay_s: "),
    ({"autoscale": "1,2", "autoscaling_config": "{not json"}, "the autoscaling config must be a JSON object, got"),
])
def test_bad_builder_settings_are_one_line_errors(config, message):
    with pytest.raises(ClusterError) as e:
        launch.builder_args(config)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_the_autoscaling_config_takes_ray_serves_delays():
    _, scale = launch.builder_args({"autoscale": "1,3", "max_num_seqs": 8, "autoscaling_config": (
        '{"initial_replicas": 2, "downscale_delay_s": 5, "upscale_delay_s": 1.5}')})
    assert launch.autoscaling_config(scale, 8) == {"min_replicas": 1, "max_replicas": 3, "initial_replicas": 2,
                                                   "target_ongoing_requests": 8, "downscale_delay_s": 5,
                                                   "upscale_delay_s": 1.5}
    _, plain = launch.builder_args({"autoscale": "0,2"})   # Ray Serve's own delays (600 s down, 30 s up) by default
    assert launch.autoscaling_config(plain, 64) == {"min_replicas": 0, "max_replicas": 2, "initial_replicas": 1,
                                                    "target_ongoing_requests": 64}
    _, outside = launch.builder_args({"autoscale": "1,2", "autoscaling_config": {"initial_replicas": 3}})
    with pytest.raises(ClusterError, match=r"^initial_replicas 3 is outside --autoscale 1,2$"):
        launch.autoscaling_config(outside, 8)


@pytest.mark.parametrize("value, message", [
    ('{"bogus": 1}', "error: unknown autoscaling key(s) bogus; Ray Serve's: "),
    ('{"initial_replicas": 5}', "error: initial_replicas 5 is outside --autoscale 1,2"),
])
def test_unmask_serve_checks_the_autoscaling_variable_before_starting_ray(value, message, monkeypatch):
    from unmask.cli import app

    monkeypatch.setenv("UNMASK_AUTOSCALING_CONFIG", value)
    r = CliRunner().invoke(app, ["serve", "--ray", "--autoscale", "1,2", "--embedding-model", "off"])
    assert r.exit_code == 1 and r.stderr.strip().startswith(message) and len(r.stderr.strip().splitlines()) == 1, \
        r.output


def test_replicas_and_routers_run_on_one_event_loop_unless_the_user_says_otherwise(monkeypatch):
    """Ray Serve's same-loop switches (launch.SERVE_LOOP_ENV) reach every replica: through the job's runtime_env
    for `unmask serve --ray`, through each deployment's for a config file's application; a user's value wins."""
    for name in launch.SERVE_LOOP_ENV:
        monkeypatch.delenv(name, raising=False)
    env = launch.runtime_env()["env_vars"]
    assert env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    assert env["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "0" and env["HF_HUB_OFFLINE"] == "1"
    args, scale = launch.builder_args({"embedding_model": "off"})
    app = launch.build(args, scale)
    ingress = app._bound_deployment
    engine = ingress.init_args[0]._bound_deployment
    for deployment in (ingress, engine):
        assert deployment.ray_actor_options["runtime_env"]["env_vars"]["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    monkeypatch.setenv("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "1")
    assert launch.runtime_env()["env_vars"]["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "1"
    launch.use_serve_loops()   # the gateway's own process: set where unset, kept where set
    assert os.environ["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "1"
    assert os.environ["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "0"


LEAN_PROBE = """
import json, os
import ray
from unmask.cluster import launch
launch.connect(None, 1)

@ray.remote(num_cpus=0)
def seen():
    return {k: os.environ.get(k) for k in launch.LEAN_CLUSTER_ENV}

print(json.dumps(ray.get(seen.remote())))
ray.shutdown()
"""


def test_a_local_cluster_it_starts_is_lean_and_a_users_value_wins():
    """The processes of a local cluster that `unmask serve --ray` starts (here a task's worker: Serve's controller
    and the replicas are workers too) see launch.LEAN_CLUSTER_ENV, except what the user set."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in launch.LEAN_CLUSTER_ENV}
    env["RAY_event_stats"] = "1"   # the user's
    out = subprocess.run([sys.executable, "-c", LEAN_PROBE], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {**launch.LEAN_CLUSTER_ENV, "RAY_event_stats": "1"}


def test_the_engine_replicas_leave_the_access_log_to_the_gateway():
    args, scale = launch.builder_args({"embedding_model": "off"})
    engine = launch.build(args, scale, ingress=False)._bound_deployment
    assert engine._deployment_config.logging_config["enable_access_log"] is False
