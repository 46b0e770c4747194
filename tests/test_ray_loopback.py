"""`fleet.launcher = "ray"` on one machine: the local cluster the launcher starts for itself
listens on loopback only, and a cluster on this machine alone that listens beyond it is
named in one warning (issue 38, 14). Each cluster runs in a process of its own, with
Ray's environment as a user's shell has it: no RAY_ADDRESS, and a Ray temp directory of
its own, so that no cluster another program left on this machine is joined."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

from polyrl.serving import is_loopback

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is an optional extra")

LISTENERS = """
import json, logging, sys, time
from polyrl.config import EngineConfig, FleetConfig
from polyrl.launch.ray_fleet import RayFleet, connect, import_ray, ray_listeners

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
if sys.argv[1] == "launcher":
    ray = connect(None)  # what RayFleet does without fleet.ray_address
else:
    ray = import_ray()
    ray.init(address="local", num_cpus=1)  # Ray's defaults
listeners, deadline = [], time.monotonic() + 60
while time.monotonic() < deadline:  # until every agent of the node serves: the set stops growing
    time.sleep(2.0)
    now = ray_listeners()
    if now == listeners:
        break
    listeners = now
RayFleet(FleetConfig(launcher="ray"), EngineConfig(), "model", "http://127.0.0.1:1", "token")  # joins this one
print(json.dumps(listeners))
ray.shutdown()
"""


def listeners_of(kind: str, tmp_dir: str) -> tuple[list[list], str]:
    """Ray's listening sockets (address, port, process) in a cluster started the `kind`
    way, and what its process logged."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"RAY_TMPDIR": tmp_dir}
    out = subprocess.run([sys.executable, "-c", LISTENERS, kind], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.fixture
def ray_tmp() -> Iterator[str]:
    """Short: Ray's socket paths under it must fit in 107 bytes."""
    path = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
def test_the_launchers_own_cluster_listens_on_loopback_only(ray_tmp: str) -> None:
    listeners, logged = listeners_of("launcher", ray_tmp)
    names = {name for _, _, name in listeners}
    assert {"gcs_server", "raylet"} <= names, listeners  # what was looked at
    assert all(is_loopback(address) for address, _, _ in listeners), listeners
    assert "started a local Ray cluster (node 127.0.0.1)" in logged
    assert "beyond loopback" not in logged, logged


@pytest.mark.slow
def test_a_cluster_on_this_machine_that_listens_beyond_loopback_is_named_once(ray_tmp: str) -> None:
    listeners, logged = listeners_of("defaults", ray_tmp)
    exposed = [f"[{a}]:{p} ({n})" if ":" in a else f"{a}:{p} ({n})" for a, p, n in listeners if not is_loopback(a)]
    if not exposed:
        pytest.skip("Ray's defaults listen on loopback only on this machine (no other interface?)")
    warnings = [line for line in logged.splitlines() if "beyond loopback" in line]
    gcs = [e for e in exposed if e.endswith("(gcs_server)")]  # workers come and go; the GCS stays
    assert len(warnings) == 1 and gcs and all(e in warnings[0] for e in gcs), (warnings, exposed)
    assert "Ray on one machine" in warnings[0]
