"""jemalloc for the CPU training, serving and batch commands: the process re-executes itself with it preloaded.

glibc serves every allocation above 32 MB (its largest mmap threshold) with a mapping of its own and unmaps it on
free, so each long-row activation is fresh pages the kernel must fault in and zero, step after step; the heap's
smaller blocks go back to the system through the trainer's per-step `malloc_trim` (train/heap.py) and fault in
again the same way. jemalloc with purging off keeps freed pages and reuses them. Measured on the 2-core Xeon
(docs/training.md, "The allocator", bench/allocator.py): one 8K-row step 18.3-20.1 -> 14.9-15.9 s, steps of
16 x 256 rows 1,238-1,277 -> 1,843-1,870 tokens/s, the same losses, lower peak RSS. This is what Intel's PyTorch launcher and vLLM's CPU images
do (LD_PRELOAD of jemalloc or tcmalloc); here `unmask train | finetune | distill` do it themselves where Debian's
libjemalloc2 is installed (`make setup` installs it as root). `UNMASK_ALLOCATOR=glibc` keeps glibc.

`unmask serve`, `unmask batch` and `unmask ngram-drafts` (whose --own-prompts generates) re-execute the same way,
with jemalloc's own decay (freed pages go back to the system after ~10 s idle): requests vary in length and batch,
and under glibc the heap fragments, so RSS kept growing after the prefix cache had filled (bench/engine_rss.py:
the 5.25M model, float32, batches of 64 requests, 1.25 -> 2.03 GB from the 6th batch to the 24th under glibc,
1.22-1.23 GB from the 12th on under jemalloc; docs/server.md, "Memory"). Not with `--ray`, whose processes Ray
starts itself.
"""
from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

TRAINING = ("train", "finetune", "distill")
SERVING = ("serve", "batch", "ngram-drafts")   # long inference runs; under jemalloc's default decay
# freed pages stay with the process: a training step's working set is the same every step, so keeping it is the
# point (jemalloc's default purges after 10 s, which long steps outlast: more page faults than glibc, measured)
KEEP_PAGES = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
_TRIED = "UNMASK_ALLOCATOR_REEXEC"   # set in the re-executed process: never a second exec
CHOICES = ("jemalloc", "glibc")      # UNMASK_ALLOCATOR's values


class AllocatorChoiceError(ValueError):
    pass


def choice(environ: dict) -> str:
    """UNMASK_ALLOCATOR (default jemalloc); another value is refused rather than read as glibc, so a typo does not
    silently run a long training at the slower allocator."""
    value = environ.get("UNMASK_ALLOCATOR", "jemalloc").strip().lower() or "jemalloc"
    if value not in CHOICES:
        raise AllocatorChoiceError(f"UNMASK_ALLOCATOR must be one of {', '.join(CHOICES)}, got "
                                   f"{environ['UNMASK_ALLOCATOR']!r}")
    return value


def find_jemalloc() -> str | None:
    """The path of a loadable libjemalloc, or None."""
    for d in _LIB_DIRS:
        p = Path(d) / "libjemalloc.so.2"
        if p.is_file():
            return str(p)
    name = ctypes.util.find_library("jemalloc")
    return name if name and os.path.isabs(name) else None


def active() -> str:
    """'jemalloc' where it is mapped into this process, 'glibc' on other Linux processes, else 'unknown'."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    return "jemalloc" if "libjemalloc" in maps else "glibc"


def reexec_env(environ: dict, lib: str | None, malloc_conf: str | None = KEEP_PAGES) -> dict | None:
    """The environment to re-execute a command under jemalloc (MALLOC_CONF `malloc_conf` unless the user set one;
    None: jemalloc's defaults), or None to run as it is: no library, UNMASK_ALLOCATOR=glibc, an allocator the user
    preloaded already, or this process is the re-executed one."""
    if choice(environ) != "jemalloc" or lib is None or environ.get(_TRIED):
        return None
    preload = environ.get("LD_PRELOAD", "")
    if "malloc" in preload:   # jemalloc or tcmalloc by the user's choice
        return None
    env = dict(environ)
    env["LD_PRELOAD"] = f"{lib} {preload}".strip()
    if malloc_conf:
        env.setdefault("MALLOC_CONF", malloc_conf)
    env[_TRIED] = "1"
    return env


def maybe_reexec(argv: list[str]) -> None:
    """Called by the console entry point before anything else (argv: sys.argv): re-run a training, serving or batch
    command under jemalloc, with the interpreter's own command line (sys.orig_argv: the console script, or -m
    unmask.cli)."""
    command = next((a for a in argv[1:] if not a.startswith("-")), None)
    if not sys.platform.startswith("linux"):
        return
    if command in TRAINING:
        conf = KEEP_PAGES
    elif command in SERVING and "--ray" not in argv:
        conf = None
    else:
        return
    try:
        env = reexec_env(dict(os.environ), find_jemalloc(), conf)
    except AllocatorChoiceError as e:   # the CLI's one-line error, before anything runs
        print(f"Error: {e}", file=sys.stderr)
        sys.exit(2)
    if env is None:
        return
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:   # an exec that fails leaves this process as it was: run on glibc
        return
