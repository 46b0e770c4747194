"""Fault injection for polyrl: a misbehaving TCP proxy, a small real rollout system to
break (manager, publisher, worker processes) and the fault scenarios that
`benchmarks/chaos.py` and `tests/test_chaos.py` run against it."""
