"""One training step of one long row with and without activation checkpointing (trainer.checkpoint_blocks).

    python bench/checkpoint_activations.py CHECKPOINT(0|1) LENGTH     # run it A B A B, one process each

The step of bench/two_stream_step.py (split attention, block 8, bf16 autocast, the built-in model), three times in
one process: prints the peak RSS growth over the loaded model and the seconds of each step.
"""
import json, resource, sys, time, torch
sys.path.insert(0, "bench")
torch.set_num_threads(2)
import two_stream_step as t
from unmask.train.trainer import checkpoint_blocks
model, spec, obj = t._setup(None, 8)
if sys.argv[1] == "1":
    checkpoint_blocks(model)
before = t._rss_kb()
times = []
for seed in range(3):
    s = time.perf_counter(); t._step(model, spec, obj, int(sys.argv[2]), 8, True, seed); times.append(time.perf_counter() - s)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"checkpoint": sys.argv[1], "length": int(sys.argv[2]), "growth_mb": round((peak - before) / 1024), "step_s": [round(x, 2) for x in times]}))
