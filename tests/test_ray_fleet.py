"""`fleet.launcher = "ray"`: the trainer keeps its workers alive on a real Ray cluster
(Ray's own multi-node test cluster: a head and a worker node, each a raylet of its own on
this machine). A node lost mid-step takes its worker with it; Ray starts the worker again
on the node that replaces it, training finishes, and no sample is lost."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

# Ray's single-machine mode: every Ray process binds and advertises 127.0.0.1 (read when
# ray is imported, and inherited by the cluster's processes)
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from test_e2e import QUICK, _check_every_step  # noqa: E402
from test_train import _metrics  # noqa: E402

from polyrl.config import load_config  # noqa: E402
from polyrl.manager.fleet import FleetStatus, FleetWorker  # noqa: E402
from polyrl.status import StatusError, fetch  # noqa: E402
from polyrl.trainer.loop import train  # noqa: E402

TOKEN = "ray-fleet-test-token"
FAST_DEATH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 1000, "health_check_failure_threshold": 5}
"""A lost node is declared dead in ~5 s (Ray's default takes longer), yet a loaded CI box
missing a beat or two does not lose a node that is alive."""


@pytest.fixture
def cluster(tmp_path: Path):
    node_env = {"TMPDIR": str(tmp_path)}  # the workers' logs land here (tempfile.gettempdir on the node)
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": False,
            "_system_config": FAST_DEATH,
            "env_vars": node_env,
        },
    )
    c.node_env = node_env
    try:
        yield c
    finally:
        ray.shutdown()  # if a failed run left its connection open
        c.shutdown()


def fleet_status(run_dir: Path) -> FleetStatus:
    return fetch(json.loads((run_dir / "manager.json").read_text())["url"], TOKEN)


@pytest.mark.slow
def test_a_node_lost_mid_step_is_replaced_and_nothing_is_lost(tmp_path: Path, cluster: Cluster) -> None:
    run_dir = tmp_path / "run"
    spot_env = {**cluster.node_env, "POLYRL_INSTANCE_TYPE": "spot"}
    spot = cluster.add_node(num_cpus=1, env_vars=spot_env)  # one worker per node: each has 1 CPU
    cfg = load_config(
        None,
        [
            *QUICK,
            "trainer.total_steps=8",
            f'manager.token="{TOKEN}"',
            "fleet.num_workers=2",
            "fleet.min_workers=2",
            "fleet.launcher=ray",
            f"fleet.ray_address={cluster.address}",
            "fleet.ray_usd_per_hour={spot=0.5}",
        ],
    )
    removed: dict[str, str] = {}
    stop = threading.Event()

    def lose_the_spot_node_mid_step() -> None:
        """Once the spot node's worker has samples in flight (step 2 or later), its node
        goes without notice (its raylet and every process on it killed)."""
        while not stop.is_set():
            try:
                fleet = fleet_status(run_dir)
            except (OSError, json.JSONDecodeError, StatusError):  # the manager is not up yet
                time.sleep(0.05)
                continue
            busy = [w for w in fleet.workers if w.instance_type == "spot" and w.num_inflight > 0]
            if fleet.latest_weight_version >= 1 and busy:
                removed["worker"] = busy[0].worker_id
                cluster.remove_node(spot, allow_graceful=False)
                return
            time.sleep(0.05)

    back: list[FleetWorker] = []

    def wait_for_the_replacement(step: int, _: dict) -> None:
        """After the loss, a new node of the same type joins, as an autoscaler would bring
        one (from here: Ray adds nodes from the main thread only), and the next step starts
        once Ray's new worker on it serves, so that the rest of the run uses it (it takes a
        worker's start-up, ~10 s here)."""
        if "worker" not in removed or back:
            return
        cluster.add_node(num_cpus=1, env_vars=spot_env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            fleet = fleet_status(run_dir)
            new = [w for w in fleet.workers if w.worker_id.startswith(removed["worker"] + ".")]
            if new and new[0].state == "active" and new[0].weight_version == step:
                back.append(new[0])
                return
            time.sleep(0.2)
        raise AssertionError(f"Ray did not bring {removed['worker']} back: {fleet.workers}")

    watcher = threading.Thread(target=lose_the_spot_node_mid_step, daemon=True)
    watcher.start()
    try:
        train(cfg, run_dir, on_step_end=wait_for_the_replacement)
    finally:
        stop.set()
        watcher.join(timeout=30)
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 9))
    _check_every_step(rows)  # every sample of every step, 0 lost, on policy
    assert removed and back, "the spot node was never lost mid-step"
    # the replacement runs on the new spot node and declares that node type's price
    assert back[0].instance_type == "spot" and back[0].usd_per_hour == 0.5 and back[0].node
    last = rows[-1]
    assert last["fleet/launched"] == 2 and last["training/num_workers"] == 2
    assert last["training/num_rollout_instances"] == 2  # the replacement generated in the last step
    assert last["cost/usd_per_hour"] == pytest.approx(83.79 / 8 + 21.28 / 8 + 0.5)
    assert not ray.is_initialized()  # the fleet closed the connection it opened


@pytest.mark.slow
def test_the_autoscalers_target_reaches_rays_cluster_autoscaler(tmp_path: Path, cluster: Cluster) -> None:
    """`Fleet.request(n)` on Ray is `request_resources` with n workers' bundles: the
    request the cluster's autoscaler reads back is there (a later one replaces it)."""
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.autoscaler.v2.utils import is_autoscaler_v2
    from ray.experimental.internal_kv import _internal_kv_get

    from polyrl.config import EngineConfig, FleetConfig
    from polyrl.launch.ray_fleet import RayFleet

    ray.init(address=cluster.address, namespace="polyrl", log_to_driver=False)
    try:
        cfg = FleetConfig(launcher="ray", ray_num_cpus=1, ray_resources={"spot": 1})
        fleet = RayFleet(cfg, EngineConfig(), str(tmp_path), "http://127.0.0.1:1", TOKEN)

        def requested() -> list[dict[str, float]]:
            if is_autoscaler_v2():
                from ray.autoscaler.v2.sdk import get_cluster_resource_state

                state = get_cluster_resource_state(ray._private.worker.global_worker.gcs_client)
                return [
                    dict(r.resources_bundle)
                    for c in state.cluster_resource_constraints
                    for b in c.resource_requests
                    for r in [b.request] * b.count
                ]
            return json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL))

        fleet.request(3)
        assert requested() == [{"CPU": 1.0, "spot": 1.0}] * 3
        fleet.request(1)
        assert requested() == [{"CPU": 1.0, "spot": 1.0}]
    finally:
        ray.shutdown()
