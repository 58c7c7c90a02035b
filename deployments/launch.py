"""Start the service on local Ray (or a cluster), optionally send a demo request, keep serving.

    sequoia-ray serve [--config deployments/config.yaml] [--port 8000] [--demo] [--exit] [--set key=value ...]

``--demo`` sends a real chat request twice (tree speculation, then the target alone, via the
``speculative: false`` request extension) and prints the answer and the speedup. ``--exit`` stops the
service afterwards; otherwise it keeps serving until Ctrl-C, printing the URL to call.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from deployments.config import ServeConfig
from sequoia_ray.arguments import Parser

DEFAULT_CONFIG = Path(__file__).resolve().parent / "config.yaml"
DEMO_PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring."


def app_args(config: Path, overrides: list[str]) -> dict:
    spec = yaml.safe_load(config.read_text())
    args = dict(spec["applications"][0].get("args", {}))
    for item in overrides:
        key, _, value = item.partition("=")
        args[key] = yaml.safe_load(value)
    store = args.get("plan_store")
    if store and "://" not in store:  # actors do not share the launcher's working directory
        args["plan_store"] = str(Path(store).expanduser().resolve())
    return args


def start(args: dict, port: int, address: str | None):
    import ray
    from ray import serve

    from deployments.app import build_app

    if address:
        ray.init(address=address)
    else:
        ray.init(include_dashboard=False)  # the machine's real CPUs: what `serve run` gets too
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name="sequoia", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def demo(url: str, model: str, max_tokens: int = 96) -> dict:
    import requests

    body = {"model": model, "messages": [{"role": "user", "content": DEMO_PROMPT}], "max_tokens": max_tokens,
            "temperature": 0}
    requests.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 4}, timeout=600).raise_for_status()
    runs = {}
    for name, extra in (("tree", {}), ("target alone", {"speculative": False})):
        start_t = time.perf_counter()
        r = requests.post(f"{url}/v1/chat/completions", json={**body, **extra}, timeout=600)
        r.raise_for_status()
        out = r.json()
        runs[name] = {"seconds": time.perf_counter() - start_t, "tokens": out["usage"]["completion_tokens"],
                      "text": out["choices"][0]["message"]["content"], "stats": out["usage"].get("speculative", {})}
    tree, alone = runs["tree"], runs["target alone"]
    print("=" * 78 + f"\n{tree['text']}\n" + "=" * 78)
    for name, run in runs.items():
        st = run["stats"]
        print(f"{name:13s}: {run['tokens']} tokens in {run['seconds']:.1f}s = {run['tokens'] / run['seconds']:.2f} tok/s"
              f", {st.get('tokens_per_step', 0):.2f} tokens/step")
    speedup = (tree["tokens"] / tree["seconds"]) / (alone["tokens"] / alone["seconds"])
    print(f"speedup of Sequoia tree speculation over the target alone: {speedup:.2f}x "
          f"(same greedy text: {tree['text'] == alone['text']})")
    return runs


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="sequoia-ray serve", description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="a Serve config YAML (first application)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override an app arg")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--address", default=None, help="an existing Ray cluster (default: start local Ray)")
    p.add_argument("--demo", action="store_true", help="send a demo request and print answer and speedup")
    p.add_argument("--exit", action="store_true", help="stop after starting (and the demo)")
    opts = p.parse_args(argv)
    args = app_args(opts.config, opts.set)
    cfg = ServeConfig.model_validate(args)  # fail fast, before Ray starts
    if str(cfg.draft or "").startswith("default") or cfg.target.startswith("default"):
        from sequoia_ray.models.fetch import fetch_default_pair

        print("fetching the default model pair (first run: ~3 minutes, then cached) ...", flush=True)
        fetch_default_pair()
    print("starting Ray Serve ...", flush=True)
    url = start(args, opts.port, opts.address)
    print(f"serving {cfg.model_name} at {url}/v1 (OpenAI API)", flush=True)
    if opts.demo:
        demo(url, cfg.model_name)
    if opts.exit:
        from ray import serve

        serve.shutdown()
        return 0
    print(f"try: curl {url}/v1/completions -H 'content-type: application/json' "
          f"-d '{json.dumps({'model': cfg.model_name, 'prompt': 'def add(a, b):', 'max_tokens': 32})}'")
    print("Ctrl-C stops the service.")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
