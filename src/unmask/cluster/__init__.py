"""Scale-out on Ray (docs/scale-out.md): `unmask serve --ray` puts engine replicas behind one OpenAI endpoint with
Ray Serve, and `unmask batch --ray` runs a file of Batch API lines on a pool of engines with Ray Data.

Ray is optional (`pip install 'unmask[ray]'`); nothing here imports it at module level except the modules that
only run on a cluster (replica.py, ingress.py, routing.py, which `require_ray` guards).
"""
from __future__ import annotations

from unmask.errors import UnmaskError

INSTALL_HINT = "Ray is not installed; --ray needs it: pip install 'unmask[ray]'"


class ClusterError(UnmaskError):
    """A cluster cannot be joined or started, or an application cannot be deployed (one line in the CLI)."""


def require_ray() -> None:
    try:
        import ray  # noqa: F401
        import ray.serve  # noqa: F401
    except ImportError:
        raise ClusterError(INSTALL_HINT) from None
