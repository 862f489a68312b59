"""The AR twin on `unmask eval`'s function-body task: valid Python so far, repeat rate and edit similarity
of 64-token continuations, decoded by transformers' generate (greedy, or sampled with a seed), scored by the
same functions as `unmask eval`. The model card compares them with unmask-tiny's (docs/model-card.md).

    python scripts/twin_function_eval.py [--twin bench/models/ar-twin] [--temperature 0.5] [--seed 0]
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from unmask.evaluation import FUNCTION_TOKENS, edit_similarity, function_tasks, python_so_far, repeat_rate  # noqa: E402
from unmask.train.corpus import read_documents  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--twin", default="bench/models/ar-twin")
    ap.add_argument("--corpus", default="data/corpus")
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.twin)
    model = AutoModelForCausalLM.from_pretrained(args.twin).eval()
    stops = [tok.convert_tokens_to_ids(t) for t in ("<|eos|>", "<|im_end|>", "<|endoftext|>")]
    sampling = (dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=0)
                if args.temperature > 0 else dict(do_sample=False))
    tasks = function_tasks(list(read_documents(os.path.join(args.corpus, "heldout.jsonl"))), args.limit)
    torch.manual_seed(args.seed)
    valid = repeat = similarity = 0.0
    for t in tasks:
        ids = torch.tensor([tok.encode(t.prompt, add_special_tokens=False)])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=FUNCTION_TOKENS, eos_token_id=stops, pad_token_id=0,
                                 **sampling)[0, ids.shape[1]:].tolist()
        answer = t.answer(tok.decode(out, skip_special_tokens=True))
        valid += python_so_far(t.header, answer)
        repeat += repeat_rate(out)
        similarity += edit_similarity(answer, t.target)
    n = max(len(tasks), 1)
    print(f"twin function bodies ({len(tasks)}, {sampling}): valid {valid / n:.0%}, repeat {repeat / n:.2f}, "
          f"edit similarity {similarity / n:.3f}")


if __name__ == "__main__":
    main()
