"""agentkv's benchmarks: workloads, runners, baselines as their papers define them, reports.

Installed apart from the product (`pip install -e benchmarks`); `agentkv bench …` runs them.
The core never imports this package.
"""
