"""The main job's demo: tree and target alone twice each, in ABBA order, each arm's rate over its two runs."""

from __future__ import annotations

import pytest

from deployments.capacity import Unplaceable
from deployments.launch import DEMO_ORDER, demo


class FakeService:
    """Answers the demo's requests on a fake clock: each request of an arm takes ``seconds[arm]`` plus
    ``drift`` x the requests before it (the host slowing down)."""

    def __init__(self, seconds: dict[str, float], drift: float = 0.0, texts: dict[str, list[str]] | None = None):
        self.seconds, self.drift, self.texts = seconds, drift, texts or {}
        self.now, self.arms = 0.0, []

    def clock(self) -> float:
        return self.now

    def post(self, url: str, json: dict) -> dict:
        assert url.endswith("/v1/chat/completions") and json["temperature"] == 0
        arm = "target alone" if json.get("speculative") is False else "tree"
        tokens = json["max_tokens"]
        if tokens > 4:  # not the warm-up
            self.now += self.seconds[arm] + self.drift * len(self.arms)
            self.arms.append(arm)
        texts = self.texts.get(arm, ["the answer"])
        text = texts[min(len(texts), sum(a == arm for a in self.arms)) - 1] if tokens > 4 else "warm"
        return {"usage": {"completion_tokens": tokens, "speculative": {"tokens_per_step": 4.0 if arm == "tree" else 1.0}},
                "choices": [{"message": {"content": text}}]}


def test_each_arm_runs_twice_in_abba_order_and_its_rate_is_over_both(capsys):
    service = FakeService({"tree": 4.0, "target alone": 12.0})
    out = demo("http://x", "m", 96, post=service.post, clock=service.clock)
    assert service.arms == list(DEMO_ORDER) == ["tree", "target alone", "target alone", "tree"]
    assert out["speedup"] == pytest.approx(3.0) and out["same_text"] is True
    printed = capsys.readouterr().out
    assert "tree         : 96 + 96 tokens in 4.0 + 4.0 s = 24.00 tok/s, 4.00 tokens/step" in printed
    assert "target alone : 96 + 96 tokens in 12.0 + 12.0 s = 8.00 tok/s, 1.00 tokens/step" in printed
    assert "3.00x" in printed and "same greedy text: True" in printed


def test_a_host_slowing_down_hits_both_arms_alike():
    """A request takes 1 s longer than the one before: in ABBA order both arms get 0 + 3 and 1 + 2 s of
    slow-down, so the ratio is (12 + 12 + 3) / (4 + 4 + 3) = 2.45 against the true 3 (tree then target alone
    once each would give 13 / 4 = 3.25, and the other order 12 / 5 = 2.4)."""
    service = FakeService({"tree": 4.0, "target alone": 12.0}, drift=1.0)
    assert demo("http://x", "m", 96, post=service.post, clock=service.clock)["speedup"] == pytest.approx(27 / 11)


def test_a_text_that_differs_in_any_run_is_reported(capsys):
    service = FakeService({"tree": 4.0, "target alone": 12.0}, texts={"target alone": ["the answer", "another"]})
    assert demo("http://x", "m", 96, post=service.post, clock=service.clock)["same_text"] is False
    assert "same greedy text: False" in capsys.readouterr().out


@pytest.mark.parametrize("host, address, url, noted", [
    ("127.0.0.1", None, "http://127.0.0.1:8000", False),
    ("0.0.0.0", None, "http://127.0.0.1:8000", False),  # a wildcard is reached here on the loopback
    ("0.0.0.0", "ray://10.0.0.5:10001", "http://10.0.0.5:8000", False),  # other machines: the head's address
    ("0.0.0.0", "10.0.0.5:6379", "http://10.0.0.5:8000", False),
    ("::", "ray://[fd00::5]:10001", "http://[fd00::5]:8000", False),
    ("127.0.0.1", "ray://10.0.0.5:10001", "http://127.0.0.1:8000", True),  # the head only: said, with the fix
    ("127.0.0.1", "auto", "http://127.0.0.1:8000", False),  # a cluster this machine is part of
    ("127.0.0.1", "ray://localhost:10001", "http://127.0.0.1:8000", False),
])
def test_the_printed_url_reaches_the_proxy(capsys, host, address, url, noted):
    from deployments.launch import service_url

    assert service_url(host, 8000, address) == url
    assert ("--host 0.0.0.0" in capsys.readouterr().out) == noted


def test_serve_passes_host_to_the_proxy(monkeypatch):
    """``--host`` reaches Serve's http_options (before, the proxy always listened on 127.0.0.1: a cluster on other
    machines could not be reached)."""
    from ray import serve

    from deployments import launch

    started = {}
    monkeypatch.setattr(launch, "init_ray", lambda address, quiet: None)
    monkeypatch.setattr(serve, "start", lambda http_options: started.update(http_options))
    monkeypatch.setattr(serve, "run", lambda app, name, route_prefix: None)
    monkeypatch.setattr("deployments.app.build_app", lambda args: object())
    monkeypatch.setattr(launch, "proxy_address", lambda host, port: (host, port))  # Serve started here: as asked
    url = launch.start({}, 8123, "ray://10.0.0.5:10001", host="0.0.0.0")
    assert started == {"host": "0.0.0.0", "port": 8123} and url == "http://10.0.0.5:8123"


def test_the_url_is_the_proxy_serve_already_runs(monkeypatch, capsys):
    """Serve already running on the cluster keeps its proxy's host and port (``serve.start`` only logs that the new
    ones are ignored): the launcher printed, and sent its demo to, the port asked for, where nothing listened."""
    from types import SimpleNamespace

    import ray.serve.context
    from ray import serve

    from deployments import launch

    monkeypatch.setattr(launch, "init_ray", lambda address, quiet: None)
    monkeypatch.setattr(serve, "start", lambda http_options: None)
    monkeypatch.setattr(serve, "run", lambda app, name, route_prefix: None)
    monkeypatch.setattr("deployments.app.build_app", lambda args: object())
    client = SimpleNamespace(http_config=SimpleNamespace(host="0.0.0.0", port=8000))
    monkeypatch.setattr(ray.serve.context, "_get_global_client", lambda: client)
    assert launch.start({}, 9000, "ray://10.0.0.5:10001", host="0.0.0.0") == "http://10.0.0.5:8000"
    assert "HTTP proxy on 0.0.0.0:8000, which it keeps (--host/--port 0.0.0.0:9000" in capsys.readouterr().out
    assert launch.start({}, 8000, "ray://10.0.0.5:10001", host="0.0.0.0") == "http://10.0.0.5:8000"
    assert capsys.readouterr().out == ""


def test_an_unset_api_key_env_is_refused_before_ray_starts(monkeypatch, capsys):
    """The replicas of a service started here inherit this environment: an unset api_key_env made every ingress
    replica refuse to start, a deploy failure with a traceback (exit 1) after the models had loaded."""
    from cli.main import main
    from deployments import launch

    monkeypatch.delenv("SEQ_TEST_KEY", raising=False)
    monkeypatch.setattr(launch, "init_ray", lambda *a, **k: pytest.fail("Ray started"))
    code = main(["serve", "--no-profile", "--set", "draft=tiny-draft", "--set", "target=tiny-target",
                 "--set", "api_key_env=SEQ_TEST_KEY", "--exit"])
    assert code == 2 and "api_key_env 'SEQ_TEST_KEY'" in capsys.readouterr().err
    launch.check_api_key_env(launch.ServeConfig(api_key_env="SEQ_TEST_KEY"), "ray://10.0.0.5:10001")  # theirs
    monkeypatch.setenv("SEQ_TEST_KEY", "k")
    launch.check_api_key_env(launch.ServeConfig(api_key_env="SEQ_TEST_KEY"), None)


def test_a_local_ray_of_the_service_runs_its_workers_at_nice_0(monkeypatch):
    """Ray's workers default to nice 15: the model actors then lost the CPU to anything else on the machine."""
    import ray

    from deployments import launch

    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.update(kwargs))
    launch.init_ray(None)
    assert seen["address"] == "local" and seen["_system_config"] == {"worker_niceness": 0}


def test_a_second_local_service_on_a_taken_port_is_refused_before_ray_starts(monkeypatch, capsys):
    """Serve's proxy binds with SO_REUSEPORT: a second `serve` on the port of a running one (which listens the
    same way) started and shared it, the kernel handing each client to either service. Refused (exit 2)."""
    import socket

    from cli.main import main
    from deployments import launch

    monkeypatch.setattr(launch, "init_ray", lambda *a, **k: pytest.fail("Ray started"))
    with socket.socket() as running:  # the running service's proxy
        running.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        running.bind(("127.0.0.1", 0))
        running.listen()
        port = running.getsockname()[1]
        code = main(["serve", "--no-profile", "--set", "draft=tiny-draft", "--set", "target=tiny-target",
                     "--set", "plan_store=null", "--port", str(port), "--exit"])
        assert code == 2 and f"port {port} on 127.0.0.1 is taken" in capsys.readouterr().err
        assert launch.cannot_listen("127.0.0.1", port) is not None
    assert launch.cannot_listen("127.0.0.1", port) is None  # closed: free again


@pytest.mark.parametrize("apps, replace, starts", [({"sequoia": None}, False, False), ({"sequoia": None}, True, True),
                                                   ({"other": None}, False, True)])
def test_a_cluster_already_serving_the_app_is_not_replaced_unless_asked(monkeypatch, capsys, apps, replace, starts):
    """`serve --address` to a cluster already serving "sequoia" replaced it without a word (its clients cut off):
    refused unless --replace; another app of the cluster is no reason."""
    from types import SimpleNamespace

    from ray import serve

    from cli.main import main
    from deployments import launch

    class Started(BaseException):  # not an error the launcher stops the app for
        pass

    def start(*args, **kwargs):
        raise Started

    monkeypatch.setattr(launch, "init_ray", lambda address, quiet: None)
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications=apps))
    monkeypatch.setattr(launch, "ensure_plans", lambda cfg, seconds, address=None: "skipped")
    monkeypatch.setattr(launch, "start", start)
    argv = ["serve", "--no-profile", "--set", "draft=tiny-draft", "--set", "target=tiny-target",
            "--address", "ray://10.0.0.5:10001", *(["--replace"] if replace else [])]
    if starts:
        with pytest.raises(Started):
            main(argv)
    else:
        assert main(argv) == 2 and "already serves an app 'sequoia'" in capsys.readouterr().err


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("address, stopped", [(None, ["delete sequoia", "shutdown"]),
                                              ("ray://10.0.0.5:10001", ["delete sequoia"])])
def test_ctrl_c_or_sigterm_stops_the_service_draining(monkeypatch, capsys, signal_name, address, stopped):
    """Ctrl-C returned at once (the local Ray torn down under the streams in flight) and SIGTERM killed the
    launcher with Ray's stack dump (exit 15). Both now stop Serve gracefully (its replicas drain) and exit 0."""
    import os
    import signal

    from ray import serve

    from deployments import launch

    calls = []
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(serve, "delete", lambda name: calls.append(f"delete {name}"))

    def wait(seconds):  # the signal arrives while the launcher waits
        os.kill(os.getpid(), getattr(signal, signal_name))
        time.sleep(1)  # the handler runs here (the main thread's next bytecode)
        pytest.fail("the signal did not stop the wait")

    import time

    before = signal.getsignal(signal.SIGTERM)
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a launcher started by a script in the background
    try:  # (and as CI runs this test: SIGINT ignored there made it hang, then fail, in session 55's clean clone)
        assert launch.serve_until_stopped(address, 300.0, wait=wait) == 0
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # restored
    finally:
        signal.signal(signal.SIGINT, ignored)
    assert calls == stopped and signal.getsignal(signal.SIGTERM) is before
    assert "requests in flight finish first (up to drain_timeout_s = 300 s" in capsys.readouterr().out


def test_a_second_ctrl_c_stops_without_waiting(monkeypatch, capsys):
    from ray import serve

    from deployments import launch

    def interrupted_again():
        raise KeyboardInterrupt

    monkeypatch.setattr(serve, "delete", lambda name: interrupted_again())

    def wait(seconds):
        raise KeyboardInterrupt

    assert launch.serve_until_stopped(None, 300.0, wait=wait) == 130
    assert "stopped without waiting" in capsys.readouterr().out


@pytest.mark.parametrize("error, code", [(RuntimeError("Deploying application sequoia failed: replica died\nTraceback"
                                                      " (most recent call last):\n  File ..."), 1),
                                         (KeyboardInterrupt(), 130)])
@pytest.mark.parametrize("address, stopped", [(None, ["delete sequoia", "shutdown"]),
                                              ("ray://10.0.0.5:10001", ["delete sequoia"])])
def test_a_failed_or_interrupted_deploy_stops_what_it_started_and_says_one_line(monkeypatch, capsys, error, code,
                                                                               address, stopped):
    """A deploy that failed printed a traceback and left the failed app on the cluster (the next run refused
    without --replace); a Ctrl-C while the models loaded did the same, the app going on loading."""
    from types import SimpleNamespace

    from ray import serve

    from cli.main import main
    from deployments import launch

    calls = []
    monkeypatch.setattr(launch, "init_ray", lambda address, quiet: None)
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications={}))
    monkeypatch.setattr(launch, "ensure_plans", lambda cfg, seconds, address=None: "skipped")
    monkeypatch.setattr(launch, "start", lambda *a, **k: (_ for _ in ()).throw(error))
    monkeypatch.setattr(serve, "delete", lambda name: calls.append(f"delete {name}"))
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append("shutdown"))
    argv = ["serve", "--no-profile", "--set", "draft=tiny-draft", "--set", "target=tiny-target", "--exit",
            "--set", "plan_store=null", "--port", "1", *(["--address", address] if address else [])]
    monkeypatch.setattr(launch, "cannot_listen", lambda host, port: None)
    assert main(argv) == code and calls == stopped
    err = capsys.readouterr().err
    assert ("interrupted" if code == 130 else "RuntimeError: Deploying application sequoia failed: replica died;") in err
    assert "Traceback" not in err and "stopping what this command started" in err


@pytest.mark.parametrize("error, code, said", [
    (Unplaceable("deployment TargetDeployment needs 9 GPU on one node; lower num_gpus"), 1, "needs 9 GPU on one node"),
    (KeyboardInterrupt(), 130, "interrupted")])
@pytest.mark.parametrize("apps", [{"sequoia": None}, {}])
def test_an_app_that_cannot_be_built_deploys_nothing_and_a_replaced_app_goes_on(monkeypatch, capsys, error, code,
                                                                                said, apps):
    """`serve --address A --replace` with a config the cluster cannot place (or a Ctrl-C while it was checked)
    deleted the app the cluster served, though nothing had replaced it: the build fails before Serve is
    touched, and nothing is started, run or deleted."""
    from types import SimpleNamespace

    from ray import serve

    from cli.main import main
    from deployments import launch

    calls = []
    monkeypatch.setattr(launch, "init_ray", lambda address, quiet=True: None)
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications=apps))
    monkeypatch.setattr(launch, "ensure_plans", lambda cfg, seconds, address=None: "skipped")
    monkeypatch.setattr("deployments.app.build_app", lambda args: (_ for _ in ()).throw(error))
    for name in ("start", "run", "delete", "shutdown"):
        monkeypatch.setattr(serve, name, lambda *a, _name=name, **k: calls.append(_name))
    argv = ["serve", "--no-profile", "--set", "draft=tiny-draft", "--set", "target=tiny-target", "--exit",
            "--set", "plan_store=null", "--address", "ray://10.0.0.5:10001", "--replace"]
    assert main(argv) == code and calls == []
    err = capsys.readouterr().err
    assert said in err and "nothing was deployed" in err and "Traceback" not in err
    assert ("'sequoia' app goes on" in err) == bool(apps)


@pytest.mark.parametrize("exit_after, code, stopped", [(True, 1, ["delete sequoia"]), (False, 0, [])])
def test_a_failed_demo_leaves_the_service_it_deployed(monkeypatch, capsys, exit_after, code, stopped):
    """The demo's error (a 401: it sent no key to a service with one) deleted the service that had deployed
    fine, on a cluster too; now said in one line, the service going on (or stopped by --exit, exit 1). The demo
    sends the service's key."""
    from types import SimpleNamespace

    import requests
    from ray import serve

    from cli.main import main
    from deployments import launch

    calls, sent = [], []
    monkeypatch.setattr(launch, "init_ray", lambda address, quiet: None)
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications={}))
    monkeypatch.setattr(launch, "ensure_plans", lambda cfg, seconds, address=None: "skipped")
    monkeypatch.setattr(launch, "start", lambda *a, **k: "http://10.0.0.5:8000")
    monkeypatch.setattr(launch, "serve_until_stopped", lambda address, drain: calls.append("served") or 0)

    def refused(url, json, headers=None, timeout=None):
        sent.append(headers)
        response = requests.Response()
        response.status_code, response.url = 401, url
        return response

    monkeypatch.setattr(requests, "post", refused)
    monkeypatch.setattr(serve, "delete", lambda name: calls.append(f"delete {name}"))
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append("shutdown"))
    argv = ["serve", "--no-profile", "--set", "draft=tiny-draft", "--set", "target=tiny-target", "--demo",
            "--set", "plan_store=null", "--set", "api_key=s3cret", "--address", "ray://10.0.0.5:10001",
            *(["--exit"] if exit_after else [])]
    assert main(argv) == code
    assert calls == (stopped if exit_after else ["served"])
    err = capsys.readouterr().err
    assert "the demo failed: HTTPError: 401" in err and "Traceback" not in err
    assert ("goes on" in err) != exit_after and "stopping what this command started" not in err
    assert sent == [{"authorization": "Bearer s3cret"}]


def test_a_model_path_that_does_not_exist_is_refused_before_ray_starts(monkeypatch, capsys, tmp_path):
    """It failed the deploy minutes later, in the replicas (a traceback); a source merely beginning "default" no
    longer fetches the default pair (3 minutes, GBs) it never uses."""
    from cli.main import main
    from deployments import launch
    from sequoia_ray.models import fetch

    monkeypatch.setattr(launch, "init_ray", lambda *a, **k: pytest.fail("Ray started"))
    monkeypatch.setattr(fetch, "fetch_default_pair", lambda *a, **k: pytest.fail("fetched the default pair"))
    missing = tmp_path / "default-ish" / "target"
    code = main(["serve", "--no-profile", "--set", "draft=tiny-draft", "--set", f"target={missing}", "--exit"])
    assert code == 2 and str(missing) in capsys.readouterr().err
    monkeypatch.setattr(launch, "init_ray", lambda *a, **k: (_ for _ in ()).throw(SystemExit(7)))
    assert main(["serve", "--no-profile", "--set", "draft=tiny-draft", "--set", "target=defaults-org/model",
                 "--exit"]) == 7  # got past the pair's fetch to Ray


@pytest.mark.parametrize("host, said", [("no-such-host.invalid", "does not resolve"),
                                        ("192.0.2.1", "is not an address of this machine")])
def test_a_host_that_cannot_be_listened_on_is_not_called_a_taken_port(host, said):
    from deployments import launch

    assert said in launch.cannot_listen(host, 8000)
