"""The KubeRay `RayService` manifest of docs/scale-out.md, read from the page itself: a RayService whose
`serveConfigV2` Ray Serve's own config schema accepts (what KubeRay hands to Serve), whose application is this
package's builder with arguments it accepts, building what the page says it builds, on the Ray this package
installs. No Kubernetes here: the operator itself is not run (docs/scale-out.md, "What is tested").
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="Ray is optional: pip install 'unmask[ray]'")
yaml = pytest.importorskip("yaml")

import ray  # noqa: E402
from ray.serve.schema import ServeDeploySchema  # noqa: E402

from unmask.cluster import launch  # noqa: E402

PAGE = Path(__file__).resolve().parents[1] / "docs" / "scale-out.md"


def manifest() -> dict:
    text = PAGE.read_text()
    section = text[text.index("### On Kubernetes with KubeRay"):]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block, "docs/scale-out.md: no yaml block under 'On Kubernetes with KubeRay'"
    return yaml.safe_load(block.group(1))


def test_the_pages_rayservice_is_a_serve_config_that_builds_the_engine_it_describes():
    doc = manifest()
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService")
    config = ServeDeploySchema.model_validate(yaml.safe_load(doc["spec"]["serveConfigV2"]))
    assert config.proxy_location == "HeadOnly" and config.http_options.port == 8000
    (app,) = config.applications
    assert app.import_path == "unmask.cluster.launch:application" and app.route_prefix == "/"
    args, scale = launch.builder_args(app.args)
    assert str(args.model) == "/models/unmask-tiny" and args.max_num_seqs == 64 and args.embedding_model == "off"
    assert args.database_url == "postgresql://unmask@postgres:5432/unmask"
    assert (scale.autoscale, scale.num_cpus, scale.threads) == ((1, 4), 2.0, 2)
    assert launch.autoscaling_config(scale, args.max_num_seqs) == {
        "min_replicas": 1, "max_replicas": 4, "initial_replicas": 1, "target_ongoing_requests": 64}
    assert type(launch.application(app.args)).__name__ == "Application"   # binds; deploys nothing


def test_the_pages_cluster_runs_the_ray_this_package_installs():
    cluster = manifest()["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"   # no engine on the head, as the page says
    (engines,) = cluster["workerGroupSpecs"]
    limits = engines["template"]["spec"]["containers"][0]["resources"]["limits"]
    # a worker pod holds one replica of the application's num_cpus; the pods scale as Serve's replicas do
    args = yaml.safe_load(manifest()["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert float(limits["cpu"]) == float(args["num_cpus"])
    assert (engines["minReplicas"], engines["maxReplicas"]) == tuple(int(n) for n in args["autoscale"].split(","))
