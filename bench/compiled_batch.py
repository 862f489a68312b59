"""The compiled CPU step under concurrency: held-out next lines four at a time (LLM.generate over 4 prompts, so the
engine batches them and rows finish at different steps), eager against compiled, tokens/s in 3 alternating rounds
after an untimed warm-up pass that compiles the shapes it meets (at most the engine's cap of compiled graphs).

    .venv/bin/python bench/compiled_batch.py bench/models/unmask-tiny-5m-drafter
"""
import sys, time, torch, statistics
from unmask.engine.llm import LLM
from unmask.engine.engine import Engine
from unmask.engine.params import GenerationParams
from unmask.evaluation import next_line_tasks
from unmask.train.corpus import read_documents
torch.set_num_threads(2)
docs = list(read_documents("data/corpus/heldout.jsonl"))
tasks = next_line_tasks(docs, 40)
llms = {}
for name, on in (("eager", False), ("compiled", True)):
    l = LLM(sys.argv[1], dtype="bfloat16")
    l.engine = Engine(l.model, l.spec, l.tokenizer, max_num_seqs=8, prefix_cache_bytes=0, compile_step=on)
    llms[name] = l
prompts = [llms["eager"].encode(t.prompt) for t in tasks]
params = [GenerationParams(max_tokens=48, stop=list(t.stop), min_tokens=t.min_tokens) for t in tasks]
def run(l):
    t = time.perf_counter(); toks = 0; outs = []
    for i in range(0, len(prompts), 4):
        o = l.generate(prompts[i:i+4], params[i:i+4]); toks += sum(len(x.token_ids) for x in o); outs += [x.token_ids for x in o]
    return toks / (time.perf_counter() - t), outs
t = time.perf_counter(); run(llms["compiled"]); print(f"warm-up {time.perf_counter()-t:.0f} s, shapes {llms['compiled'].engine.runner.compiled.compiles}")
res = {"eager": [], "compiled": []}; outs = {}
for r in range(3):
    for n in (("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")):
        tps, outs[n] = run(llms[n]); res[n].append(tps)
print({n: [round(x, 1) for x in v] for n, v in res.items()}, "ratio", [round(a / b, 2) for a, b in zip(res["compiled"], res["eager"])])
c = llms["compiled"].engine.runner.compiled
print("same outputs", sum(a == b for a, b in zip(outs["eager"], outs["compiled"])), len(prompts), "shapes", c.compiles, "compiled steps", c.runs)
