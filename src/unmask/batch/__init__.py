"""Batch jobs: OpenAI's Batch API in the server (routes.py, runner.py, jobs.py in the store's database) and the
offline `unmask batch` runner (offline.py). Both read the same line format (lines.py) and run each line through
the server's own route code in-process (execute.py)."""
