"""The Serve application on local Ray (CPU) with tiny models: HTTP (requests and the openai client),
streaming, errors, a handle call from a second app, TP=2 over gloo == TP=1 == in-process, isolation of
concurrent requests, and a cancelled stream freeing its KV state."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from sequoia_ray.config import SamplingParams  # noqa: E402
from sequoia_ray.tree.builtin import builtin_plan  # noqa: E402
from tests.serving import (BASE, app_metric_values, complete, greedy_long_prompt, served_metadata, serving,  # noqa: E402
                           sse_events, wait_for_speculation)

pytestmark = pytest.mark.integration


KEY = "s3cret-key"
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "metrics_interval_s": 1.0,
               "look_back_period_s": 2.0, "upscale_delay_s": 1.0, "downscale_delay_s": 2.0}


@pytest.fixture(scope="module")
def server(store_dir):
    apps = {"tp1": {**BASE, "plan_store": str(store_dir), "plan_refresh_s": 1.0, "max_concurrent": 2},
            "tp2": {**BASE, "tp_size": 2},
            # one app for the API key, the body limit and autoscaling: every app costs ~25 s of start-up here
            "secure": {**BASE, "api_key": KEY, "max_body_bytes": 4096, "max_concurrent": 8,
                       "autoscaling": AUTOSCALING}}
    with serving(apps) as url:
        yield url


def test_health_and_models(server):
    assert requests.get(f"{server}/tp1/health", timeout=10).json()["status"] == "ok"
    models = requests.get(f"{server}/tp1/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == "tiny"
    meta = models["data"][0]["metadata"]
    assert meta["plan_source"] == "builtin" and meta["plan_nodes"] == builtin_plan(0.0).plan.n


@pytest.mark.parametrize("prompt", ["hello world", "The quick brown fox", "x"])
def test_tp2_equals_tp1_equals_in_process(server, local, prompt):
    expected = local.decoder(builtin_plan(0.0).plan).generate(local.encode(prompt, chat=False),
                                                              SamplingParams(max_tokens=24))
    alone = local.decoder(builtin_plan(0.0).plan, speculate=False).generate(local.encode(prompt, chat=False),
                                                                           SamplingParams(max_tokens=24))
    assert expected.token_ids == alone.token_ids
    for app in ("tp1", "tp2"):
        body = complete(f"{server}/{app}", prompt)
        assert body["choices"][0]["text"] == expected.text, app
        assert body["usage"]["completion_tokens"] == len(expected.token_ids)
        assert body["usage"]["speculative"]["tokens_per_step"] > 1.0


def test_chat_stream_equals_non_stream(server):
    body = {"model": "tiny", "messages": [{"role": "developer", "content": "be brief"},
                                          {"role": "user", "content": "hi there"}],
            "max_completion_tokens": 30, "temperature": 0, "top_p": None}
    whole = requests.post(f"{server}/tp1/v1/chat/completions", json=body, timeout=60).json()
    r = requests.post(f"{server}/tp1/v1/chat/completions", stream=True, timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    lines = [line.decode() for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    *events, usage = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == whole["choices"][0]["message"]["content"]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert whole["id"].startswith("chatcmpl-") and {e["id"] for e in events} == {usage["id"]}  # one id per stream
    assert usage["id"].startswith("chatcmpl-") and whole["object"] == "chat.completion"
    assert events[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert usage["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert usage["choices"] == [] and all(e["usage"] is None for e in events)  # include_usage: OpenAI's form


def test_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/tp1/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == ["tiny"]
    c = client.completions.create(model="tiny", prompt="abc", max_tokens=10, temperature=0)
    assert c.id.startswith("cmpl-") and c.object == "text_completion"
    assert c.choices[0].finish_reason in ("length", "stop") and c.usage.completion_tokens <= 10
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hey"}],
                                          max_tokens=12, temperature=0.7, seed=3)
    again = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hey"}],
                                           max_tokens=12, temperature=0.7, seed=3)
    assert chat.choices[0].message.content == again.choices[0].message.content  # same seed, same text
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hey"}],
                                            max_tokens=12, temperature=0.7, seed=3, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="abc", max_tokens=5)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="abc", max_tokens=5, temperature=-1)


def test_a_batch_of_prompts_through_the_openai_client_is_each_prompt_alone(server, local):
    """``prompt`` an array (LangChain's ``OpenAI.generate`` sends its prompts so): one choice per prompt, each what
    the prompt alone gives, over the TP=2 app's actors, which hold every prompt's state by its request id."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/tp2/v1", api_key="unused")
    prompts = ["hello world", "The quick brown fox", "x"]
    expected = [local.decoder(builtin_plan(0.0).plan).generate(local.encode(p, chat=False),
                                                               SamplingParams(max_tokens=16)).text for p in prompts]
    batch = client.completions.create(model="tiny", prompt=prompts, max_tokens=16, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2] and [c.text for c in batch.choices] == expected
    stream = client.completions.create(model="tiny", prompt=prompts, max_tokens=16, temperature=0, stream=True)
    texts = ["", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == expected
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hey"}], n=2, seed=3,
                                          max_tokens=12, temperature=0.7)
    again = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hey"}], seed=4,
                                           max_tokens=12, temperature=0.7)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[1].message.content == again.choices[0].message.content  # choice 1: seed 3 + 1


def test_logprobs_over_the_tp2_actors_are_the_in_process_ones(server, local):
    """Rank 0's verdict carries each token's log-probability through Ray to the ingress (OpenAI's forms)."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/tp2/v1", api_key="unused")
    expected = local.decoder(builtin_plan(0.0).plan).generate(local.encode("hello world", chat=False),
                                                              SamplingParams(max_tokens=12, logprobs=2))
    c = client.completions.create(model="tiny", prompt="hello world", max_tokens=12, temperature=0, logprobs=2)
    assert c.choices[0].logprobs.token_logprobs == pytest.approx([lp for lp, _ in expected.logprobs], abs=1e-4)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hey"}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
        ({"prompt": "x", "temperature": -0.5}, 400, "temperature"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": "x" * 400}, 400, "prompt"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"prompt": "x", "n": 257}, 400, "n"),  # more choices than a request may ask for
        ({"prompt": "x", "n": 0}, 400, "n"),
        ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ({"prompt": 12}, 400, "prompt"),
        ({"prompt": [999999]}, 400, None),
        ({"prompt": "x", "model": "other"}, 404, "model"),
        ({}, 400, "prompt"),
        ({"prompt": "x" * 150, "max_tokens": 500}, 400, "max_tokens"),  # fits the limit, not the 512 context
        ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"prompt": "x", "stream": "yes"}, 400, "stream"),
        ({"prompt": "x", "stop": 5}, 400, "stop"),
        ({"prompt": "x", "seed": 2**63}, 400, "seed"),  # any 64-bit integer is a seed
        ({"prompt": ["a"] * 257}, 400, "prompt"),
        ({"prompt": {"text": "x"}}, 400, "prompt"),
        ({"prompt": "x", "model": None}, 400, "model"),
        ({"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
        ({"prompt": "x", "response_format": {"type": "json_object"}}, 400, "response_format"),
        ({"prompt": "x", "top_k": 5}, 400, "top_k"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, param):
    r = requests.post(f"{server}/tp1/v1/completions", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param:
        assert param in (err["param"] or "") or param in err["message"]
    assert "Traceback" not in r.text


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
        ({"messages": [{"role": "user"}]}, "content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None),
        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "max_completion_tokens": 6},
         "max_completion_tokens"),
    ],
)
def test_bad_chat_requests_get_openai_errors(server, body, param):
    r = requests.post(f"{server}/tp1/v1/chat/completions", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error" and "Traceback" not in r.text
    if param:
        assert param in (err["param"] or "") or param in err["message"]


def test_malformed_json_and_unknown_route(server):
    r = requests.post(f"{server}/tp1/v1/completions", data=b"{not json", timeout=30,
                      headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = requests.post(f"{server}/tp1/v1/completions", data=b"\xff\xfe\x00", timeout=30)
    assert r.status_code == 400 and "error" in r.json()
    for value in (b"Infinity", b"NaN", b"-Infinity"):  # Python's json reads these; they are not numbers here
        r = requests.post(f"{server}/tp1/v1/completions", timeout=30,
                          data=b'{"model": "tiny", "prompt": "x", "temperature": ' + value + b"}")
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
    r = requests.get(f"{server}/tp1/v1/nope", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Caller:
    """A deployment of another application that uses the service through a DeploymentHandle."""

    async def __call__(self, prompt: str) -> dict:
        handle = serve.get_app_handle("tp1")
        whole = await handle.generate.remote({"model": "tiny", "prompt": prompt, "max_tokens": 16,
                                              "temperature": 0})
        pieces = [e async for e in handle.options(stream=True).generate_stream.remote(
            {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0})]
        return {"whole": whole, "pieces": pieces}


def test_handle_from_a_second_app(server):
    handle = serve.run(Caller.bind(), name="caller", route_prefix="/caller")
    out = handle.remote("hello world").result(timeout_s=60)
    http = complete(f"{server}/tp1", "hello world", max_tokens=16)
    assert out["whole"]["choices"][0]["text"] == http["choices"][0]["text"]
    assert "".join(p["choices"][0]["text"] for p in out["pieces"]) == http["choices"][0]["text"]
    serve.delete("caller")


def test_concurrent_requests_do_not_mix(server):
    prompts = [f"prompt number {i} says" for i in range(6)]
    expected = {p: complete(f"{server}/tp2", p)["choices"][0]["text"] for p in prompts}
    got, errors = {}, []

    def run(p):
        try:
            got[p] = complete(f"{server}/tp2", p)["choices"][0]["text"]
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == expected


def active_requests(app: str) -> tuple[int, int]:
    draft = serve.get_deployment_handle("DraftDeployment", app).actors.remote().result()
    target = serve.get_deployment_handle("TargetDeployment", app).actors.remote().result()
    return ray.get(draft.active.remote()), sum(ray.get([r.active.remote() for r in target["ranks"]]))


def test_actors_run_on_the_cpu_without_assigned_gpus(server):
    """num_gpus 0 and device auto: every model actor resolves its device to the CPU."""
    draft = serve.get_deployment_handle("DraftDeployment", "tp2").actors.remote().result()
    target = serve.get_deployment_handle("TargetDeployment", "tp2").actors.remote().result()
    assert ray.get(draft.info.remote())["device"] == "cpu"
    assert target["device"] == "cpu" and len(target["ranks"]) == 2
    assert [ray.get(r.info.remote())["device"] for r in target["ranks"]] == ["cpu", "cpu"]


def test_cancelled_stream_frees_kv(server, local):
    prompt = greedy_long_prompt(local)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 500, "temperature": 0, "stream": True}
    r = requests.post(f"{server}/tp2/v1/completions", json=body, stream=True, timeout=60)
    lines = r.iter_lines()
    assert next(line for line in lines if line).startswith(b"data: ")
    assert active_requests("tp2") != (0, 0)
    r.close()  # the client goes away mid-stream
    deadline = time.time() + 30
    while time.time() < deadline and active_requests("tp2") != (0, 0):
        time.sleep(0.5)
    assert active_requests("tp2") == (0, 0)


def test_new_plan_is_picked_up_without_restart(server, store_dir):
    from sequoia_ray.plan_store import PlanKey, PlanStore
    from sequoia_ray.tree.acceptance_vector import AcceptanceVector
    from sequoia_ray.tree.planning import plan_for

    meta = served_metadata(f"{server}/tp1")
    planned = plan_for(AcceptanceVector.from_p([0.9, 0.05]), 7, 7)[0]
    assert planned.plan.n != meta["plan_nodes"]
    PlanStore(str(store_dir)).publish_plan(planned, PlanKey(meta["hardware_id"], "tiny-draft", "tiny-target", 0.0))
    deadline = time.time() + 20
    while time.time() < deadline:
        meta = served_metadata(f"{server}/tp1")
        if meta["plan_source"].startswith("store:"):
            break
        time.sleep(0.5)
    assert meta["plan_source"].startswith("store:") and meta["plan_nodes"] == planned.plan.n
    assert complete(f"{server}/tp1", "hello")["usage"]["speculative"]["plan_nodes"] == planned.plan.n


def test_overload_gets_429(server):
    """max_concurrent = 2 on this app: of 5 long requests sent at once, the extra ones get 429."""
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 500, "temperature": 0}
    barrier, codes = threading.Barrier(5), []

    def send():
        barrier.wait()
        r = requests.post(f"{server}/tp1/v1/completions", json=body, timeout=120)
        codes.append((r.status_code, r.json()))

    threads = [threading.Thread(target=send) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = sorted(c for c, _ in codes)
    assert statuses.count(200) >= 2 and 429 in statuses, statuses
    assert all(body["error"]["type"] == "rate_limit_error" for c, body in codes if c == 429)


@pytest.mark.parametrize("header,status", [(None, 401), ("Bearer wrong", 401), ("s3cret-key", 401),
                                           ("Bearer s3cret-key", 200)])
def test_api_key(server, header, status):
    headers = {"authorization": header} if header else {}
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0}
    r = requests.post(f"{server}/secure/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    if status == 401:
        assert r.json()["error"]["type"] == "authentication_error"
    assert requests.get(f"{server}/secure/v1/models", headers=headers, timeout=30).status_code == status
    assert requests.get(f"{server}/secure/health", timeout=30).status_code == 200  # health stays open


AUTH = {"authorization": f"Bearer {KEY}"}


def test_body_size_limit(server):
    headers = AUTH
    body = {"model": "tiny", "prompt": "x" * 5000, "max_tokens": 4}
    r = requests.post(f"{server}/secure/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_metrics_are_exported(server):
    """Every metric shows on the session Ray's Prometheus endpoint. Ray's metrics agent drops a gauge's value
    once it is two report intervals old (2 s here): the gauges are set by each request, so a request goes out
    again until every name has been seen (under load the one request's gauges could age out before a scrape
    saw them; session 45's CI, with every counter and histogram there)."""
    wanted = ["ray_sequoia_requests", "ray_sequoia_generated_tokens", "ray_sequoia_tokens_per_step",
              "ray_sequoia_time_to_first_token_s", "ray_sequoia_draft_step_s", "ray_sequoia_verify_step_s",
              "ray_sequoia_active_requests", "ray_sequoia_plan_nodes", "ray_sequoia_tree_steps_total",
              "ray_sequoia_accepted_steps_total"]
    deadline, missing = time.time() + 90, wanted
    while missing and time.time() < deadline:
        complete(f"{server}/tp1", "metrics please", max_tokens=12)
        scrapes_until = time.time() + 6
        while missing and time.time() < scrapes_until:
            missing = [name for name in missing if not app_metric_values(name, "tp1")]
            time.sleep(0.25)
    assert not missing, missing
    tokens = app_metric_values("ray_sequoia_generated_tokens_total", "tp1")
    assert any(v >= 12 for v in tokens), tokens


def test_draft_death_mid_stream_loses_nothing_and_speculation_comes_back(server, local):
    """Kill the draft actor while a greedy stream runs: the stream completes with exactly the tokens of
    an undisturbed run (target-only steps after the death); once Serve has replaced the unhealthy
    DraftDeployment replica, new requests speculate again. (Runs last: it disturbs app tp1.)"""
    prompt = greedy_long_prompt(local)
    undisturbed = complete(f"{server}/tp1", prompt, max_tokens=500)["choices"][0]["text"]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 500, "temperature": 0, "stream": True}
    r = requests.post(f"{server}/tp1/v1/completions", json=body, stream=True, timeout=120)
    lines = r.iter_lines()
    first = next(line for line in lines if line)
    ray.kill(serve.get_deployment_handle("DraftDeployment", "tp1").actors.remote().result())
    events = sse_events([first, *lines])
    assert "error" not in events[-1], events[-1]
    assert "".join(e["choices"][0]["text"] for e in events) == undisturbed
    assert events[-1]["usage"]["speculative"]["draft_failures"] == 1  # the death happened mid-stream
    stats = wait_for_speculation(f"{server}/tp1")
    assert stats["draft_failures"] == 0 and stats["tokens_per_step"] > 1.0, stats


def test_edge_inputs_found_by_fuzzing(server, local):
    """Regressions from test_fuzz: an EOS as the first token (0 tokens) is a normal 200; a temperature or
    top_p too small for float32 is served (greedy / the top token), not a failure; a prompt that encodes
    to no tokens is a 400."""
    eos_first = next(t for t in range(3, 97) if local.decoder(builtin_plan(0.0).plan, speculate=False)
                     .generate([t], SamplingParams(max_tokens=4)).token_ids == [])
    for stream in (False, True):
        r = requests.post(f"{server}/tp1/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": [eos_first], "max_tokens": 4, "temperature": 0, "stream": stream})
        assert r.status_code == 200, r.text
        if not stream:
            assert r.json()["usage"]["completion_tokens"] == 0 and r.json()["choices"][0]["finish_reason"] == "stop"
    greedy = complete(f"{server}/tp1", "hello")["choices"][0]["text"]
    assert complete(f"{server}/tp1", "hello", temperature=1e-38)["choices"][0]["text"] == greedy
    assert complete(f"{server}/tp1", "hello", temperature=0.7, top_p=1e-46)["choices"][0]["text"] == greedy
    r = requests.post(f"{server}/tp1/v1/completions", json={"model": "tiny", "prompt": " "}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def running_replicas(app: str, deployment: str) -> int:
    states = serve.status().applications[app].deployments[deployment].replica_states
    return states.get("RUNNING", 0)


def test_model_deployments_autoscale_on_held_requests(server, local):
    """Three long requests held at once (target_ongoing_requests 1): the draft and target deployments grow
    to their maximum of 2 replicas — Serve's own count of ongoing calls would stay ~0, as the ingress
    calls the model actors directly — and shrink back once the requests are done."""
    prompt = greedy_long_prompt(local)
    assert running_replicas("secure", "TargetDeployment") == 1
    done, errors, stop = [], [], threading.Event()

    def long_requests():
        while not stop.is_set():
            try:
                done.append(complete(f"{server}/secure", prompt, max_tokens=500, headers=AUTH)["usage"]["completion_tokens"])
            except Exception as exc:  # noqa: BLE001 - collected and asserted below
                errors.append(exc)
                return

    threads = [threading.Thread(target=long_requests) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (running_replicas("secure", "TargetDeployment") == 2
                                               and running_replicas("secure", "DraftDeployment") == 2):
        time.sleep(0.5)
    scaled = running_replicas("secure", "TargetDeployment"), running_replicas("secure", "DraftDeployment")
    stop.set()
    for t in threads:
        t.join()
    assert not errors and scaled == (2, 2) and set(done) == {500}, (errors, scaled, done)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and running_replicas("secure", "TargetDeployment") > 1:
        time.sleep(0.5)
    assert running_replicas("secure", "TargetDeployment") == 1
