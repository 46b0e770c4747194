"""The trainer's Atropos client against the real API server (`run-api` subprocesses):
registration, batches, resume's starting_step, an unreachable and a restarted API."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

pytest.importorskip("atroposlib")

from atropos_api import AtroposAPI, free_port  # noqa: E402

from polyrl.config import AtroposConfig, load_config  # noqa: E402
from polyrl.data.atropos import Registration  # noqa: E402
from polyrl.data.atropos_client import AtroposClient, AtroposError, AtroposUnreachable  # noqa: E402
from polyrl.rollout.atropos import registration  # noqa: E402

X = -100


@pytest.fixture
def api(tmp_path):
    server = AtroposAPI(tmp_path / "api.log").start()
    yield server
    server.stop()


def group(score_a: float = 1.0, score_b: float = 0.0) -> dict:
    return {
        "tokens": [[5, 6, 7, 8], [5, 6, 9, 10]],
        "masks": [[X, X, 7, 8], [X, X, 9, 10]],
        "scores": [score_a, score_b],
        "inference_logprobs": [[1.0, 1.0, -0.5, -0.25], [1.0, 1.0, -1.0, -2.0]],
    }


def client(url: str, batch_size: int = 4, **cfg) -> AtroposClient:
    reg = Registration(
        wandb_group="g",
        wandb_project="p",
        batch_size=batch_size,
        max_token_len=64,
        checkpoint_dir="/tmp/ckpt",
        save_checkpoint_interval=5,
        starting_step=0,
        num_steps=10,
    )
    settings = {"url": url, "poll_interval_s": 0.05, "max_poll_interval_s": 0.2, "unreachable_timeout_s": 20} | cfg
    return AtroposClient(AtroposConfig(**settings), reg)


def test_registration_payload_is_what_the_api_requires(tmp_path):
    from atroposlib.api.server import Registration as APIRegistration

    cfg = load_config(
        None,
        [
            "data.source=atropos",
            "data.atropos.url=http://127.0.0.1:1",
            "trainer.train_batch_size=8",
            "trainer.ppo_mini_batch_size=4",
            "rollout.n=4",
            "trainer.save_every=7",
            "trainer.total_steps=30",
            "data.atropos.wandb_project=proj",
        ],
    )
    payload = registration(cfg, tmp_path, max_token_len=256, steps_done=12).model_dump()
    APIRegistration.model_validate(payload)  # every field it requires, with its type
    assert set(payload) == set(APIRegistration.model_fields)
    assert payload["batch_size"] == 32 and payload["num_steps"] == 30 and payload["starting_step"] == 12
    assert payload["save_checkpoint_interval"] == 7 and payload["max_token_len"] == 256
    assert payload["checkpoint_dir"] == str(tmp_path / "checkpoints") and payload["wandb_project"] == "proj"


def test_register_then_poll_until_a_whole_batch_is_queued(api):
    c = client(api.url)
    c.register(steps_done=0)
    assert api.get("/info") == {"batch_size": 4, "max_token_len": 64}
    got: list = []
    t = threading.Thread(target=lambda: got.append(c.next_batch(0)))
    t.start()
    time.sleep(0.5)
    assert not got  # polling: one group of 2 is not a batch of 4
    api.post("/scored_data", group(1.0, 0.0))
    api.post("/scored_data", group(0.5, 0.25))
    t.join(10)
    assert not t.is_alive()
    batch = got[0]
    assert sorted(g["scores"][0] for g in batch) == [0.5, 1.0]
    assert {tuple(g["tokens"][0]) for g in batch} == {(5, 6, 7, 8)}
    assert api.get("/status")["current_step"] == 1
    c.close()


def test_resume_registers_with_its_starting_step(api):
    c = client(api.url)
    c.register(steps_done=17)
    assert api.get("/status")["current_step"] == 17
    c.close()


def test_unreachable_api_fails_with_one_line_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}"
    c = client(url, unreachable_timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(AtroposUnreachable) as err:
        c.register(0)
    assert 0.9 < time.monotonic() - t0 < 5
    message = str(err.value)
    assert "\n" not in message and url in message and "unreachable for 1s" in message
    c.close()


def test_a_restarted_api_is_waited_for_and_registered_with_again(api):
    c = client(api.url)
    c.register(steps_done=3)
    api.stop()  # kill -9: the API's registration and queue are gone
    got: list = []
    t = threading.Thread(target=lambda: got.append(c.next_batch(5)))
    t.start()
    time.sleep(1.0)  # the client retries meanwhile
    api.start()
    deadline = time.monotonic() + 10
    while c.num_registrations < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.num_registrations == 2
    assert api.get("/info")["batch_size"] == 4 and api.get("/status")["current_step"] == 5
    api.post("/scored_data", group())
    api.post("/scored_data", group())
    t.join(10)
    assert len(got) == 1 and len(got[0]) == 2
    c.close()


def test_a_reset_api_is_registered_with_again(api):
    c = client(api.url)
    c.register(0)
    c_batch: list = []
    api.get("/batch")  # the trainer started
    httpx.get(
        api.url + "/reset_data", timeout=5
    ).raise_for_status()  # forgets the registration; its /batch then fails with HTTP 500
    t = threading.Thread(target=lambda: c_batch.append(c.next_batch(2)))
    t.start()
    deadline = time.monotonic() + 10
    while c.num_registrations < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.num_registrations == 2
    api.post("/scored_data", group())
    api.post("/scored_data", group())
    t.join(10)
    assert len(c_batch) == 1
    c.close()


@pytest.mark.filterwarnings("ignore::UserWarning")  # the wrong type is the point
def test_a_client_error_is_not_retried(api):
    c = client(api.url)
    c.registration = c.registration.model_copy(update={"batch_size": "many"})  # the API answers 422
    with pytest.raises(AtroposError, match="HTTP 422"):
        c.register(0)
    c.close()


def test_an_api_fed_before_any_registration_is_reported_not_retried_forever(api):
    api.post("/scored_data", group())  # atroposlib then skips the trainer's registration
    c = client(api.url)
    c.register(0)
    with pytest.raises(AtroposError, match="reset_data"):
        c.next_batch(0)
    c.close()
