"""Start the service on local Ray (or a cluster), optionally send a demo request, keep serving.

    sequoia-ray serve [--config deployments/config.yaml] [--port 8000] [--demo] [--exit] [--set key=value ...]
                      [--address A [--replace]]
                      [--profile-seconds 120] [--no-profile]

Before Serve starts, when the local plan store holds no plan for this machine's hardware id, the pair and
a temperature bucket the job plans for (0.0 and 0.6), the launcher profiles this machine in-process with
the serving configuration (dtype, draft quantisation, device, the target's threads) within
``--profile-seconds``, publishes the plans and serves them; when that is impossible or fails, the
built-in plan is served (the reason is printed). When the budget fits t(n) and c but not the acceptance
vector p, the plans are chosen for this machine's t(n) and c with the built-in p (said in their provenance,
``source``); a later run given more seconds profiles again. A plan already in the store, ``--no-profile``, a remote
store, ``--address`` (the actors run elsewhere) or tensor parallelism skip it.

A local Ray starts with its idle processes' timers slowed (``actors/quiet_ray.py``; ``--ray-default-timers``
keeps Ray's): on a 2-core host they cost the models' forwards 11-17%.

A local service refuses a port something already listens on (Serve's proxy would share it with the running one:
SO_REUSEPORT), and ``--address`` a cluster already serving the ``sequoia`` app unless ``--replace``.

``--demo`` sends a real chat request twice (tree speculation, then the target alone, via the
``speculative: false`` request extension) and prints the answer and the speedup. ``--exit`` stops the
service afterwards; otherwise it keeps serving until Ctrl-C, printing the URL to call.
"""

from __future__ import annotations

import argparse

import json
import os
import sys
import time
from pathlib import Path

import yaml
from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

from deployments.config import ServeConfig
from sequoia_ray.arguments import Parser, is_uri, nonneg_float, shown_uri
from sequoia_ray.config import ProfileJobConfig
from sequoia_ray.models import loading
from sequoia_ray.paths import user_path

DEFAULT_CONFIG = Path(__file__).resolve().parent / "config.yaml"
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000  # Serve's proxy when neither the config nor the command line says
APP_NAME = "sequoia"  # the Serve application this command runs
PROFILE_SECONDS = 120.0
SERVED_TEMPERATURES = ProfileJobConfig.model_fields["temperatures"].default  # the buckets profiling plans for
DEMO_PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring."


def app_args(config: Path, overrides: list[str]) -> dict:
    """The first application's args in a Serve config file, with ``KEY=VALUE`` overrides (VALUE read as YAML).
    A malformed file or override is a ValueError naming it."""
    spec = _spec(config)
    _check_spec(config, spec)
    try:
        args = dict(spec["applications"][0].get("args") or {})
    except (TypeError, KeyError, IndexError, AttributeError, ValueError):  # ValueError: args: "abc"
        raise ValueError(f"config {str(config)!r} has no 'applications:' list with an application's 'args:' "
                         "(see deployments/config.yaml)") from None
    args.update(override(item) for item in overrides)
    store = args.get("plan_store")
    if store is not None and not isinstance(store, str):
        raise ValueError(f"plan_store {store!r} must be a path or a URI (a string), e.g. plan_store=./plans")
    if store and not is_uri(store):  # actors do not share the launcher's working directory
        args["plan_store"] = str(user_path(store).resolve())
    return args


SERVE_KEYS = set(ServeDeploySchema.model_fields)  # Ray's own: a key of a later Ray is not refused as unknown
APP_KEYS = set(ServeApplicationSchema.model_fields)


def _check_spec(config: Path, spec: dict) -> None:
    """A ValueError for what a Serve config file says that this launcher would drop without a word: a key no Serve
    config has (``http_option`` for ``http_options``: the port it gave was not used), a second application, or an
    application name or route prefix other than the ones it serves (``APP_NAME`` at ``/``). ``serve deploy`` reads
    the whole file, as a RayService does."""
    def unknown(keys, known) -> list[str]:
        return sorted(str(k) for k in keys if k not in known)

    where = f"config {str(config)!r}"
    if extra := unknown(spec, SERVE_KEYS):
        raise ValueError(f"{where}: unknown key(s) {', '.join(extra)}; a Serve config has "
                         f"{', '.join(sorted(SERVE_KEYS))}")
    apps = spec.get("applications")
    if not isinstance(apps, list) or not apps or not isinstance(apps[0], dict):
        return  # said by app_args, with what to give
    if len(apps) > 1:
        raise ValueError(f"{where}: {len(apps)} applications; `sequoia-ray serve` runs one (give one, or deploy the "
                         "file with `serve deploy`)")
    app = apps[0]
    if extra := unknown(app, APP_KEYS):
        raise ValueError(f"{where}: unknown application key(s) {', '.join(extra)}; an application has "
                         f"{', '.join(sorted(APP_KEYS))}")
    for key, served in (("name", APP_NAME), ("route_prefix", "/")):
        if app.get(key) not in (None, served):  # (None: Ray's default)
            raise ValueError(f"{where}: application {key} {app[key]!r}: `sequoia-ray serve` serves {APP_NAME!r} at "
                             f"'/'; drop it, or deploy the file with `serve deploy`")


def check_api_key_env(cfg: ServeConfig, address: str | None) -> None:
    """An ``api_key_env`` unset here, when this command starts Ray: the ingress replicas inherit this environment
    and would refuse to start (``ingress.api_key_header``), which Serve reports as a deploy failure with a
    traceback after the models have loaded. Said at once instead (a cluster elsewhere has its own environment)."""
    if cfg.api_key_env and cfg.api_key is None and address in (None, "local") and not os.environ.get(cfg.api_key_env):
        raise ValueError(f"api_key_env {cfg.api_key_env!r}: that environment variable is unset or empty here, and "
                         "the service started here reads it; export it, or give api_key, or drop api_key_env for "
                         "an open API")


def http_options(config: Path) -> tuple[str, int]:
    """The host and port of the config file's ``http_options`` (as ``serve run`` reads them), each 127.0.0.1 / 8000
    when not given there: ``--host`` and ``--port`` override them. A bad one is a ValueError naming it."""
    options = _spec(config).get("http_options") or {}
    if not isinstance(options, dict):
        raise ValueError(f"config {str(config)!r}: http_options {options!r:.60} must map host and port")
    host, port = options.get("host", DEFAULT_HOST), options.get("port", DEFAULT_PORT)
    if not isinstance(host, str) or not host.strip():
        raise ValueError(f"config {str(config)!r}: http_options host {host!r} must be an interface, e.g. 127.0.0.1")
    try:
        return host, port_number(str(port))
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"config {str(config)!r}: http_options port {exc}") from None


def _spec(config: Path) -> dict:
    """A Serve config file's YAML ({} when it is not a mapping); a ValueError naming it when it does not parse."""
    try:
        text = config.read_text()
    except (OSError, UnicodeDecodeError) as exc:  # (it said "[Errno 2] No such file or directory: ...", or named
        said = exc.strerror if isinstance(exc, OSError) and exc.strerror else " ".join(str(exc).split())  # no file)
        raise ValueError(f"--config {str(config)!r}: {said}; give a Serve config file (YAML, UTF-8), e.g. "
                         "deployments/config.yaml") from None
    try:
        spec = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"config {str(config)!r} is not valid YAML: {' '.join(str(exc).split())}") from None
    return spec if isinstance(spec, dict) else {}


def override(item: str) -> tuple[str, object]:
    """A ``--set KEY=VALUE`` as (KEY, VALUE read as YAML); a ValueError naming the item when it is not one."""
    key, eq, value = item.partition("=")
    if not eq or not key.strip():
        raise ValueError(f"--set {item!r}: give KEY=VALUE (e.g. --set max_concurrent=4; KEY=null unsets an optional "
                         "key, e.g. --set draft=null)")
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError as exc:
        raise ValueError(f"--set {item!r}: the value is not valid YAML ({' '.join(str(exc).split())})") from None


def port_number(text: str) -> int:
    """``--port``: a TCP port, checked before Ray starts (99999 failed inside Serve's proxy with a traceback)."""
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1..65535)")
    return int(text)


def cannot_listen(host: str, port: int) -> str | None:
    """Why Serve's proxy could not have ``host``:``port`` to itself (the message, with the fix), None when it can.
    Serve's proxy binds with SO_REUSEPORT, so a second local service on the port of a running one did not fail:
    both listened and the kernel split the clients between them (a user's requests answered by the other
    service's models). A bind without that option fails where anything already listens (SO_REUSEADDR: not where
    connections of a service just stopped linger in TIME_WAIT). A host that does not resolve, or is no address of
    this machine, is said as such (both read "port taken" before)."""
    import errno
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        return f"--host {host!r} does not resolve ({exc.strerror}); give a name or address of this machine (0.0.0.0: all)"
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed service's TIME_WAIT is no owner
            sock.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return (f"port {port} on {host} is taken ({exc.strerror}): another service listens there (a `sequoia-ray "
                    f"serve` still running? `ray stop` ends a local one); pick another with --port")
        if exc.errno == errno.EADDRNOTAVAIL:
            return f"--host {host} is not an address of this machine ({exc.strerror}); give one of its own, or 0.0.0.0"
        return f"cannot listen on {host}:{port} ({exc.strerror or exc}); pick another --host or --port"
    return None


def running_app(address: str | None) -> bool:
    """Whether the cluster at ``address`` (connected) already serves an app named ``APP_NAME``: ``serve.run``
    would replace it (its clients' requests cut off) without a word."""
    from ray import serve

    return address not in (None, "local") and APP_NAME in serve.status().applications


def serving_hardware_id(cfg: ServeConfig) -> str:
    """The hardware id the app's ``TargetDeployment`` looks plans up by: the same method on the same inputs
    (the target actor sets torch to ``actor_spec("target").threads`` and reports that, and the name of the
    GPU it runs on — here the one this process would resolve the actors' device to: ``device_type``, the CPU for
    ``device: auto`` without ``num_gpus``, whatever GPUs this process sees)."""
    from sequoia_ray.devices import resolve_device
    from sequoia_ray.hardware import accelerator_name

    return cfg.plan_hardware_id(cfg.actor_spec("target").threads, accelerator_name(resolve_device(cfg.device_type)))


def why_not_profile(cfg: ServeConfig, seconds: float | None, address: str | None) -> str | None:
    """Why the launcher must not profile this machine for ``cfg`` (None: it may)."""
    reasons = [(not seconds, "profiling is off (--no-profile or --profile-seconds 0)"),
               (not cfg.plan_store, "no plan store is configured"),
               (is_uri(cfg.plan_store or ""),
                f"the plan store {shown_uri(cfg.plan_store or '')} is remote: run tuning/profile.py"),
               (cfg.draft is None, "no draft model: the target alone needs no plan"),
               (address not in (None, "local"), f"the actors run on the cluster at {address}, not on this machine"),
               (cfg.tp_size > 1, f"tp_size {cfg.tp_size}: profile the TP group with tuning/profile.py"),
               (cfg.device_type == "cuda" and not _cuda_here(), "the actors run on GPUs this process does not see: "
                                                                "run tuning/profile.py where they are")]
    return next((why for bad, why in reasons if bad), None)


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def missing_temperatures(cfg: ServeConfig, hardware: str, seconds: float | None = None) -> tuple[float, ...]:
    """The served temperature buckets with no usable plan in the store for this hardware and pair: none
    stored, a corrupt one, or one measured with another serving configuration or, when ``seconds`` are
    given to profile, with less time than that and no measured p (printed: see ``stale``)."""
    from sequoia_ray.plan_store import PlanKey, PlanNotFound, PlanStore, StoreError

    store, missing = PlanStore(cfg.plan_store), []
    for temperature in SERVED_TEMPERATURES:
        try:
            planned, _ = store.fetch_plan(PlanKey(hardware, cfg.draft, cfg.target, temperature))
        except (PlanNotFound, StoreError):  # a corrupt latest plan is replaced by a fresh one
            missing.append(temperature)
            continue
        why = stale(planned.provenance, cfg, seconds)
        if why:
            print(f"plans: the stored plan for T={temperature} was measured with {why}; profiling again", flush=True)
            missing.append(temperature)
    return tuple(missing)


def stale(prov, cfg: ServeConfig, seconds: float | None = None) -> str | None:
    """Why a stored plan must be profiled again (None: it need not): it was measured under another serving
    configuration (``ServeConfig.measured_otherwise``), or it was made with the built-in acceptance vector (its
    budget had no time to measure p) and more ``seconds`` than that budget are given now."""
    from sequoia_ray.tree.plan_file import BUILTIN_ACCEPTANCE

    why = cfg.measured_otherwise(prov)
    if why or prov.dtype is None:
        return why
    budget = prov.time_budget_s or 0.0
    if prov.source == BUILTIN_ACCEPTANCE and seconds and seconds > budget:
        return f"the built-in acceptance vector ({budget:.0f}s left no time to measure p; {seconds:.0f}s now)"
    return None


def ensure_plans(cfg: ServeConfig, seconds: float | None, *, address: str | None = None, run=None,
                 clock=time.monotonic) -> str:
    """Profile this machine when the store lacks its plans (see the module docstring); returns what the
    app will serve: ``skipped`` (reason printed), ``present``, ``profiled`` or ``builtin`` (profiling failed).
    ``run`` is ``sequoia_ray.profiling.run_bounded`` unless a test passes another."""
    from sequoia_ray.profiling import Serving, format_results, run_bounded

    why = why_not_profile(cfg, seconds, address)
    if why:
        print(f"plans: not profiling ({why})", flush=True)
        return "skipped"
    hardware = serving_hardware_id(cfg)
    missing = missing_temperatures(cfg, hardware, seconds)
    if not missing:
        print(f"plans: the store {shown_uri(cfg.plan_store)} has plans for {hardware}; serving them", flush=True)
        return "present"
    job = ProfileJobConfig(storage=cfg.plan_store, draft=cfg.draft, target=cfg.target, temperatures=missing,
                           dtype=cfg.dtype, draft_quantize=cfg.draft_quantize, linears=cfg.linears, layers=cfg.layers,
                           draft_vocab=cfg.draft_vocab, device=cfg.device_type)  # where the actors will run
    serving = Serving(threads=cfg.actor_spec("target").threads, time_budget_s=float(seconds), calls=_call_probe())
    print(f"plans: none for {hardware} at T={', '.join(map(str, missing))}; profiling this machine "
          f"(at most {seconds:.0f}s, --no-profile skips) ...", flush=True)
    start_t = clock()
    try:
        from sequoia_ray.hardware import torch_threads

        with torch_threads(serving.threads):
            results = (run or run_bounded)(job, hardware, serving, clock=clock)
    except Exception as exc:  # noqa: BLE001 - a plan is an optimisation: any failure serves the built-in one
        print(f"plans: profiling failed, serving the built-in plan: {type(exc).__name__}: {exc}", flush=True)
        return "builtin"
    finally:
        release_accelerator(job.device)
    print(f"plans: profiled in {clock() - start_t:.0f}s (loading the models included) and published:\n{format_results(results)}", flush=True)
    return "profiled"


def release_accelerator(device: str) -> None:
    """After profiling on a GPU in this (the driver's) process: its models are gone, but torch's caching allocator
    keeps their memory; hand it back before the served actors load the same models on the same GPU."""
    if device == "cuda":
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


def _call_probe():
    """The served step's actor calls are measured when Ray is up here (``actors.call_probe``), else not counted."""
    import ray

    if not ray.is_initialized():
        return None
    from actors.call_probe import measure_calls

    return measure_calls


def init_ray(address: str | None, quiet: bool = True) -> None:
    """Ray at ``address``, else a new local Ray, its idle timers slowed unless ``quiet`` is False
    (``actors.quiet_ray``: on the 2-core Xeon the idle app cost a decoder beside it 11-17% with Ray's
    defaults, 4% with these), and its workers (the model actors) at nice 0: at Ray's default 15 any other
    process of the machine came first (a new user's main job beside a busy core: the target alone at 1.30
    tokens/s for the README's 5.29, the profile 293 s for its budget of 120)."""
    import ray

    from actors.quiet_ray import quiet_ray_environ

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address)
    else:
        # a new local Ray with the machine's real CPUs (what `serve run` gets too); a bare ray.init() would
        # attach to any Ray already running here (another job's, a test's) and replace its "sequoia" app
        with quiet_ray_environ(quiet):  # workers at nice 0, not Ray's 15: the service is this machine's work
            ray.init(address="local", include_dashboard=False, _system_config={"worker_niceness": 0})


class NotDeployed(Exception):
    """The app could not be built (``Unplaceable`` on the cluster, say): nothing reached Serve, so an app the
    cluster already serves runs on as it was. The cause is ``__cause__``."""


def start(args: dict, port: int, address: str | None, quiet: bool = True, host: str = "127.0.0.1") -> str:
    """Serve the app, its HTTP proxy on ``host``:``port``; the URL clients use (see ``service_url``). The app is
    built before anything reaches Serve: a build that fails raises ``NotDeployed``."""
    from ray import serve

    from deployments.app import build_app

    init_ray(address, quiet)
    try:
        app = build_app(args)
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - re-raised, marked as before any deploy
        raise NotDeployed(_one_line(exc)) from exc
    serve.start(http_options={"host": host, "port": port})
    host, port = proxy_address(host, port)
    serve.run(app, name=APP_NAME, route_prefix="/")
    return service_url(host, port, address)


def proxy_address(host: str, port: int) -> tuple[str, int]:
    """The host and port Serve's proxy really has. Serve already running on a cluster keeps its own (``serve.start``
    only logs that new ones are ignored): the launcher printed, and sent its demo to, a port nothing listened on."""
    from ray.serve.context import _get_global_client

    config = _get_global_client().http_config
    if (config.host, config.port) != (host, port):
        print(f"Serve already runs on this cluster with its HTTP proxy on {config.host}:{config.port}, which it keeps "
              f"(--host/--port {host}:{port} apply when Serve starts; `serve shutdown` first to change them)",
              flush=True)
    return config.host, config.port


def service_url(host: str, port: int, address: str | None) -> str:
    """The URL of the service: on this machine for a local Ray (a wildcard host too), at the head's address for
    a remote cluster whose proxy accepts other machines. A remote proxy on a loopback host answers on the head
    alone (or through a port-forward): said, with the fix, rather than printing a URL that reaches nothing."""
    head, wildcard = remote_head(address), host in ("0.0.0.0", "::")
    if head is not None and not wildcard:
        print(f"note: Serve's proxy listens on {host} of the cluster at {address}: reach it from the head node or "
              f"through a port-forward; pass --host 0.0.0.0 to accept other machines", flush=True)
    shown = (head or "127.0.0.1") if wildcard else host
    return f"http://{f'[{shown}]' if ':' in shown else shown}:{port}"


def remote_head(address: str | None) -> str | None:
    """The head's host of a cluster on another machine (``ray://host:port`` or ``host:port``); None for a Ray on
    this machine (no address, ``local``, ``auto``, or a loopback host)."""
    if address in (None, "local", "auto"):
        return None
    rest = address.removeprefix("ray://")
    host = rest[1 : rest.index("]")] if rest.startswith("[") else rest.rsplit(":", 1)[0] if ":" in rest else rest
    return None if host in ("localhost", "127.0.0.1", "::1") else host


DEMO_ORDER = ("tree", "target alone", "target alone", "tree")  # ABBA: a drift of the host's speed hits both


def demo_headers(cfg: ServeConfig) -> dict[str, str]:
    """The demo's ``Authorization``: the service's key (``api_key``, or ``api_key_env`` as set here); the demo's
    requests got a 401 from a service with a key."""
    key = cfg.api_key or (os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else "")
    return {"authorization": f"Bearer {key}"} if key else {}


def demo(url: str, model: str, max_tokens: int = 96, *, headers: dict | None = None, post=None,
         clock=time.perf_counter) -> dict:
    """The demo request with tree speculation and with the target alone, twice each in the order ``DEMO_ORDER``;
    prints the answer and each arm's tokens/s over its two runs, and their ratio. One run each, back to back,
    measured what the host was doing then: on the 2-core Xeon the target alone's run gave 0.91, 2.54, 2.64 and
    4.78 tokens/s in four main jobs (demo speedups 5.22x to 1.70x), and 3.6-5.3 in four runs against one
    service. ``post(url, json)`` -> the response's JSON (tests pass a fake one)."""
    if post is None:
        import requests

        def post(url: str, json: dict) -> dict:
            r = requests.post(url, json=json, headers=headers, timeout=600)
            r.raise_for_status()
            return r.json()

    body = {"model": model, "messages": [{"role": "user", "content": DEMO_PROMPT}], "max_tokens": max_tokens,
            "temperature": 0}
    endpoint = f"{url}/v1/chat/completions"
    post(endpoint, {**body, "max_tokens": 4})  # warm-up
    runs: dict[str, list[dict]] = {name: [] for name in DEMO_ORDER}
    for name in DEMO_ORDER:
        start_t = clock()
        out = post(endpoint, {**body, **({"speculative": False} if name == "target alone" else {})})
        runs[name].append({"seconds": clock() - start_t, "tokens": out["usage"]["completion_tokens"],
                           "text": out["choices"][0]["message"]["content"],
                           "stats": out["usage"].get("speculative", {})})
    print("=" * 78 + f"\n{runs['tree'][0]['text']}\n" + "=" * 78)
    rates = {}
    for name, done in runs.items():
        tokens, seconds = sum(r["tokens"] for r in done), sum(r["seconds"] for r in done)
        rates[name] = tokens / seconds
        per_step = sum(r["stats"].get("tokens_per_step", 0) for r in done) / len(done)
        counts, times = (" + ".join(f"{r[k]:{f}}" for r in done) for k, f in (("tokens", "d"), ("seconds", ".1f")))
        print(f"{name:13s}: {counts} tokens in {times} s = {rates[name]:.2f} tok/s, {per_step:.2f} tokens/step")
    same = len({r["text"] for done in runs.values() for r in done}) == 1
    print(f"speedup of Sequoia tree speculation over the target alone: {rates['tree'] / rates['target alone']:.2f}x "
          f"(runs in the order {', '.join(DEMO_ORDER)}; same greedy text: {same})")
    return {"runs": runs, "speedup": rates["tree"] / rates["target alone"], "same_text": same}


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="sequoia-ray serve", description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="a Serve config YAML (first application)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override an app arg")
    p.add_argument("--port", type=port_number,
                   help=f"the port of Serve's HTTP proxy (default: the config's http_options, else {DEFAULT_PORT})")
    p.add_argument("--address", default=None, help="an existing Ray cluster (default: start local Ray)")
    p.add_argument("--host", help="the interface Serve's HTTP proxy listens on (0.0.0.0: other machines too; "
                                  f"default: the config's http_options, else {DEFAULT_HOST})")
    p.add_argument("--replace", action="store_true",
                   help=f"with --address: replace the cluster's running {APP_NAME!r} app (default: refuse)")
    p.add_argument("--demo", action="store_true", help="send a demo request and print answer and speedup")
    p.add_argument("--exit", action="store_true", help="stop after starting (and the demo)")
    p.add_argument("--profile-seconds", type=nonneg_float, default=PROFILE_SECONDS,
                   help="time budget for profiling this machine when the plan store has no plan for it (seconds "
                        f"after the models load; default {PROFILE_SECONDS:g})")
    p.add_argument("--no-profile", action="store_true", help="never profile: serve stored or built-in plans")
    p.add_argument("--ray-default-timers", action="store_true",
                   help="start local Ray with its own idle timers (default: slowed, actors/quiet_ray.py)")
    opts = p.parse_args(argv)
    args = app_args(opts.config, opts.set)
    host, port = http_options(opts.config)
    host, port = opts.host or host, opts.port or port  # the command line over the config file
    cfg = ServeConfig.model_validate(args)  # fail fast, before Ray starts
    check_api_key_env(cfg, opts.address)
    if opts.address in (None, "local") and (why := cannot_listen(host, port)):  # a new local Ray: its proxy binds here
        p.error(why)
    if opts.address in (None, "local"):  # the actors load the models on this machine: a missing path said now
        check_sources(cfg)
    if {cfg.draft, cfg.target} & {loading.DEFAULT_DRAFT, loading.DEFAULT_TARGET}:  # not any "default…" path
        from sequoia_ray.models.fetch import DEFAULT_DRAFT, DEFAULT_TARGET, fetch_default_pair, is_fetched

        if not (is_fetched(DEFAULT_DRAFT) and is_fetched(DEFAULT_TARGET)):  # said only when it takes minutes
            print("fetching the default model pair (first run: ~3 minutes, then cached) ...", flush=True)
        fetch_default_pair()
    # first: the profile measures the actor calls a served step makes
    init_ray(opts.address, quiet=not opts.ray_default_timers)
    replacing = running_app(opts.address)
    if replacing and not opts.replace:
        p.error(f"the cluster at {opts.address} already serves an app {APP_NAME!r}: starting would replace it and cut "
                f"off its clients; pass --replace to do so, or `serve shutdown` / `serve delete` it first")
    ensure_plans(cfg, None if opts.no_profile else opts.profile_seconds, address=opts.address)
    print("starting Ray Serve ...", flush=True)
    try:
        url = start(args, port, opts.address, host=host)
        print(f"serving {cfg.model_name} at {url}/v1 (OpenAI API)", flush=True)
    except NotDeployed as exc:  # nothing to stop: before, `--replace` deleted the app it had not replaced
        interrupted = isinstance(exc.__cause__, KeyboardInterrupt)
        going_on = f" (the cluster's running {APP_NAME!r} app goes on)" if replacing else ""
        print(f"sequoia-ray serve: error: {'interrupted' if interrupted else exc}; nothing was deployed{going_on}",
              file=sys.stderr, flush=True)
        return 130 if interrupted else 1
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - what started is stopped, then one line
        return failed_start(exc, opts.address)
    demo_failed = False
    if opts.demo:
        try:
            demo(url, cfg.model_name, headers=demo_headers(cfg))
        except KeyboardInterrupt as exc:
            return failed_start(exc, opts.address)
        except Exception as exc:  # noqa: BLE001 - the service deployed: it goes on (it was deleted, on a cluster too)
            demo_failed = True
            print(f"sequoia-ray serve: the demo failed: {_one_line(exc)}"
                  + ("" if opts.exit else "; the service goes on"), file=sys.stderr, flush=True)
    if opts.exit:
        stop(opts.address)
        return 1 if demo_failed else 0
    print(f"try: curl {url}/v1/completions -H 'content-type: application/json' "
          f"-d '{json.dumps({'model': cfg.model_name, 'prompt': 'def add(a, b):', 'max_tokens': 32})}'")
    print("Ctrl-C stops the service.")
    return serve_until_stopped(opts.address, cfg.drain_timeout_s)


def check_sources(cfg: ServeConfig) -> None:
    """A draft or target path that does not exist (or is no checkpoint), before Ray starts: it failed the deploy
    minutes later, in the replicas."""
    for source in filter(None, (cfg.draft, cfg.target)):
        loading.check_source(source)


def failed_start(exc: BaseException, address: str | None) -> int:
    """A deploy that failed, or a deploy or demo interrupted (Ctrl-C while the models load): the app it started is
    deleted (else a failed one stayed on the cluster, holding its GPUs, and the next run was refused without
    --replace), and one line says why (Serve's error, its first line; before: a traceback). Exit 130 for Ctrl-C,
    else 1."""
    interrupted = isinstance(exc, KeyboardInterrupt)
    why = "interrupted" if interrupted else _one_line(exc)
    print(f"sequoia-ray serve: error: {why}; stopping what this command started (the replicas' logs: "
          f"/tmp/ray/session_latest/logs/serve on their nodes)", file=sys.stderr, flush=True)
    try:
        stop(address)
    except Exception as again:  # noqa: BLE001 - said; the first failure is the one that matters
        print(f"sequoia-ray serve: could not stop it: {type(again).__name__}: {again}", file=sys.stderr, flush=True)
    return 130 if interrupted else 1


def _one_line(exc: BaseException) -> str:
    """An error's type and first line (Serve's deploy error goes on with the replica's traceback)."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:400]}"


def stop(address: str | None) -> None:
    """Stop what this command started, its replicas draining (each waits for the requests it holds, up to its
    graceful_shutdown_timeout_s: ``drain_timeout_s``): the app (a cluster's other Serve apps go on), then a local
    Ray's Serve. ``serve.shutdown`` alone killed the HTTP proxy first: every stream in flight was cut."""
    from ray import serve

    serve.delete(APP_NAME)  # first: the HTTP proxy stays up while the app's replicas drain (shutdown kills it)
    if address in (None, "local"):
        serve.shutdown()


class _Stop(KeyboardInterrupt):
    """SIGTERM (Kubernetes, systemd, `kill`), taken as Ctrl-C."""


def _on_sigterm(signum, frame) -> None:
    raise _Stop


def serve_until_stopped(address: str | None, drain_s: float, wait=time.sleep) -> int:
    """Serve until Ctrl-C or SIGTERM, then stop draining: requests in flight finish first. Before, either ended the
    process at once (every stream cut; SIGTERM an exit 15 with Ray's stack dump). A second Ctrl-C stops without
    waiting (exit 130). ``wait(seconds)``: tests pass their own."""
    import signal

    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    # Ctrl-C too: a launcher started in the background by a script inherits SIGINT ignored (a shell's `&`, nohup)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        try:
            while True:
                wait(3600)
        except KeyboardInterrupt as why:
            print(f"{'SIGTERM' if isinstance(why, _Stop) else 'Ctrl-C'}: stopping; requests in flight finish first "
                  f"(up to drain_timeout_s = {drain_s:g} s; Ctrl-C again to stop now) ...", flush=True)
        try:
            stop(address)
        except KeyboardInterrupt:
            print("stopped without waiting for the requests in flight", flush=True)
            return 130
        print("stopped", flush=True)
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
