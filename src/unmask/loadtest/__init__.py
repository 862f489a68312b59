"""`unmask loadtest`: a load tester for any OpenAI-compatible endpoint (docs/loadtest.md).

    workloads  what to send: random prompts, JSONL, ShareGPT, the held-out tasks
    client     one request over HTTP and its timing record; closed-loop and Poisson schedules
    metrics    the figures of a run from its records (vLLM `bench serve` definitions), pure functions
    report     terminal table, JSON, PNG plots
    cli        the typer command, registered by unmask.cli
"""
