"""Light constants shared by the CLI, the server and the engine (importing this loads no torch)."""
from pathlib import Path

DEFAULT_MODEL_ID = "unmask-tiny"


def default_model_path() -> Path:
    """The built-in model shipped inside the package."""
    return Path(__file__).resolve().parent / "assets" / DEFAULT_MODEL_ID

DEVICE_HELP = "auto | cpu | cuda[:N] (default: UNMASK_DEVICE, else auto: cuda when available, else cpu)."
DTYPE_HELP = ("auto | float32 | bfloat16 | float16 (default: UNMASK_DTYPE, else auto: bfloat16 where the device "
              "computes it natively, i.e. CUDA or a CPU with AVX512-BF16 / AMX, float32 elsewhere).")
KV_CACHE_DTYPES = ("bfloat16", "float32", "int8")  # besides auto (the weights' dtype)
KV_CACHE_DTYPE_HELP = ("auto | bfloat16 | float32 | int8: the KV cache's dtype (default auto: the weights'); bfloat16 "
                       "halves a float32 cache's memory per token, int8 (a scale per token and head) takes 0.53x of "
                       "bfloat16's at head dim 64; attention reads it back in the compute dtype.")
