"""The static step's flags (`--static-step`, `--cuda-graphs`, `--gpu-memory-utilization`, `--kv-pool-tokens` and their
UNMASK_* variables) through `unmask generate`, `unmask serve` and LLM: one-line errors before anything loads, and
the options reaching the engine."""
import pytest
import torch
from typer.testing import CliRunner

from unmask.cli import app
from unmask.engine.graphs import graphs_requested
from unmask.engine.static_step import cuda_graphs_on

runner = CliRunner()


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    for name in ("UNMASK_STATIC_STEP", "UNMASK_CUDA_GRAPHS", "UNMASK_GPU_MEMORY_UTILIZATION", "UNMASK_KV_POOL_TOKENS"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("args, message", [
    (("--static-step", "--gpu-memory-utilization", "1.5"), "error: --gpu-memory-utilization must be in (0, 1], got 1.5"),
    (("--static-step", "--gpu-memory-utilization", "0"), "error: --gpu-memory-utilization must be in (0, 1], got 0.0"),
    (("--static-step", "--gpu-memory-utilization", "nan"), "error: --gpu-memory-utilization must be in (0, 1], got nan"),
    (("--static-step", "--kv-pool-tokens", "8"),
     "error: --kv-pool-tokens must be at least 16 (one page of the KV pool), got 8"),
    (("--kv-pool-tokens", "512"),
     "error: --kv-pool-tokens sizes the static step's KV pool: add --static-step (or UNMASK_STATIC_STEP=1)"),
    (("--no-static-step", "--gpu-memory-utilization", "0.5"),
     "error: --gpu-memory-utilization sizes the static step's KV pool: add --static-step (or UNMASK_STATIC_STEP=1)"),
])
def test_bad_values_are_one_line_before_loading(command, args, message, family_dirs):
    extra = ["--port", "1"] if command == "serve" else ["hi"]
    r = runner.invoke(app, [command, "--model", str(family_dirs["sdar"]), *args, *extra])
    assert r.exit_code == 1 and r.stderr.strip() == message, r.output


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("name", ["UNMASK_STATIC_STEP", "UNMASK_CUDA_GRAPHS"])
def test_a_variable_that_is_no_switch_is_one_line(command, name, family_dirs, monkeypatch):
    monkeypatch.setenv(name, "maybe")
    extra = ["--port", "1"] if command == "serve" else ["hi"]
    r = runner.invoke(app, [command, "--model", str(family_dirs["sdar"]), *extra])
    assert r.exit_code == 1 and r.stderr.strip() == (f"error: {name} must be one of 1, true, yes, on, 0, false, no, "
                                                     "off, got 'maybe'"), r.output


def test_generate_with_the_static_step_prints_the_eager_text(monkeypatch):
    """The built-in model, greedy: the same text with and without the static step (flag or variable), and the
    engine the command built used the pool it was given."""
    from unmask.engine import llm as llm_module

    built = []
    real = llm_module.LLM.__init__

    def init(self, *a, **kw):
        real(self, *a, **kw)
        built.append(self.engine)

    monkeypatch.setattr(llm_module.LLM, "__init__", init)
    common = ["generate", "--max-tokens", "12", "--policy", "threshold", "--threshold", "0.5", "def add(a, b):"]
    eager = runner.invoke(app, common)
    static = runner.invoke(app, [*common, "--static-step", "--kv-pool-tokens", "512", "--no-cuda-graphs"])
    monkeypatch.setenv("UNMASK_STATIC_STEP", "1")
    monkeypatch.setenv("UNMASK_KV_POOL_TOKENS", "256")
    by_env = runner.invoke(app, common)
    assert eager.exit_code == static.exit_code == by_env.exit_code == 0, (static.output, by_env.output)
    assert static.stdout == eager.stdout == by_env.stdout
    assert built[0].kv_pool is None
    assert built[1].kv_pool.capacity_tokens == 512 and built[1].runner.static.steps > 0
    assert built[2].kv_pool.capacity_tokens == 256 and built[2].runner.static.steps > 0


def test_the_utilization_sizes_the_pool_from_free_memory_and_a_pool_without_room_is_refused(family_dirs,
                                                                                             monkeypatch):
    """1 GiB free (CUDA's mem_get_info or the CPU's MemAvailable, stood in for here): at 0.5 the pool takes
    512 MiB less the 256 MiB reserve, in whole pages; at 0.25 nothing is left, which `generate` says in one line."""
    from unmask.engine import memory
    from unmask.engine.llm import LLM

    monkeypatch.setattr(memory, "available_bytes", lambda device: 1 << 30)
    llm = LLM(family_dirs["sdar"], static_step=True, memory_utilization=0.5, max_num_seqs=4096)
    per_token = llm.engine.kv_bytes_per_token
    assert llm.engine.kv_pool.capacity_tokens == (256 << 20) // per_token // 16 * 16
    r = runner.invoke(app, ["generate", "--model", str(family_dirs["sdar"]), "--static-step",
                            "--gpu-memory-utilization", "0.25", "hi"])
    assert r.exit_code == 1 and r.stderr.strip() == (
        "error: the static step's KV pool would hold no tokens at a memory utilization of 0.25 on cpu: 1,024 MiB "
        f"free, 256 MiB of it kept for activations, {per_token} bytes per token"), r.output


def test_serve_hands_the_options_to_the_engine(family_dirs, monkeypatch):
    """`unmask serve` puts the flags in ServerArgs; the loader builds its engine with them."""
    from unmask.server import app as app_module

    seen = []

    class Stop(Exception):
        pass

    def create_app(args):
        seen.append(args)
        raise Stop

    monkeypatch.setattr(app_module, "create_app", create_app)
    r = runner.invoke(app, ["serve", "--model", str(family_dirs["sdar"]), "--port", "1", "--static-step",
                            "--kv-pool-tokens", "1024", "--no-cuda-graphs"])
    assert isinstance(r.exception, Stop), r.output
    args = seen[0]
    assert (args.static_step, args.cuda_graphs, args.kv_pool_tokens, args.memory_utilization) == (True, False, 1024, 0.9)
    monkeypatch.undo()
    app_ = app_module.create_app(args)
    app_module.load_serving(app_, args)
    assert app_.state.load_error is None
    engine = app_.state.serving.llm.engine
    assert engine.kv_pool.capacity_tokens == 1024 and not engine.runner.static.graphs


def test_an_explicit_graphs_option_wins_over_the_variable(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setenv("UNMASK_CUDA_GRAPHS", "0")
    assert not graphs_requested() and graphs_requested(True) and cuda_graphs_on(cuda, True)
    monkeypatch.setenv("UNMASK_CUDA_GRAPHS", "1")
    assert graphs_requested() and not graphs_requested(False) and not cuda_graphs_on(cuda, False)
    assert not cuda_graphs_on(torch.device("cpu"), True)  # no capture off CUDA, whatever is asked
