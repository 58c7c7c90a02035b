"""The plan store on a local directory and on a real S3-protocol server (moto) on loopback."""

from __future__ import annotations

import socket
import threading

import pytest

from sequoia_ray.hardware import HardwareProfile
from sequoia_ray.plan_store import PlanKey, PlanNotFound, PlanStore, StoreError, pair_key, temperature_bucket
from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.planning import plan_for

KEY = PlanKey("cpu-test-2c", "default-draft", "/models/qwen 1.5b", 0.6)


def planned(budget: int):
    return plan_for(AcceptanceVector.from_p([0.7, 0.1]), budget, 5)[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def s3_credentials():
    """pyarrow reads S3 credentials from the standard environment variables (never from the URI)."""
    import os

    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ.update(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test")
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def s3_uri():
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    import boto3

    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                          aws_access_key_id="test", aws_secret_access_key="test")
    client.create_bucket(Bucket="plans")
    yield f"s3://plans/{{prefix}}?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    server.stop()


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return PlanStore(str(tmp_path / "store"))
    return PlanStore(request.getfixturevalue("s3_uri").format(prefix=tmp_path.name))  # a fresh prefix per test


def test_publish_fetch_latest_and_list(store):
    with pytest.raises(PlanNotFound, match="run tuning/profile.py"):
        store.fetch_plan(KEY)
    store.publish_plan(planned(8), KEY)
    second = store.publish_plan(planned(12), KEY)
    got, path = store.fetch_plan(KEY)
    assert path == second and got.budget == 12
    assert got.provenance.hardware == KEY.hardware and got.provenance.temperature == 0.6
    assert got.plan == planned(12).plan
    other = PlanKey(KEY.hardware, KEY.draft, KEY.target, 0.0)
    with pytest.raises(PlanNotFound):
        store.fetch_plan(other)
    assert len([p for p in store.list_plans() if temperature_bucket(0.6) in p]) >= 2


def test_corrupt_or_foreign_file_names_the_key(store):
    path = store.publish_plan(planned(8), KEY)
    folder = path.rsplit("/", 1)[0]
    with store.fs.open_output_stream(folder + "/99990101T000000000000Z-deadbeef.json") as out:
        out.write(b'{"schema_version": 1, "parents": [')
    with pytest.raises(StoreError, match="99990101T000000000000Z-deadbeef.json.*not valid JSON"):
        store.fetch_plan(KEY)


def test_concurrent_publishers_do_not_corrupt(store):
    errors = []

    def publish(budget):
        try:
            store.publish_plan(planned(budget), KEY)
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=publish, args=(4 + i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    names = [p for p in store.list_plans() if KEY.folder() in p or temperature_bucket(0.6) in p]
    assert len(names) >= 8
    got, _ = store.fetch_plan(KEY)  # every file is complete and valid
    assert 4 <= got.budget <= 11


def test_profiles(store):
    prof = HardwareProfile("cpu-test-2c", {1: 1.0, 8: 1.3}, {1: 0.2}, 0.1, 128, "bfloat16")
    with pytest.raises(PlanNotFound):
        store.fetch_profile("cpu-test-2c")
    store.publish_profile(prof)
    assert store.fetch_profile("cpu-test-2c") == prof


def test_keys_are_safe_and_stable():
    assert pair_key("a", "b") == pair_key("a", "b") != pair_key("a", "c")
    assert "/" not in pair_key("/x/y", "hub/org-model")
    with pytest.raises(ValueError, match="hardware id"):
        PlanKey("../etc", "a", "b", 0.0).folder()
    with pytest.raises(ValueError, match="temperature"):
        temperature_bucket(-1)
    assert temperature_bucket(0.0) == "t0.0" and temperature_bucket(0.64) == "t0.6"


def test_unreachable_store_is_a_clear_error():
    store = PlanStore(f"s3://plans/x?endpoint_override=127.0.0.1:{free_port()}&scheme=http&region=us-east-1")
    with pytest.raises(StoreError, match="unreachable"):
        store.fetch_plan(KEY)
