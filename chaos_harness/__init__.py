"""Fault injection for polyrl: a misbehaving TCP proxy, a small real rollout system to
break (manager, publisher, worker processes) and the fault scenarios that
`benchmarks/chaos.py` and `tests/test_chaos.py` run against it.

It lives at the repository root, outside `src/`, so the installed package does not ship
it: pytest puts the root on `sys.path` (`pythonpath` in pyproject.toml), and the
benchmarks that use it add the root themselves. What it starts are `polyrl` processes
(`python -m polyrl.cli ...`), which never import it."""
