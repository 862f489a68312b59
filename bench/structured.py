"""Tokens per forward under a structured-output constraint vs unconstrained decoding.

    python bench/structured.py [--model DIR] [--oracle 0.5] [--max-tokens 160] [--policy threshold --threshold 0.9]
    python bench/structured.py --policy speculative --block-size 4 --draft-lookup 8   # the built-in default
    python bench/structured.py --versus 5 --block-size 4 --draft-lookup 8 --json F    # the two timed, interleaved

Tasks: extraction to a JSON schema, json_object, and a required tool call. For each task the same
prompts run unconstrained and constrained; reported per mode: tokens, forwards, tokens per forward,
the share of outputs that parse (and validate), forced tokens (grammar-determined text committed
without a forward), resampled drafts, and wall time per forward (the constrained minus the free
figure is the constraint's cost per step).

--model: a real checkpoint (default: the built-in unmask-tiny, else the tiny random SDAR test
checkpoint). A random or under-trained model is rarely confident, so both modes sit near one token
per forward and the comparison mostly shows forced tokens.

--oracle Q: a synthetic model that knows a valid answer and, at every step, is confident (p=0.97)
in each masked position independently with probability Q, else unsure (p=0.4) of the same token.
Both modes then emit the same text, so tokens per forward compare exactly. Independent confidences
are the worst case for the leftmost-run rule (real block-diffusion models are most confident next
to the committed prefix).

--corpus: instead, JSON-schema coverage over tests/data/json_schemas.json (real-world-style schemas using
oneOf, uniqueItems, not, unknown formats, dependencies, propertyNames, if/then/else, circular $ref with
siblings, and plain ones): per schema, whether it is accepted (no 400, at compile time or after the
after-draft retries), whether the answer is valid (jsonschema, no repeated key), cut by max_tokens, or
rejected, plus attempts used; --seeds N answers per schema; --only a,b: the schemas whose name contains a or b.

Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from unmask.engine.llm import LLM
from unmask.engine.params import GenerationParams
from unmask.engine.runner import RunnerOutput
from unmask.structured import StructuredSpec
from unmask.structured.tools import call_grammar, check_tools, fallback_messages, special_tags, tool_format

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "email": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "remote": {"type": "boolean"},
    },
    "required": ["name", "email", "age", "skills", "remote"], "additionalProperties": False,
}
PEOPLE = [
    ("Ada Lovelace, 36, ada@example.org, mathematician and programmer, works remotely.",
     {"name": "Ada Lovelace", "email": "ada@example.org", "age": 36, "skills": ["mathematics", "programming"],
      "remote": True}),
    ("Grace Hopper (grace@navy.example), aged 85: compilers, COBOL. Office based.",
     {"name": "Grace Hopper", "email": "grace@navy.example", "age": 85, "skills": ["compilers", "COBOL"],
      "remote": False}),
    ("Alan Turing, 41 years old; alan@bletchley.example; cryptanalysis, logic, computing; on site.",
     {"name": "Alan Turing", "email": "alan@bletchley.example", "age": 41,
      "skills": ["cryptanalysis", "logic", "computing"], "remote": False}),
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CITIES = ["Paris", "Buenos Aires", "Osaka"]


def tasks(llm: LLM) -> dict[str, list[tuple[list[int], StructuredSpec, str]]]:
    """name -> [(prompt ids, constraint, a valid reference answer)]."""
    fmt = tool_format(llm.spec.family.name)
    fns = check_tools([WEATHER])
    ask = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    out = {"json_schema": [], "json_object": [], "tool_call": []}
    for text, ref in PEOPLE:
        ids = llm.chat_prompt(ask("Extract the person as JSON with name, email, age, skills, remote.\n" + text))
        out["json_schema"].append((ids, StructuredSpec.json_schema(SCHEMA), json.dumps(ref)))
        out["json_object"].append((ids, StructuredSpec.json_object(), json.dumps(ref)))
    try:
        renders = "get_weather" in llm.tokenizer.apply_chat_template(ask("x"), tools=[WEATHER])
    except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
        renders = False
    grammar = StructuredSpec("lark", call_grammar(fmt, fns, None, False, special_tags(llm.tokenizer, fmt)), "tools")
    for city in CITIES:
        msgs = ask(f"What is the weather in {city}, in celsius?")
        ids = (llm.chat_prompt(msgs, tools=[WEATHER]) if renders
               else llm.chat_prompt(fallback_messages(msgs, fns, fmt)))
        args = json.dumps({"city": city, "unit": "celsius"})
        ref = f'{fmt.open_tag}{fmt.inner}{{"name": "get_weather", "arguments": {args}}}{fmt.inner}{fmt.close_tag}'
        out["tool_call"].append((ids, grammar, ref))
    return out


class OracleRunner:
    """Stands in for the model: peaked logits on a reference answer (then a stop token), no forward."""

    def __init__(self, vocab: int, q: float, seed: int = 0):
        self.vocab, self.q = vocab, q
        self.gen = torch.Generator().manual_seed(seed)
        self.answers: dict[str, tuple[int, list[int]]] = {}   # request id -> (prompt length, answer ids + stop)

    def execute(self, plans) -> RunnerOutput:
        out = []
        for plan in plans:
            P, answer = self.answers[plan.seq.request_id]
            m = plan.targets.numel()
            logits = torch.zeros(m, self.vocab)
            sure = torch.rand(m, generator=self.gen) < self.q
            for r, pos in enumerate(plan.targets.tolist()):
                j = pos - P
                tok = answer[j] if j < len(answer) else answer[-1]
                # p(tok) = 0.97 (sure) or 0.4: logit gap log(p (V-1) / (1-p)) over a flat rest
                p = 0.97 if sure[r] else 0.4
                logits[r, tok] = float(torch.log(torch.tensor(p * (self.vocab - 1) / (1 - p))))
            out.append(logits)
        return RunnerOutput(out, 0.0, sum(p.token_ids.numel() for p in plans))


def valid(text: str, spec: StructuredSpec, fmt) -> bool:
    try:
        if spec.kind == "json":
            obj = json.loads(text)
            if spec.value.get("properties"):
                import jsonschema
                jsonschema.validate(obj, spec.value)
            return True
        from unmask.structured.tools import parse_tool_calls
        _, calls = parse_tool_calls(text, fmt)
        return bool(calls) and all(json.loads(c.arguments) is not None for c in calls)
    except Exception:  # noqa: BLE001
        return False


def run(llm: LLM, items, constrained: bool, args, oracle: OracleRunner | None) -> dict:
    eng = llm.engine
    fmt = tool_format(llm.spec.family.name)
    tokens = forwards = ok = forced = resampled = 0
    t0 = time.perf_counter()
    for ids, spec, ref in items:
        knobs = dict(threshold=args.threshold) if args.policy != "speculative" else dict(draft_lookup=args.draft_lookup)
        params = GenerationParams(max_tokens=args.max_tokens, policy=args.policy, block_size=args.block_size,
                                  structured=spec if constrained else None, seed=0, **knobs)
        seq = eng.add_request(ids, params)
        if oracle is not None:
            stop = llm.spec.stop_ids[0]
            oracle.answers[seq.request_id] = (seq.P, llm.tokenizer.encode(ref) + [stop])
        eng.run_to_completion()
        text = llm.tokenizer.decode(seq.output_ids, skip_special_tokens=False)
        tokens += seq.num_generated
        forwards += seq.stats.forwards
        ok += valid(text, spec, fmt)
        if seq.constraint is not None:
            forced += seq.constraint.forced
            resampled += seq.constraint.resampled
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "forwards": forwards, "tokens_per_forward": round(tokens / max(forwards, 1), 3),
            "valid": f"{ok}/{len(items)}", "forced_tokens": forced, "resampled": resampled,
            "ms_per_forward": round(1e3 * wall / max(forwards, 1), 3), "wall_s": round(wall, 2)}


def versus(llm: LLM, args) -> None:
    """--versus ROUNDS: the constrained tasks under the threshold rule (args.threshold, the model's block) and
    under `speculative` (--block-size, --draft-lookup), interleaved (A B, then B A), each run with an empty prefix
    cache (each pays its own prefills); per task the median wall time and the ratio within each round."""
    import statistics
    from argparse import Namespace

    sides = {"threshold": Namespace(**{**vars(args), "policy": "threshold", "block_size": None}),
             "speculative": Namespace(**{**vars(args), "policy": "speculative"})}
    walls = {(t, side): [] for t in tasks(llm) for side in sides}
    counts = {}
    for r in range(args.versus):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name, items in tasks(llm).items():
            for side in order:
                cache = llm.engine.prefix_cache
                if cache is not None:
                    cache.clear()
                res = run(llm, items, True, sides[side], None)
                walls[(name, side)].append(res["wall_s"])
                counts[(name, side)] = res
    rows = []
    for name in tasks(llm):
        a, b = walls[(name, "threshold")], walls[(name, "speculative")]
        ratios = [x / y for x, y in zip(a, b)]
        row = {"task": name, "threshold_s": statistics.median(a), "speculative_s": statistics.median(b),
               "speedup_median": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios),
               "threshold": counts[(name, "threshold")], "speculative": counts[(name, "speculative")]}
        rows.append(row)
        print(f"{name:12} threshold {row['threshold_s']:.3f} s ({row['threshold']['forwards']} forwards, "
              f"{row['threshold']['valid']} valid)  speculative {row['speculative_s']:.3f} s "
              f"({row['speculative']['forwards']} forwards, {row['speculative']['valid']} valid)  "
              f"{row['speedup_median']:.2f}x [{row['speedup_min']:.2f}-{row['speedup_max']:.2f}]")
    out = {"model": str(llm.spec.path), "rounds": args.versus, "threads": args.threads, "block_size": args.block_size,
           "draft_lookup": args.draft_lookup, "threshold": args.threshold, "max_tokens": args.max_tokens,
           "rows": rows}
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "json_schemas.json"


def coverage(llm: LLM, args) -> None:
    """Acceptance and validity of strict-mode-style requests over the committed schema corpus."""
    import copy

    from unmask.errors import InvalidRequestError
    from unmask.structured.schema import check_error, parse_json, strict_objects

    items = json.loads(CORPUS.read_text())
    if args.only:
        items = [i for i in items if any(w in i["name"] for w in args.only.split(","))]
    ids = llm.chat_prompt([{"role": "user", "content": "Answer with JSON that follows the schema."}])
    rows, counts = [], {"valid": 0, "invalid": 0, "cut": 0, "rejected": 0}
    t0 = time.perf_counter()
    for item in items:
        spec = StructuredSpec.json_schema(item["schema"], strict=item["strict"])
        for seed in range(args.seeds):
            t = time.perf_counter()
            row = {"name": item["name"], "keywords": item["keywords"], "seed": seed}
            try:
                seq = llm.engine.add_request(ids, GenerationParams(max_tokens=args.max_tokens, structured=spec, seed=seed,
                                                                   temperature=args.temperature))
                llm.engine.run_to_completion()
                if seq.error is not None:
                    raise seq.error
            except InvalidRequestError as e:
                row.update(outcome="rejected", error=str(e)[:160])
            else:
                text = llm.tokenizer.decode(seq.output_ids, skip_special_tokens=False)
                value, err = parse_json(text)
                schema = item["schema"]
                if err is None:
                    if item["strict"]:  # strict mode: only the declared properties
                        schema = copy.deepcopy(schema)
                        strict_objects(schema)
                    err = check_error(schema, value)  # unknown formats are annotations: not asserted
                outcome = "valid" if err is None else ("cut" if seq.finish_reason == "length" else "invalid")
                row.update(outcome=outcome, finish_reason=seq.finish_reason, attempts=seq.constraint.attempts,
                           tokens=seq.num_generated, text=text[:120], error=err)
            row["s"] = round(time.perf_counter() - t, 2)
            counts[row["outcome"]] += 1
            rows.append(row)
            print(f"{item['name']:24} {row['outcome']:8} attempts {row.get('attempts', '-')}  {row['s']:>6}s  "
                  f"{row.get('text', row.get('error', ''))[:90]!r}", flush=True)
    n = len(rows)
    accepted = n - counts["rejected"]
    valid_share = counts["valid"] / max(accepted - counts["cut"], 1)
    print(f"{n} answers ({len(items)} schemas x {args.seeds} seeds): accepted {accepted}/{n} = "
          f"{accepted / n:.1%}; valid {counts['valid']}, invalid {counts['invalid']}, cut by max_tokens "
          f"{counts['cut']}, rejected {counts['rejected']}; valid among accepted and not cut {valid_share:.1%}; "
          f"{time.perf_counter() - t0:.0f} s")
    print(json.dumps({"corpus": str(CORPUS.name), "max_tokens": args.max_tokens, "seeds": args.seeds,
                      "temperature": args.temperature, **counts, "rows": rows}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--oracle", type=float, default=None, metavar="Q")
    ap.add_argument("--policy", default="threshold")
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--draft-lookup", type=int, default=None, help="policy speculative: its draft_lookup")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--corpus", action="store_true", help="JSON-schema coverage over tests/data/json_schemas.json")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--only", default=None, help="--corpus: only the schemas whose name contains one of these "
                                                  "comma-separated words")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--versus", type=int, default=0, metavar="ROUNDS",
                    help="time the constrained tasks under threshold against speculative, interleaved")
    ap.add_argument("--json", default=None, help="--versus: write the result here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from unmask.defaults import default_model_path
        if default_model_path().is_dir():
            model = str(default_model_path())
        else:  # the tiny random SDAR checkpoint of the tests
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from tiny_checkpoints import FAMILIES
            model = str(FAMILIES["sdar"](Path(tempfile.mkdtemp()) / "tiny-sdar"))
    llm = LLM(model, dtype="float32")  # the float32 of the committed figures
    if args.corpus:
        coverage(llm, args)
        return
    if args.versus:
        versus(llm, args)
        return
    oracle = None
    if args.oracle is not None:
        oracle = OracleRunner(llm.spec.arch.vocab_size, args.oracle)
        llm.engine.runner = oracle
    rows = []
    for name, items in tasks(llm).items():
        for constrained in (False, True):
            r = run(llm, items, constrained, args, oracle)
            rows.append({"task": name, "mode": "constrained" if constrained else "free", **r})
    knob = f"draft_lookup {args.draft_lookup}" if args.policy == "speculative" else args.threshold
    print(f"model {model}  family {llm.spec.family.name}  policy {args.policy} {knob}  "
          f"oracle {args.oracle}  block {args.block_size or llm.spec.block_size}")
    print(f"{'task':12} {'mode':12} {'tokens':>6} {'fwd':>5} {'tok/fwd':>7} {'valid':>6} {'forced':>6} "
          f"{'resamp':>6} {'ms/fwd':>7}")  # ms/fwd: wall time per forward (engine step incl. the constraint)
    for r in rows:
        print(f"{r['task']:12} {r['mode']:12} {r['tokens']:>6} {r['forwards']:>5} {r['tokens_per_forward']:>7} "
              f"{r['valid']:>6} {r['forced_tokens']:>6} {r['resampled']:>6} {r['ms_per_forward']:>7}")
    print(json.dumps({"model": model, "policy": args.policy, "threshold": args.threshold, "oracle": args.oracle,
                      "block_size": args.block_size or llm.spec.block_size, "rows": rows}))


if __name__ == "__main__":
    main()
