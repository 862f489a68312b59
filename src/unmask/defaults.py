"""Light constants shared by the CLI, the server and the engine (importing this loads no torch)."""
from pathlib import Path

DEFAULT_MODEL_ID = "unmask-tiny"


def default_model_path() -> Path:
    """The built-in model shipped inside the package."""
    return Path(__file__).resolve().parent / "assets" / DEFAULT_MODEL_ID

DEVICE_HELP = "auto | cpu | cuda[:N] (default: UNMASK_DEVICE, else auto: cuda when available, else cpu)."
COMPILE_STEP_HELP = ("CPU, bfloat16/float16 weights, the built-in family: decode steps through a forward that "
                     "torch.compile builds once per count of requests (the one-request forward at start, 10-30 s; "
                     "2, 4, 8 when first met), then reuses. Default: UNMASK_COMPILE_STEP (1, 0 or auto), else off "
                     "for generate and auto for serve (the one-request forward only, where the model qualifies).")
STATIC_STEP_HELP = ("Block-causal families (SDAR, Fast-dLLM v2, LLaDA2, the built-in one): decode steps on static "
                    "buffers over a preallocated KV pool, replayed as CUDA graphs on a GPU (default: "
                    "UNMASK_STATIC_STEP, else off; other families ignore it). docs/architecture.md")
CUDA_GRAPHS_HELP = ("Replay decode steps as CUDA graphs on a GPU: the static step's, and DiffusionGemma's canvas "
                    "steps (default: UNMASK_CUDA_GRAPHS, else on; --no-cuda-graphs keeps the static buffers "
                    "without capture).")
MEMORY_UTILIZATION_HELP = ("With --static-step: the share of the memory free after the model loads (GPU: the device's; "
                           "CPU: the RAM available) that the KV pool takes, less 256 MiB kept for activations and at "
                           "most what --max-num-seqs full contexts need; in (0, 1] (default 0.9).")
KV_POOL_TOKENS_HELP = ("With --static-step: the KV pool's size in tokens instead (at least 16; whole pages of 16); "
                       "the startup log says what either option gave, in tokens and MiB.")
DTYPE_HELP = ("auto | float32 | bfloat16 | float16 (default: UNMASK_DTYPE, else auto: bfloat16 where the device "
              "computes it natively, i.e. CUDA or a CPU with AVX512-BF16 / AMX, float32 elsewhere).")
KV_CACHE_DTYPES = ("bfloat16", "float32", "int8")  # besides auto (the weights' dtype)
KV_CACHE_DTYPE_HELP = ("auto | bfloat16 | float32 | int8: the KV cache's dtype (default auto: the weights'); bfloat16 "
                       "halves a float32 cache's memory per token, int8 (a scale per token and head) takes 0.53x of "
                       "bfloat16's at head dim 64; attention reads it back in the compute dtype.")
