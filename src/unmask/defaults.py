"""Light constants shared by the CLI, the server and the engine (importing this loads no torch)."""
from pathlib import Path

DEFAULT_MODEL_ID = "unmask-tiny"


def default_model_path() -> Path:
    """The built-in model shipped inside the package."""
    return Path(__file__).resolve().parent / "assets" / DEFAULT_MODEL_ID
