"""Deterministic pre-training corpus from text every Python machine already has.

Sources (no network, no downloads):
  * ``stdlib``: the running interpreter's standard library ``*.py`` files, minus tests,
    idlelib, site-packages, generated codec tables, build-specific config and big files.
  * ``docs``: the Python documentation as reST (Debian/Ubuntu ``python3.X-doc`` ships the
    ``_sources/**/*.rst.txt`` files). Optional: when absent we warn and go on without it.

Measured with CPython 3.11.7 + Debian ``python3.11-doc`` (3.11.2), MB = 10**6 bytes:
stdlib 602 files / 9.13 MB, docs 497 files / 11.05 MB; 20.18 MB in all, of which 37 files
(0.36 MB) are held out. Build takes about 1 s.
See docs/data.md for the exact command.

Output of :func:`build_corpus` (one document = one file, never split by line):
  ``train.jsonl`` / ``heldout.jsonl``: one JSON object per line ``{"source","path","text"}``;
  ``manifest.json``: per-file sizes and split, totals, sha256 of both outputs.
"""
from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

MAX_CODE_BYTES = 200_000
# stdtypes.rst is ~210 KB and the single most useful docs page; only truly huge pages go.
MAX_DOC_BYTES = 512_000
HELDOUT_FRACTION = 0.03

# Directory names that never hold library code we want to learn from.
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__", "dist-packages"}
# Build- or machine-specific files: identical stdlibs on two machines could differ here.
_SKIP_PREFIXES = ("config-", "_sysconfigdata")
# Marker of machine-generated charmap codecs (encodings/cp1252.py & co): 1.4 MB of tables.
_GENERATED_MARKER = "gencodec.py"


@dataclass(frozen=True)
class CorpusFile:
    source: str  # "stdlib" | "docs"
    relpath: str  # POSIX path relative to the source root, e.g. "json/decoder.py"
    text: str

    @property
    def key(self) -> str:
        """Identity used for the held-out hash and for de-duplication."""
        return f"{self.source}/{self.relpath}"


@dataclass
class SourceStats:
    files: int = 0
    bytes: int = 0


@dataclass
class CorpusStats:
    sources: dict[str, SourceStats] = field(default_factory=dict)
    train_files: int = 0
    heldout_files: int = 0
    train_bytes: int = 0
    heldout_bytes: int = 0
    outputs: dict[str, str] = field(default_factory=dict)  # file name -> sha256

    @property
    def total_bytes(self) -> int:
        return self.train_bytes + self.heldout_bytes


def default_docs_dir() -> Path | None:
    """Where the distro's python docs keep their reST sources, preferring our version."""
    major, minor = sys.version_info[:2]
    candidates = [Path(f"/usr/share/doc/python{major}.{minor}/html/_sources")]
    candidates += sorted(Path("/usr/share/doc").glob("python3*/html/_sources"), reverse=True)
    candidates.append(Path(f"/usr/share/doc/python{major}-doc/html/_sources"))
    for path in candidates:
        if path.is_dir() and any(path.rglob("*.rst.txt")):
            return path
    return None


def _read_text(path: Path, max_bytes: int) -> str | None:
    """UTF-8 text with normalised newlines, or None for big/binary/non-UTF-8/empty files."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if len(raw) > max_bytes or b"\x00" in raw:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    text = text.replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff")
    return text if text.strip() else None


def _iter_stdlib(root: Path) -> Iterator[CorpusFile]:
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in _SKIP_DIRS for part in rel.parts[:-1]):
            continue
        if rel.parts[0].startswith(_SKIP_PREFIXES) or rel.name.startswith(_SKIP_PREFIXES):
            continue
        text = _read_text(path, MAX_CODE_BYTES)
        if text is None or _GENERATED_MARKER in text[:2000]:
            continue
        yield CorpusFile("stdlib", rel.as_posix(), text)


def _iter_docs(root: Path) -> Iterator[CorpusFile]:
    for path in sorted(root.rglob("*.rst.txt")):
        rel = path.relative_to(root).as_posix().removesuffix(".txt")
        text = _read_text(path, MAX_DOC_BYTES)
        if text is not None:
            yield CorpusFile("docs", rel, text)


def collect_files(include_docs: bool = True, *, stdlib_dir: Path | None = None,
                  docs_dir: Path | None = None) -> list[CorpusFile]:
    """All corpus documents, sorted by (source, relpath). Directories are overridable for tests."""
    stdlib_root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    files = list(_iter_stdlib(stdlib_root))
    if include_docs:
        docs_root = Path(docs_dir) if docs_dir else default_docs_dir()
        if docs_root is None or not docs_root.is_dir():
            warnings.warn("Python reST docs not found (install python3-doc / python3.X-doc); "
                          "building the corpus from the stdlib only", stacklevel=2)
        else:
            files += list(_iter_docs(docs_root))
    return sorted(files, key=lambda f: (f.source, f.relpath))


def heldout_score(key: str) -> float:
    """Stable uniform number in [0, 1) from a path: same on every machine and Python run."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_heldout(file: CorpusFile, heldout_fraction: float = HELDOUT_FRACTION) -> bool:
    return heldout_score(file.key) < heldout_fraction


def split_files(files: Iterable[CorpusFile], heldout_fraction: float = HELDOUT_FRACTION
                ) -> tuple[list[CorpusFile], list[CorpusFile]]:
    """Split by whole file on a hash of its path, so a file's split never depends on the others."""
    train: list[CorpusFile] = []
    heldout: list[CorpusFile] = []
    for f in files:
        (heldout if is_heldout(f, heldout_fraction) else train).append(f)
    return train, heldout


def write_documents(files: Iterable[CorpusFile], path: Path) -> str:
    """Write JSONL documents; returns the sha256 of the bytes written."""
    digest = hashlib.sha256()
    with open(path, "wb") as fh:
        for f in files:
            line = json.dumps({"source": f.source, "path": f.relpath, "text": f.text},
                              ensure_ascii=False) + "\n"
            data = line.encode("utf-8")
            digest.update(data)
            fh.write(data)
    return digest.hexdigest()


def read_documents(path: Path) -> Iterator[CorpusFile]:
    """Inverse of :func:`write_documents`."""
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                row = json.loads(line)
                yield CorpusFile(row["source"], row["path"], row["text"])


def build_corpus(out_dir: Path, *, include_docs: bool = True, stdlib_dir: Path | None = None,
                 docs_dir: Path | None = None, heldout_fraction: float = HELDOUT_FRACTION
                 ) -> CorpusStats:
    """Collect, split and write ``train.jsonl``, ``heldout.jsonl`` and ``manifest.json``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = collect_files(include_docs, stdlib_dir=stdlib_dir, docs_dir=docs_dir)
    train, heldout = split_files(files, heldout_fraction)

    stats = CorpusStats()
    for f in files:
        s = stats.sources.setdefault(f.source, SourceStats())
        s.files += 1
        s.bytes += len(f.text.encode("utf-8"))
    stats.train_files, stats.heldout_files = len(train), len(heldout)
    stats.train_bytes = sum(len(f.text.encode("utf-8")) for f in train)
    stats.heldout_bytes = sum(len(f.text.encode("utf-8")) for f in heldout)
    stats.outputs["train.jsonl"] = write_documents(train, out_dir / "train.jsonl")
    stats.outputs["heldout.jsonl"] = write_documents(heldout, out_dir / "heldout.jsonl")

    heldout_keys = {f.key for f in heldout}
    manifest = {
        "python_version": ".".join(map(str, sys.version_info[:3])),
        "heldout_fraction": heldout_fraction,
        "sources": {k: asdict(v) for k, v in sorted(stats.sources.items())},
        "train": {"files": stats.train_files, "bytes": stats.train_bytes},
        "heldout": {"files": stats.heldout_files, "bytes": stats.heldout_bytes},
        "sha256": stats.outputs,
        "files": [{"source": f.source, "path": f.relpath, "bytes": len(f.text.encode("utf-8")),
                   "split": "heldout" if f.key in heldout_keys else "train"} for f in files],
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return stats
