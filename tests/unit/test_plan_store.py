"""The plan store on a local directory and on a real S3-protocol server (moto) on loopback."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from sequoia_ray.hardware import HardwareProfile
from sequoia_ray.plan_store import PlanKey, PlanNotFound, PlanStore, StoreError, pair_key, temperature_bucket
from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.planning import plan_for
from tests.serving import free_port

KEY = PlanKey("cpu-test-2c", "default-draft", "/models/qwen 1.5b", 0.6)


def planned(budget: int):
    return plan_for(AcceptanceVector.from_p([0.7, 0.1]), budget, 5)[0]


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


def test_a_corrupt_newest_file_is_skipped_for_the_good_plan_before_it(store, caplog):
    """A newest file that does not read (truncated, another schema version mid-upgrade) must not hide the good
    plan before it: it is logged once, naming the file, and counted in ``skips``; a folder of bad files only is
    a StoreError naming the newest."""
    path = store.publish_plan(planned(8), KEY)
    folder = path.rsplit("/", 1)[0]
    with store.fs.open_output_stream(folder + "/99990101T000000000000Z-deadbeef.json") as out:
        out.write(b'{"schema_version": 1, "parents": [')
    with store.fs.open_output_stream(folder + "/99990102T000000000000Z-deadbeef.json") as out:
        out.write(json.dumps({**planned(4).to_dict(), "schema_version": 2}).encode())
    with caplog.at_level("ERROR", logger="sequoia_ray.plan_store"):
        got, where = store.fetch_plan(KEY)
        assert (got.budget, where) == (8, path) and store.skips == 2
        store.fetch_plan(KEY)
    logged = [r for r in caplog.records if r.name == "sequoia_ray.plan_store"]
    assert store.skips == 4 and len(logged) == 2  # every skip counted, each file logged once
    assert "99990101T000000000000Z-deadbeef.json" in caplog.text and "not valid JSON" in caplog.text
    store.fs.delete_file(path)
    with pytest.raises(StoreError, match="99990102T000000000000Z-deadbeef.json.*schema_version"):
        store.fetch_plan(KEY)


@pytest.mark.parametrize("text, why", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    (json.dumps({**planned(4).to_dict(), "budget": 10 ** 9}), "budget"),
    (json.dumps({**planned(4).to_dict(), "max_depth": 10 ** 6}), "max_depth"),
    (json.dumps({**planned(4).to_dict(), "parents": [-1] + [0] * 5000}), "at most 1024"),
    (json.dumps({**planned(4).to_dict(), "provenance": {"overhead": {"alone": [-50, 0], "tree": [-80, -3]}}}),
     "overhead"),
])
def test_hostile_plan_files_are_store_errors(store, text, why):
    """Whatever a shared store holds, reading it is a StoreError naming the file and why (serving logs it and
    keeps its plan): no RecursionError, no budget the DP would run out of memory on."""
    folder = f"{store.root}/{KEY.folder()}"
    store.fs.create_dir(folder, recursive=True)
    with store.fs.open_output_stream(folder + "/99990101T000000000000Z-deadbeef.json") as out:
        out.write(text.encode())
    with pytest.raises(StoreError, match=why):
        store.fetch_plan(KEY)


def test_a_profile_must_be_the_hardware_it_is_filed_under_and_sane(store, tmp_path):
    prof = HardwareProfile("hw-a", {1: 1.0, 8: 1.2}, {1: 0.1, 8: 0.1}, 0.1, 128, "float32")
    store.publish_profile(prof)
    assert store.fetch_profile("hw-a").t == prof.t
    folder = f"{store.root}/profiles/hw-b"
    store.fs.create_dir(folder, recursive=True)
    for i, change in enumerate([{}, {"t": {"1": 1.0, "100000000": 1.5}}, {"target_step_s": float("nan")},
                                {"context": -5}, {"t": {"1": 10 ** 400}}]):
        with store.fs.open_output_stream(f"{folder}/9999010{i + 1}T000000000000Z-deadbeef.json") as out:
            out.write(json.dumps({**prof.to_dict(), **change}).encode())
        with pytest.raises(StoreError):  # the first: a profile of hw-a filed under hw-b
            store.fetch_profile("hw-b")
        store.fs.delete_file(f"{folder}/9999010{i + 1}T000000000000Z-deadbeef.json")


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


# ---- batch buckets -----------------------------------------------------------------------------------
def test_one_plan_per_batch_bucket_round_trips(store):
    keys = {b: PlanKey(KEY.hardware, KEY.draft, KEY.target, KEY.temperature, b) for b in (1, 2, 4, 8, 16)}
    for b, key in keys.items():
        store.publish_plan(planned(2 + b), key)  # each bucket its own budget
    for b, key in keys.items():
        got, path = store.fetch_plan(key)
        assert got.budget == 2 + b and got.provenance.batch == (None if b == 1 else b)
        assert ("-b" in path.rsplit("/", 2)[1]) == (b > 1)
    assert keys[1] == KEY  # bucket 1 is the default
    store.publish_plan(planned(30), keys[16])  # a newer plan of another bucket never shadows this one
    assert store.fetch_plan(KEY)[0].budget == 3


def test_a_store_of_before_reads_as_bucket_one(tmp_path):
    """A plan file written before buckets existed (no ``batch`` in its provenance, in the temperature's
    folder) is bucket 1's; the other buckets live outside that folder, so readers of before never list them,
    and bucket 1's new files carry nothing those readers would reject."""
    store = PlanStore(str(tmp_path))
    old = planned(8).to_dict()
    old["provenance"] = {"draft": KEY.draft, "target": KEY.target, "temperature": 0.6, "hardware": KEY.hardware}
    folder = tmp_path / "plans" / KEY.folder().split("/", 1)[1]
    folder.mkdir(parents=True)
    (folder / "20260101T000000000000Z-0ld0ld00.json").write_text(json.dumps(old))
    got, _ = store.fetch_plan(PlanKey(KEY.hardware, KEY.draft, KEY.target, 0.6, batch=1))
    assert got.budget == 8 and got.provenance.batch is None
    with pytest.raises(PlanNotFound, match="batch bucket 4"):
        store.fetch_plan(PlanKey(KEY.hardware, KEY.draft, KEY.target, 0.6, batch=4))
    for b in (2, 4, 8, 16):
        assert not PlanKey(KEY.hardware, KEY.draft, KEY.target, 0.6, b).folder().startswith(KEY.folder() + "/")
    path = store.publish_plan(planned(12), KEY)
    assert "batch" not in json.loads(Path(path).read_text())["provenance"]


@pytest.mark.parametrize("batch, fix", [(3, "batch_bucket\\(3\\) = 2"), (32, "= 16"), (0, "use >= 1")])
def test_a_batch_that_is_no_bucket_is_rejected(batch, fix):
    with pytest.raises(ValueError, match=f"batch {batch} is not a batch bucket.*{fix}"):
        PlanKey(KEY.hardware, KEY.draft, KEY.target, 0.6, batch)


def test_a_clock_stepped_back_does_not_hide_a_newer_publish(store, monkeypatch):
    """The latest plan is the last name in sort order, and names were the wall clock's time: a publish after an
    NTP step back (or from a host whose clock is behind) sorted before the plan it replaced, which went on being
    served. A new name is never before the folder's newest; the format stays the one readers of before sort."""
    import datetime as real

    import sequoia_ray.plan_store as plan_store

    class Clock(real.datetime):
        at = real.datetime(2025, 1, 1, 12, 0, 0, tzinfo=real.timezone.utc)

        @classmethod
        def now(cls, tz=None):
            return cls.at

    monkeypatch.setattr(plan_store, "_dt", type("Module", (), {"datetime": Clock, "timezone": real.timezone,
                                                                "timedelta": real.timedelta}))
    first = store.publish_plan(planned(16), KEY)
    Clock.at -= real.timedelta(seconds=5)  # the clock steps back 5 s
    second = store.publish_plan(planned(4), KEY)
    third = store.publish_plan(planned(8), KEY)  # and again at the same instant
    got, path = store.fetch_plan(KEY)
    assert (path, got.budget) == (third, 8) and sorted([third, second, first]) == [first, second, third]
    names = [p.rsplit("/", 1)[-1] for p in (first, second, third)]
    assert names[0].startswith("20250101T120000000000Z-") and names[1].startswith("20250101T120000000001Z-")
    Clock.at += real.timedelta(seconds=10)  # a clock ahead of every name: its own time again
    assert store.publish_plan(planned(6), KEY).rsplit("/", 1)[-1].startswith("20250101T120005000000Z-")


def test_a_file_uri_without_slashes_is_a_uri_and_a_bare_name_a_local_path(tmp_path, monkeypatch):
    """Only '://' was taken for a URI: ``file:/abs/path`` became the relative folder ``file:/abs/path`` of the
    working directory, and the plans went there. A scheme (``^[A-Za-z][A-Za-z0-9+.-]*:``) makes a URI now;
    ``plans`` stays a local path under the working directory."""
    monkeypatch.chdir(tmp_path)
    store = PlanStore(f"file:{tmp_path}/by-uri")
    assert store.root == f"{tmp_path}/by-uri"
    path = store.publish_plan(planned(8), KEY)
    assert path.startswith(f"{tmp_path}/by-uri/plans/") and not (tmp_path / "file:").exists()
    assert PlanStore(f"file://{tmp_path}/by-uri").fetch_plan(KEY)[1] == path
    assert PlanStore("plans").root == str(tmp_path / "plans")


def test_minus_zero_is_the_greedy_bucket():
    """-0.0 passes every ">= 0" check (``profile --temperatures -0``): its plans went to t-0.0, where serving's
    greedy requests (t0.0) never looked."""
    from sequoia_ray.plan_store import plan_bucket

    assert temperature_bucket(-0.0) == temperature_bucket(0.0) == "t0.0" and plan_bucket(-0.0, 4) == "t0.0-b4"
    assert temperature_bucket(0.04) == "t0.0" and temperature_bucket(0.65) == "t0.7"


def test_a_publish_leaves_its_folder_the_newest_keep_files_and_other_folders_alone(store):
    """Live re-plans publish for as long as a service runs: each publish prunes its folder to the newest ``keep``
    (the latest still fetched), and no other folder loses a file."""
    store = PlanStore(store.uri, keep=5)
    other = PlanKey(KEY.hardware, KEY.draft, KEY.target, 0.0)
    first_other = store.publish_plan(planned(4), other)
    paths = [store.publish_plan(planned(4 + i), KEY) for i in range(8)]
    kept = [p for p in store.list_plans() if f"/{temperature_bucket(0.6)}/" in p]
    assert sorted(kept) == sorted(paths[-5:])
    got, path = store.fetch_plan(KEY)
    assert path == paths[-1] and got.budget == 11
    assert store.fetch_plan(other)[1] == first_other


def test_keep_zero_keeps_every_file_and_a_keep_within_the_fallback_files_is_refused(tmp_path):
    store = PlanStore(str(tmp_path), keep=0)
    paths = [store.publish_plan(planned(4), KEY) for _ in range(7)]
    assert sorted(store.list_plans()) == sorted(paths)
    for keep in (-1, 1, 4):
        with pytest.raises(ValueError, match=f"keep {keep} would delete files a fetch may fall back to .* or 0 to "
                                             "keep every file"):
            PlanStore(str(tmp_path), keep=keep)
    from deployments.config import ServeConfig

    with pytest.raises(ValueError, match="plan_keep 2 would delete files a fetch may fall back to"):
        ServeConfig(target="tiny-target", plan_store=str(tmp_path), plan_keep=2)


def test_a_publish_removes_temporary_files_a_dead_publisher_left_and_not_a_fresh_one(tmp_path):
    import os
    import time

    from sequoia_ray.plan_store import STALE_TMP_S

    store = PlanStore(str(tmp_path))
    folder = Path(store.publish_plan(planned(4), KEY)).parent
    stale, fresh = folder / ".tmp-dead", folder / ".tmp-writing"
    stale.write_text("{")
    fresh.write_text("{")
    old = time.time() - STALE_TMP_S - 60
    os.utime(stale, (old, old))
    store.publish_plan(planned(5), KEY)
    assert not stale.exists() and fresh.exists()


class NoDeletes:
    """A file system whose deletes are refused (a policy without delete rights); everything else passes."""

    def __init__(self, fs):
        self.fs = fs

    def __getattr__(self, name):
        return getattr(self.fs, name)

    def delete_file(self, path):
        raise PermissionError(f"AccessDenied: {path}")


def test_a_prune_that_fails_never_fails_the_publish(tmp_path, caplog):
    """The plan is in place before the prune: a local store whose deletes fail keeps every file, says so, and
    still publishes. (An S3 store without deletes cannot publish at all, its move being a copy and a delete:
    check_writable refuses it, below.)"""

    store = PlanStore(str(tmp_path), keep=5)
    store.fs = NoDeletes(store.fs)
    paths = [store.publish_plan(planned(4 + i), KEY) for i in range(7)]
    assert store.fetch_plan(KEY) == (planned(10).__class__.loads(Path(paths[-1]).read_text()), paths[-1])
    assert sorted(store.list_plans()) == sorted(paths)
    assert "could not delete" in caplog.text and "AccessDenied" in caplog.text


def test_an_s3_store_is_probed_before_a_job_starts(s3_uri, tmp_path):
    """check_writable wrote nothing to a URI: a bucket that did not exist failed only at the publish after
    profiling. A good one is left without the probe."""
    good = PlanStore(s3_uri.format(prefix=tmp_path.name))
    good.check_writable()
    assert good.list_plans() == [] and good._infos("", recursive=True) == []
    missing = PlanStore(s3_uri.replace("s3://plans/", "s3://no-such-bucket/").format(prefix="p"))
    with pytest.raises(StoreError, match="s3://no-such-bucket/p cannot be written"):
        missing.check_writable()


def test_an_s3_store_that_cannot_delete_is_refused_before_a_job_starts(s3_uri, tmp_path):
    """pyarrow's S3 move is a copy and a delete: without s3:DeleteObject every publish failed after its file
    was in place (and left its temporary file). The probe said only that pruning would not work."""

    store = PlanStore(s3_uri.format(prefix=tmp_path.name))
    store.fs = NoDeletes(store.fs)
    with pytest.raises(StoreError, match="takes files but cannot delete them .*s3:DeleteObject"):
        store.check_writable()


def test_a_folder_far_over_keep_shrinks_a_bounded_number_of_files_a_publish(tmp_path):
    """A folder kept whole (keep 0), then pruned: the first publish deleted every file past keep at once (on S3
    ~3 requests each, under the lock a live re-plan publishes in). Each publish deletes PRUNE_MAX at most."""
    from sequoia_ray.plan_store import PRUNE_MAX

    whole = PlanStore(str(tmp_path), keep=0)
    for _ in range(PRUNE_MAX + 20):
        whole.publish_plan(planned(4), KEY)
    pruned, counts = PlanStore(str(tmp_path), keep=5), []
    for _ in range(3):
        newest = pruned.publish_plan(planned(5), KEY)
        counts.append(len(pruned.list_plans()))
        assert pruned.fetch_plan(KEY)[1] == newest
    assert counts == [PRUNE_MAX + 21 - PRUNE_MAX, 22 - PRUNE_MAX, 5]  # 37 files -> 21 -> 6 -> 5


# ---- what a reader takes for the latest plan --------------------------------------------------------------
def test_a_plan_filed_under_another_key_is_skipped_for_the_keys_own(tmp_path):
    """A folder copied to the wrong key (rsync of another machine's, pair's, temperature's or bucket's plans) served
    their plan silently; such a file is now skipped like a corrupt one (for the key's own plan before it), and
    alone it is a StoreError naming the file and what it was published for."""
    store, other = PlanStore(str(tmp_path)), PlanKey("A10G-tp1", "draft-b", "target-b", 0.0, batch=4)
    own = store.publish_plan(planned(6), KEY)
    folder = tmp_path / KEY.folder()
    for n, wrong in enumerate([other, PlanKey(KEY.hardware, KEY.draft, KEY.target, 0.0), PlanKey(
            KEY.hardware, KEY.draft, KEY.target, 0.6, batch=2)]):
        stray = Path(PlanStore(str(tmp_path / f"elsewhere{n}")).publish_plan(planned(9), wrong))
        (folder / f"2099010{n + 1}T000000000000Z-5tray000.json").write_bytes(stray.read_bytes())
    got, path = store.fetch_plan(KEY)
    assert path == own and got.budget == 6
    (folder / Path(own).name).unlink()
    with pytest.raises(StoreError, match="a plan for batch bucket 2 filed under plans/cpu-test-2c/.*t0.6"):
        store.fetch_plan(KEY)


def test_only_the_folders_own_published_names_are_read(tmp_path):
    """An old plan moved to a subfolder (``archive/``) sorted after every publish by its path, and a name put there
    by hand (``2nd-try.json``) after every stamp: each was served over every later publish. A name stamped at the
    end of time made every later publish an OverflowError; now a StoreError naming it."""
    store = PlanStore(str(tmp_path))
    old = Path(store.publish_plan(planned(4), KEY))
    newest = store.publish_plan(planned(12), KEY)
    (old.parent / "archive").mkdir()
    (old.parent / "archive" / old.name).write_bytes(old.read_bytes())
    (old.parent / "2nd-try.json").write_bytes(old.read_bytes())
    assert store.fetch_plan(KEY)[1] == newest
    (old.parent / "99991231T235959999999Z-pinned.json").write_bytes(old.read_bytes())
    with pytest.raises(StoreError, match="99991231T235959999999Z-pinned.json is stamped 9999-12-31.*remove or rename"):
        store.publish_plan(planned(5), KEY)


def test_a_reader_whose_listed_files_were_pruned_meanwhile_lists_again(tmp_path, monkeypatch):
    """Between a reader's listing and its read, other publishers' prunes deleted every file it listed (keep 5, five
    publishes): it failed, though newer plans were there. It lists once more."""
    writer, reader = PlanStore(str(tmp_path), keep=5), PlanStore(str(tmp_path), keep=5)
    for b in range(5):
        writer.publish_plan(planned(4 + b), KEY)
    listed, calls = reader._stamped, []

    def racing(folder):
        names = listed(folder)
        if not calls:  # the first listing only: the others publish right after it
            for _ in range(5):
                writer.publish_plan(planned(11), KEY)
        calls.append(folder)
        return names

    monkeypatch.setattr(reader, "_stamped", racing)
    got, _ = reader.fetch_plan(KEY)
    assert got.budget == 11 and len(calls) == 2 and reader.skips == 0


def test_a_uris_credentials_and_query_are_never_shown():
    """pyarrow takes ``s3://KEY:SECRET@bucket`` as credentials: the secret was in every StoreError, which serving
    keeps as ``plan_store_last_error`` (GET /v1/models) and logs. Messages show the URI without user info or query
    (a query may hold a secret too), a URI that does not open included."""
    store = PlanStore(f"s3://AKIAEXAMPLE:TOPSECRET@plans/prefix?endpoint_override=127.0.0.1:{free_port()}&scheme=http")
    with pytest.raises(StoreError) as caught:
        store.fetch_plan(KEY)
    assert "plan store s3://plans/prefix is unreachable" in str(caught.value) and "TOPSECRET" not in str(caught.value)
    assert store._display(f"{store.root}/plans/x.json") == "s3://plans/prefix/plans/x.json"
    with pytest.raises(StoreError, match="cannot open plan store 's3://plans/prefix'") as caught:
        PlanStore("s3://plans/prefix?scheme=http&secret_key=TOPSECRET")
    assert "TOPSECRET" not in str(caught.value)


def test_a_local_store_path_with_a_question_mark_is_named_as_it_is(tmp_path):
    """A ``?`` in a local folder's name is no query: an error named ``plans`` for the folder ``plans?v2``."""
    store = PlanStore(str(tmp_path / "plans?v2"))
    path = Path(store.publish_plan(planned(4), KEY))
    path.write_text("{")
    with pytest.raises(StoreError, match="not valid JSON") as caught:
        store.fetch_plan(KEY)
    assert str(caught.value).startswith(f"{path}: ")


def test_a_hardware_id_that_cannot_name_a_folder_is_refused_with_the_config():
    """``hardware_id`` names a store folder: "A100 80GB" was accepted, then every plan refresh failed and the
    service served built-in plans, or the launcher raised after Ray had started."""
    from pydantic import ValidationError

    from deployments.config import ServeConfig

    with pytest.raises(ValidationError, match="hardware_id 'A100 80GB' may hold only letters, digits"):
        ServeConfig(hardware_id="A100 80GB")
    assert ServeConfig(hardware_id="A100-80GB").hardware_id == "A100-80GB"


@pytest.mark.parametrize("uri, shown", [
    ("s3://AKIAKEY:Super Secret@bucket/p", "s3://bucket/p"),  # pyarrow cannot parse it, and said it whole
    ("s3://AKIAKEY:abc/Secret+x@bucket/p", "s3://bucket/p"),  # a "/" in the secret (AWS's often have one)
    ("s3://AKIAKEY:abc/Sec@ret@bucket/p?region=x&secret_key=Q", "s3://bucket/p"),
])
def test_a_secret_pyarrow_cannot_parse_is_hidden_in_its_error_too(uri, shown):
    """A review: "cannot open plan store 's3://bucket/p': Cannot parse URI: 's3://AKIAKEY:Super Secret@bucket/p'":
    the message hid the secret, then pyarrow's text put it back; a secret holding a "/" was shown even in the URI
    we hid (the user info cut at the first "/")."""
    from sequoia_ray.arguments import shown_uri

    assert shown_uri(uri) == shown
    with pytest.raises(StoreError) as caught:
        PlanStore(uri)
    message = str(caught.value)
    assert message.startswith(f"cannot open plan store {shown!r}: ")
    for secret in ("Super", "Secret", "abc", "AKIAKEY", "secret_key=Q"):
        assert secret not in message, message


@pytest.mark.parametrize("uri", ["hdfs://host:9000/p@x", "hdfs://namenode:8020/plans/run@2024-12",
                                 "s3://bucket/a:b@c/d", "file:///tmp/a:b@c", "s3://bucket/path@v2"])
def test_a_uri_with_a_port_or_an_at_in_its_path_is_shown_as_it_is(uri):
    """The review of the redaction above: a host:port before an "@" in the path read as KEY:SECRET, and
    ``hdfs://namenode:8020/plans/run@2024-12`` was named ``hdfs://2024-12`` in every message."""
    from sequoia_ray.arguments import shown_uri, without_secrets

    assert shown_uri(uri) == uri and without_secrets(f"cannot read {uri}", uri) == f"cannot read {uri}"
