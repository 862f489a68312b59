import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# numbers compared against references are float32's; "auto" would pick bf16 on CPUs with native bf16 only
os.environ["UNMASK_DTYPE"] = "float32"
os.environ["UNMASK_DEVICE"] = "cpu"  # "auto" would take a GPU where there is one; the references run on the CPU
torch.set_num_threads(1)  # tiny models: one thread avoids oversubscription on 2 cores


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory):
    """Tiny random checkpoints, one per public family, in each family's real on-disk format."""
    from tiny_checkpoints import FAMILIES

    root = tmp_path_factory.mktemp("families")
    return {name: make(root / name) for name, make in FAMILIES.items()}


# The slowest files first (one-worker run of 2026-12-06: structured 70 s, the two Ray files 56 and 52 s, compiled
# step 48 s, vector stores 43 s, device_distill 34 s, speculative 30 s, draft lookup 28 s): `make test` runs two
# workers that take whole files in collection order, so a slow file collected last would leave one worker
# running it alone at the end.
SLOW_FILES = ("test_ray_serve", "test_ray_cluster", "test_structured", "test_compiled_step", "test_vector_stores",
              "test_device_distill", "test_speculative", "test_draft_lookup")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))   # stable: the rest keep their order
