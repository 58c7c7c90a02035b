"""The OpenAI-compatible HTTP ingress (FastAPI) and the Python handle API of the service.

Routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (``stream: true`` =
server-sent events ending with ``data: [DONE]``). Other Ray apps call ``generate(request)`` (whole result)
or ``generate_stream(request)`` (``handle.options(stream=True)``) with the same request models as HTTP.
"""


import asyncio
import hmac
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError
from pydantic import ValidationError
from ray import serve
from ray.exceptions import TaskCancelledError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from actors.adapters import ActorDraft, RanksTarget, RequestForgotten, TargetUnavailable
from deployments import openai_api as api
from deployments.autoscaling import HELD
from deployments.config import ServeConfig
from deployments.metrics import GAUGE_REFRESH_S, ServiceMetrics
from deployments.prompt_batch import all_or_none, merged
from deployments.service import GrowRules, LivePlanner, PlanProvider, Runner, TreeFamilies
from deployments.slots import Slots, Ticket
from sequoia_ray.config import SamplingParams
from sequoia_ray.engine import PromptError, SpeculativeDecoder, Stats
from sequoia_ray.hardware import batch_bucket
from sequoia_ray.in_flight import InFlight
from sequoia_ray.live_cost import CostSettings, StepRates
from sequoia_ray.local import encode, pair_refusal as local_pair_refusal
from sequoia_ray.stopping import token_bytes

logger = logging.getLogger("sequoia_ray.serve")
app = FastAPI(title="sequoia-ray", description="Sequoia tree speculative decoding, OpenAI-compatible.")


def _openapi() -> dict:
    if app.openapi_schema is None:
        app.openapi_schema = api.openapi_schema(get_openapi(title=app.title, version="1", description=app.description,
                                                            routes=app.routes))
    return app.openapi_schema


app.openapi = _openapi


@app.exception_handler(api.APIError)
async def _api_error(_: Request, exc: api.APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@app.exception_handler(RequestValidationError)
async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    err = api.validation_error(exc)
    return JSONResponse(err.body(), status_code=err.status)


OPENAI_ROUTES = ("/completions", "/chat/completions", "/models")  # served under /v1


@app.exception_handler(StarletteHTTPException)
async def _http(request: Request | None, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = str(exc.detail)
    path = request.url.path if request is not None else ""
    wrong_v1 = "/v1/" not in path or "/v1/v1/" in path  # none, or a client adding it to a base URL that has it
    if exc.status_code == 404 and wrong_v1 and path.rstrip("/").endswith(OPENAI_ROUTES):
        message += (f": {path} has no /v1 (or two); the routes are /v1/completions, /v1/chat/completions and "
                    "/v1/models (a client's base URL ends in /v1)")
    return JSONResponse(api.APIError(exc.status_code, message, type=kind).body(), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))  # a 405's Allow


def event_stream(events, ended) -> StreamingResponse:
    """Server-sent events, never cached nor buffered on the way (nginx's ingress holds a response it may buffer,
    and the tokens then arrived in bursts)."""
    return _EventStream(events, ended)


class _EventStream(StreamingResponse):
    """``ended(status)`` once: when the stream ends (``_sse``), or, when its body never started — the client gone
    before the response's first byte (Starlette then never iterates it: ``send`` of the response's start failed,
    or the disconnect came first) — a 499 when the response is over. Such a request went uncounted. When the
    response is over, however it ended, the body and ``events`` are closed (``_Started``: a generation begun
    before the response went on for nobody, its slots taken until a garbage collection)."""

    def __init__(self, events, ended) -> None:
        self.told, self.events = False, events

        def once(status: str) -> None:
            if not self.told:
                self.told = True
                ended(status)

        self.once = once
        super().__init__(_sse(events, once), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.once(CLIENT_GONE)  # nothing if the stream has told its end
            await asyncio.shield(_closed(self.body_iterator, self.events))  # nothing for streams that ran out


async def _closed(*streams) -> None:
    """Each of ``streams`` closed (``aclose``), in order, whatever the others' closes raise."""
    for stream in streams:
        try:
            await stream.aclose()
        except Exception:  # noqa: BLE001 - a stream's own failure was told by its end; the next still closes
            logger.debug("closing a stream failed", exc_info=True)


class _Started:
    """A stream's events (``events``, an async generator) over a generation already started (``started``: its
    first chunk awaited, its choices' slots taken). ``aclose`` closes both: an async generator closed before its
    first step skips its ``finally``, so closing the events alone, or dropping them unread (Starlette does not
    iterate the body of a response whose client left before its first byte, nor close one a failed send
    stopped), left the generation running until a garbage collection found the cycle holding it (an exception's
    traceback): with ``n`` 2, both choices generated every token for nobody."""

    def __init__(self, events: AsyncIterator[dict], started: AsyncIterator) -> None:
        self.events, self.started = events, started

    def __aiter__(self) -> AsyncIterator[dict]:
        return self.events

    async def aclose(self) -> None:
        await _closed(self.events, self.started)


# A client that went away: Serve cancels its request's task (a Ray call awaited then raises TaskCancelledError),
# or the body stops mid-read. Nobody reads the answer, nothing failed: no traceback at ERROR, status 499 (nginx's
# "client closed request") in the request counts.
GONE = (TaskCancelledError, ClientDisconnect)  # and asyncio.CancelledError (no Exception: it passes through)
CLIENT_GONE = "499"


@app.exception_handler(Exception)
async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, GONE):
        logger.debug("request ended: the client went away (%s)", type(exc).__name__)
        return JSONResponse(api.APIError(int(CLIENT_GONE), "the client went away").body(), status_code=int(CLIENT_GONE))
    logger.exception("unexpected error")
    return JSONResponse(api.APIError(500, "internal error; see the server log", type="server_error").body(),
                        status_code=500)


class _ToServe(logging.Handler):
    """Hands a record to the handlers "ray.serve" has when it is emitted (Serve may configure them again: a
    deployment's new logging_config replaces them)."""

    def emit(self, record: logging.LogRecord) -> None:
        for handler in logging.getLogger("ray.serve").handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def log_where_serve_does() -> None:
    """In a replica: the service's log lines (``sequoia_ray.*``: plans chosen, store faults, failed requests) go
    where Serve's own go, at its level: the replica's log file and stderr, with time, replica and request id.
    Without a handler of their own INFO lines were dropped and warnings printed bare by Python's last resort.
    Idempotent (a replica may be built again in its process)."""
    ours, serves = logging.getLogger("sequoia_ray"), logging.getLogger("ray.serve")
    if not serves.handlers:
        return  # not in a replica (Serve configures its logger there)
    if not any(isinstance(h, _ToServe) for h in ours.handlers):
        ours.addHandler(_ToServe())
    ours.setLevel(serves.level or logging.INFO)
    ours.propagate = False  # Serve's handlers only: a root handler would print each line twice


def _unavailable(what: str) -> api.APIError:
    return api.APIError(503, f"{what}; retry the request", type="server_error", code="target_unavailable",
                        retry_after_s=5)


async def _parse(request: Request, model, max_bytes: int):
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise api.APIError(413, f"request body of {declared} bytes exceeds the limit of {max_bytes}",
                           code="request_too_large")
    raw = bytearray()
    async for part in request.stream():  # a chunked body declares no length: stop reading at the limit
        raw += part
        if len(raw) > max_bytes:
            raise api.APIError(413, f"request body exceeds the limit of {max_bytes} bytes", code="request_too_large")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        raise api.APIError(400, "the request body is not valid JSON", code="invalid_json") from None
    except RecursionError:  # arrays or objects nested thousands deep: no field of ours nests beyond a few levels
        raise api.APIError(400, "the request body nests too deeply", code="invalid_json") from None
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise api.validation_error(exc) from None


def _fit_context(prompt: list[int], params: SamplingParams, context: int | None, req,
                 which: str | None = None) -> SamplingParams:
    """``params`` whose length fits the model's context: a default length (the client sent none) is cut to what
    the context holds after the prompt, as OpenAI's and vLLM's are; a length the client sent that does not fit,
    or a prompt that leaves no room, is a 400 naming the field to change (``which``: the prompt's name in a
    batch, "prompt 2 of the batch")."""
    if context is None or len(prompt) + params.max_tokens <= context:
        return params
    field, room = req.prompt_param, context - len(prompt)
    name = which or field
    if not req.length_sent and room > 0:
        return params.model_copy(update={"max_tokens": room})
    if req.length_sent and room > 0:
        message = (f"{name} of {len(prompt)} tokens + {req.length_param} {params.max_tokens} exceeds the model's "
                   f"context of {context} tokens; shorten the {name} or lower {req.length_param}")
        raise api.APIError(400, message, param=req.length_param, code="context_length_exceeded")
    # the prompt alone fills the context: no length helps (it said to lower one already at its least, 1)
    message = (f"{name} of {len(prompt)} tokens leaves no room in the model's context of {context} tokens; "
               f"shorten the {name}")
    raise api.APIError(400, message, param=field, code="context_length_exceeded")


def _logprob_entries(chunk) -> list[tuple[int, float, tuple]]:
    """A chunk's (token id, log-probability, likeliest) per token; none when the request asked for none."""
    return [(i, lp, likely) for i, (lp, likely) in zip(chunk.token_ids, chunk.logprobs or ())]


def _prompt_name(field: str, index: int, prompts: list) -> str:
    """How errors name prompt ``index`` of a request's ``prompts``: "prompt", or "prompt 2 of the batch"."""
    return field if len(prompts) == 1 else f"{field} {index} of the batch"


def _no_model(asked: str, served: str) -> api.APIError:
    return api.APIError(404, f"model {asked!r} does not exist; this server serves {served!r}", type="not_found_error",
                        param="model", code="model_not_found")


def pair_refusal(target: dict, draft: dict) -> str | None:
    """Why a draft model (its actor's ``info``) cannot speculate for a target (rank 0's), or None."""
    digests = (draft.get("tokenizer"), target.get("tokenizer"))
    same = None if None in digests else digests[0] == digests[1]  # None: an actor without a tokenizer
    return local_pair_refusal(target.get("vocab"), draft.get("vocab"), same)


def api_key_header(cfg: ServeConfig) -> bytes | None:
    """The ``Authorization`` header every request must send, or None when the API is open (no key configured).
    A key to be read from an environment variable that is unset or empty here is an error, not an open API."""
    key = cfg.api_key
    if key is None and cfg.api_key_env:
        key = os.environ.get(cfg.api_key_env, "")
        if not key:
            raise ValueError(f"api_key_env {cfg.api_key_env!r}: that environment variable is unset or empty in this "
                             "ingress replica; set it in the replica's environment (runtime_env env_vars, or the "
                             "pod's env), or give api_key, or drop api_key_env for an open API")
    return f"Bearer {key}".encode() if key else None


def _as_request(request):
    if isinstance(request, (api.CompletionRequest, api.ChatCompletionRequest)):
        return request, isinstance(request, api.ChatCompletionRequest)
    chat = isinstance(request, dict) and "messages" in request
    model = api.ChatCompletionRequest if chat else api.CompletionRequest
    try:
        return model.model_validate(request), chat
    except ValidationError as exc:
        raise api.validation_error(exc) from None


class _Outcome:
    """A request's status for ``sequoia_requests``, from how the block around it ended: "200", an APIError's
    status, 499 when its caller went away (a cancel, a disconnect, a stream closed before its end), 500 for any
    other exception; ``count(status)`` on the way out, unless ``status`` was set to None (counted elsewhere)."""

    def __init__(self, count: Callable[[str], None]) -> None:
        self.count, self.status = count, "200"

    def __enter__(self) -> "_Outcome":
        return self

    def __exit__(self, kind, exc, traceback) -> bool:
        if kind is not None:
            self.status = (str(exc.status) if isinstance(exc, api.APIError)
                           else CLIENT_GONE if issubclass(kind, (asyncio.CancelledError, GeneratorExit, *GONE))
                           else "500")
        if self.status is not None:
            self.count(self.status)
        return False


async def _first(chunks):
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None


async def _prepend(first, chunks):
    if first is not None:
        yield first
        async for chunk in chunks:
            yield chunk


async def _sse(events: AsyncIterator[dict], ended=lambda status: None):
    """``events`` as server-sent events; ``ended(status)`` once the stream is over: "200" when it ran to its end,
    an error event's status, or "499" when the client went away (the response started as a 200 whatever follows:
    counting it there hid every stream that failed or was cut off)."""
    status = CLIENT_GONE  # unless it ends: the stream was closed or cancelled under it
    try:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
            status = "200"
        except api.APIError as exc:
            status = str(exc.status)
            yield f"data: {json.dumps(exc.body())}\n\n"
        except GONE:  # (a cancelled task's CancelledError goes on up, counted 499 below)
            logger.debug("stream ended: the client went away")
            return
        except Exception:  # noqa: BLE001 - a stream must end with an error event, never a stack trace
            status = "503"
            logger.exception("stream failed")
            yield f"data: {json.dumps(api.APIError(503, 'generation failed; retry', type='server_error').body())}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        ended(status)


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class OpenAIIngress:
    HEALTH_WAIT_S = 2.0  # /health's wait for the target's first answer before it says "loading"
    MAX_CHOICES = 256  # a request's prompts x n at most (OpenAI's n goes to 128; LangChain batches 20 prompts)
    FREE_WAIT_S = 30.0  # a stopping replica's wait for the requests still being freed (a step, then a finish)

    def __init__(self, config: dict, draft, target) -> None:
        from sequoia_ray.models.loading import load_tokenizer

        log_where_serve_does()
        self.cfg = ServeConfig.model_validate(config)
        self.draft_deployment, self.target_deployment = draft, target
        self.tokenizer = load_tokenizer(self.cfg.target, progress=False)
        self.runner = Runner(self.cfg.max_concurrent)
        # requests in flight; the batch a step plans for (no more than a forward carries)
        self.in_flight = InFlight(self.cfg.batch_hold_s, cap=self.cfg.max_batch_requests)
        self.slots = Slots(self.in_flight, self.cfg.max_concurrent)  # taken at once, or by a batch's choices in turn
        self.plans: PlanProvider | None = None
        self.live: LivePlanner | None = None  # acceptance learnt from live traffic (cfg.live_acceptance)
        self.families: TreeFamilies | None = None  # a tree per request (cfg.request_trees)
        self.rules: GrowRules | None = None  # trees that adapt inside a request (cfg.dynamic_trees)
        self.rates = StepRates(CostSettings(self.cfg.live_cost_probe_every, self.cfg.live_cost_probe_rounds,
                                            backoff=self.cfg.live_cost_backoff, wide=self.cfg.live_cost_wide,
                                            max_age_s=self.cfg.live_cost_max_age_s,
                                            settle_rounds=self.cfg.live_cost_settle_rounds)
                               ) if self.cfg.live_cost else None  # the tree or the target alone, measured
        self.metrics = ServiceMetrics()
        self.pairs: dict[str, str | None] = {}  # draft actor id -> why it cannot serve this target (None: it can)
        self.draft_contexts: dict[str, int | None] = {}  # draft actor id -> the positions its model reads
        self.background: list[asyncio.Task] = []  # the plan refresh and live re-plan loops; ``__del__`` ends them
        self.warming: asyncio.Task | None = None  # /health's look for the target, until it has answered
        self.setting_up: asyncio.Future | None = None  # the plans' set-up (``_plans``), shared by the first requests
        self.expected_auth = api_key_header(self.cfg)
        self.created = int(time.time())  # /v1/models' "created" (OpenAI's Model requires it): when this replica began

    @property
    def active(self) -> int:
        """Requests in flight on this replica now (a batch's or ``n``'s choices each count)."""
        return self.in_flight.count

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """What the ingress scales on (``deployments.autoscaling``): the generations in flight, not Serve's count of
        calls, one of which may run a batch of them."""
        return {HELD: float(self.active)}

    # ---- HTTP -----------------------------------------------------------------------------------
    @app.get("/health", responses={503: {"description": "the target model is not loaded yet (status: loading)"}})
    async def health(self):
        """Ready (200, ``ok``) once the target has answered: its model is loaded. Until then 503, ``loading``
        (a readiness probe sent traffic 7 s before the models were up), while one background call finds out,
        waited for up to ``HEALTH_WAIT_S`` (a loaded target answers in milliseconds)."""
        if not await self._warmed():
            failed, error = self._warm_failure()
            body = {"status": "failed" if failed else "loading", "active_requests": self.active}
            return JSONResponse(body if error is None else {**body, "error": error}, status_code=503)
        return {"status": "ok", "active_requests": self.active}

    async def _warmed(self) -> bool:
        """Whether the target has answered (its plans are set up), waiting up to ``HEALTH_WAIT_S`` on the one
        background call that finds out (started here if none runs; never cancelled by a caller's timeout)."""
        if self.plans is None:
            if self.warming is None or self.warming.done():
                self._note_warming()
                self.warming = asyncio.get_running_loop().create_task(self._plans())
                self.warming.add_done_callback(lambda task: task.cancelled() or task.exception())  # retrieved
            await asyncio.wait([self.warming], timeout=self.HEALTH_WAIT_S)  # never cancels it
            self._note_warming()
        return self.plans is not None

    def _note_warming(self) -> None:
        """Keep the error of a look that ended failing (``_warm_failure``): the next look may still be running."""
        task = self.warming
        if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
            self.warm_error = task.exception()

    def _warm_failure(self) -> tuple[bool, str | None]:
        """Why the plans are not set up: (failed for good, the last look's error). No target replica ready within
        ``step_timeout_s`` is still loading (a model may load for minutes); any other error is a failure (the
        plan store unreadable, ...) that a client is told of rather than "loading" for ever."""
        error = getattr(self, "warm_error", None)
        if error is None:
            return False, None
        if isinstance(error, api.APIError):
            return error.code != "target_unavailable", error.message
        return True, f"{type(error).__name__}: {error}"

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict:
        """The served model, with the plans and live estimates in ``metadata``; while the target still loads,
        its entry at once with ``metadata.status`` "loading" (it waited up to ``step_timeout_s``, 60 s, and then
        answered 503: a UI or gateway polling /v1/models with a short timeout saw the server down)."""
        self._authorize(request)
        if not await self._warmed():
            failed, error = self._warm_failure()
            if failed:
                raise api.APIError(503, f"the service could not set up its plans: {error}", type="server_error",
                                   code="not_ready")
            meta = {"status": "loading"} if error is None else {"status": "loading", "last_error": error}
            return {"object": "list", "data": [{**self._model_entry(self.cfg.model_name), "metadata": meta}]}
        plans = self.plans
        active = await asyncio.to_thread(plans.get, 0.0, self.in_flight.batch())
        meta = {"hardware_id": plans.hardware, "plan_source": active.source, "plan_nodes": active.planned.plan.n,
                "plan_levels": active.planned.plan.num_levels, "draft": self.cfg.draft, "target": self.cfg.target,
                "tp_size": self.cfg.tp_size, "plans": plans.sources(),
                "plan_store_errors": plans.errors, "plan_store_last_error": plans.last_error,
                "plans_measured_otherwise": plans.measured_otherwise(),
                "live_acceptance": self.live.summary() if self.live else None,
                "step_rates": self.rates.summary() if self.rates else None,
                "dynamic_trees": self.rules.summary() if self.rules else None}
        return {"object": "list", "data": [{**self._model_entry(self.cfg.model_name), "metadata": meta}]}

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> dict:
        """OpenAI's "retrieve model": the served model (a model id may hold "/"), else a 404."""
        self._authorize(request)
        if model_id != self.cfg.model_name:
            raise _no_model(model_id, self.cfg.model_name)
        return self._model_entry(model_id)

    def _model_entry(self, model_id: str) -> dict:
        return {"id": model_id, "object": "model", "created": self.created, "owned_by": "sequoia-ray"}

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._counted("completions", request, api.CompletionRequest, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._counted("chat", request, api.ChatCompletionRequest, chat=True)

    async def _counted(self, route: str, request: Request, model, chat: bool):
        """A request, counted by route and status once it is over (a stream when its last event is sent)."""
        count, received = self._counter(route), time.perf_counter()
        with _Outcome(count) as outcome:
            self._authorize(request)
            response = await self._serve(await _parse(request, model, self.cfg.max_body_bytes), chat=chat,
                                         ended=count, received=received)
            if isinstance(response, StreamingResponse):
                outcome.status = None  # counted when it ends (``_sse``)
            return response

    def _counter(self, route: str) -> Callable[[str], None]:
        return lambda status: self.metrics.requests.inc(tags={"route": route, "status": status})

    def _authorize(self, request: Request) -> None:
        if self.expected_auth is None:
            return
        scheme, _, credentials = request.headers.get("authorization", "").strip().partition(" ")
        given = f"Bearer {credentials.strip()}" if scheme.lower() == "bearer" else scheme  # the scheme: any case
        if not hmac.compare_digest(given.encode(), self.expected_auth):  # constant time
            raise api.APIError(401, "missing or invalid API key; send 'Authorization: Bearer <key>'",
                               type="authentication_error", code="invalid_api_key")

    # ---- Python handle API ------------------------------------------------------------------------
    async def generate(self, request: dict | api.CompletionRequest | api.ChatCompletionRequest) -> dict:
        """A completion, as /v1/…/completions answers it; counted in ``sequoia_requests`` (route
        ``handle_generate``) as HTTP requests are."""
        received = time.perf_counter()
        with _Outcome(self._counter("handle_generate")):
            req, chat = _as_request(request)
            return await self._complete(req, *await self._prepared(req, chat), chat, received)

    async def _complete(self, req, prompts: list[list[int]], params: SamplingParams, chat: bool,
                        received: float | None = None) -> dict:
        rid = api.completion_id(req.id_kind)
        choices = self._choices(req, prompts, params, rid)
        tickets = self._admit(len(choices))

        async def one(prompt: list[int], choice_params: SamplingParams, choice_id: str, which: str | None, ticket):
            text, ids, last, entries = [], 0, None, []
            async for chunk in self._chunks(prompt, choice_params, choice_id, req, chat, received, which, ticket):
                text.append(chunk.text)
                ids += len(chunk.token_ids)
                entries += _logprob_entries(chunk)
                last = chunk
            logprobs = None
            if req.logprob_count is not None:  # off the event loop: thousands of tokens' texts, each with up to 20
                logprobs = await asyncio.to_thread(self._logprobs, entries, chat)  # alternatives
            return "".join(text), ids, last, logprobs

        ones = [one(*choice, ticket) for choice, ticket in zip(choices, tickets)]
        try:
            done = [await ones[0]] if len(ones) == 1 else await all_or_none(ones)
        finally:
            self.slots.drop(tickets)
        use = api.usage(sum(map(len, prompts)), sum(ids for _, ids, _, _ in done),
                        Stats.combined([last.stats for _, _, last, _ in done]).to_dict())
        body = api.chat_body if chat else api.completion_body
        return body(rid, self.cfg.model_name, [(text, last.finish_reason, lps) for text, _, last, lps in done], use)

    def _logprobs(self, entries: list, chat: bool, offset: int = 0) -> dict:
        """A choice's ``logprobs`` for ``entries`` (``_logprob_entries``), in the route's form."""
        if chat:
            return api.chat_logprobs(self._token_text, entries, self._token_bytes)
        return api.completion_logprobs(self._token_text, entries, offset)

    def _token_text(self, token_id: int) -> str:
        """A token's text alone, as logprobs show it, decoded once a replica (at most the vocabulary's size: a chat's
        top 20 of 4,096 tokens decoded each time took 0.5 s with the Qwen2.5 tokenizer)."""
        texts = self.__dict__.setdefault("token_texts", {})
        text = texts.get(token_id)
        if text is None:
            text = texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _token_bytes(self, token_id: int) -> bytes | None:
        """The own bytes (``stopping.token_bytes``) of a token whose text alone reads U+FFFD (a piece of a character),
        found once a replica as ``_token_text``; None for any other: its text's bytes are its own (a special token's
        too, which ``token_bytes``, reading text as streamed, finds empty)."""
        found = self.__dict__.setdefault("token_bytes", {})
        if token_id not in found:
            found[token_id] = token_bytes(self.tokenizer, token_id) if "\ufffd" in self._token_text(token_id) else None
        return found[token_id]

    async def generate_stream(self, request: dict | api.CompletionRequest | api.ChatCompletionRequest
                              ) -> AsyncIterator[dict]:
        """The request's stream events, as /v1/…/completions with ``stream: true`` sends them (the request is a
        stream whatever its ``stream`` says: ``stream_options`` were refused without it). A request refused
        (429, a context too long, no target) raises before the first event, as over HTTP: a chat's role event
        went out first."""
        received = time.perf_counter()
        with _Outcome(self._counter("handle_generate_stream")):  # counted when it ends, as an HTTP stream
            if isinstance(request, dict):
                request = {**request, "stream": True}
            req, chat = _as_request(request)
            req = req.model_copy(update={"stream": True})
            stream = await self._stream(req, *await self._prepared(req, chat), chat, received)
            try:
                async for event in stream:
                    yield event
            finally:  # a caller that stops reading: its generation stops now, not at a garbage collection
                await stream.aclose()

    # ---- internals --------------------------------------------------------------------------------
    async def _serve(self, req, chat: bool, ended=lambda status: None, received: float | None = None):
        """The response to ``req``: a completion, or a stream whose end calls ``ended(status)`` (``_sse``).
        ``received``: when the request arrived (``time.perf_counter()``), the start of its time to first token."""
        prompts, params = await self._prepared(req, chat)
        if not req.stream:
            return await self._complete(req, prompts, params, chat, received)
        return event_stream(await self._stream(req, prompts, params, chat, received), ended)

    async def _stream(self, req, prompts: list[list[int]], params: SamplingParams, chat: bool,
                      received: float | None) -> AsyncIterator[dict]:
        """The request's stream events, its first chunk (of every choice that starts now) already generated: errors
        before the first token are raised here, still proper HTTP errors (or, through a handle, before any
        event)."""
        rid = api.completion_id(req.id_kind)
        choices = self._choices(req, prompts, params, rid)
        tickets = self._admit(len(choices))
        start = sum(t is None or t.holds for t in tickets)  # the choices that start now: the stream waits for them
        chunks = merged([self._chunks(*choice, req, chat, received, which, ticket)
                         for (*choice, which), ticket in zip(choices, tickets)], hold=start)
        if len(choices) > 1:
            chunks = self._dropping(tickets, chunks)
        first = await _first(chunks)
        return _Started(self._events(_prepend(first, chunks), req, rid, chat, sum(map(len, prompts)), len(choices)),
                        chunks)

    def _admit(self, choices: int) -> list:
        """A request's choices admitted as a whole, at once (``Slots.admit``): a ticket each, or [None] for a
        request of one choice (it takes its slot in ``_chunks``). A 429 when the replica is full."""
        if choices == 1:
            return [None]
        tickets = self.slots.admit(choices)
        if tickets is None:
            raise self._overloaded()
        return tickets

    async def _dropping(self, tickets: list, stream: AsyncIterator):
        """``stream``, the tickets of the choices that never started given back when it ends, however it ends."""
        try:
            async for item in stream:
                yield item
        finally:
            self.slots.drop(tickets)
            await stream.aclose()  # closed here, not when a collection finds it: the choices it runs stop

    def _overloaded(self) -> api.APIError:
        """Every slot taken (a generation each: a request's, or a choice's of a batch or of ``n``)."""
        n = self.slots.waiting
        waiting = f", {n} choice{'s' * (n != 1)} of batches waiting for one" if n else ""
        return api.APIError(429, f"{self.active} of max_concurrent {self.cfg.max_concurrent} generation slots taken"
                                 f"{waiting}; retry later", type="rate_limit_error", code="overloaded", retry_after_s=1)

    def _choices(self, req, prompts: list[list[int]], params: SamplingParams, rid: str
                 ) -> list[tuple[list[int], SamplingParams, str, str | None]]:
        """What each choice generates, in the order of ``choices``: (prompt, parameters, request id, the prompt's
        name in errors: None for a request of one choice), ``n`` per prompt. Choice j of a prompt is seeded with
        seed + j (vLLM's rule: with one seed the ``n`` sampled choices were the same text). Each has its own request
        id: the actors keep a request's state by its id (under the request's one id a batch's prompts overwrote
        each other's state). Several choices are refused (429) as one request is, when no slot is free; else each
        takes a slot as one frees (``_admit``): a batch larger than the free slots, or than ``max_concurrent``,
        runs through the slots it gets (refused whole before, a batch of LangChain's 20 a 400 at the default 8)."""
        if len(prompts) * req.choices == 1:
            return [(prompts[0], params, rid, None)]
        choices = []
        for i, prompt in enumerate(prompts):
            for j in range(req.choices):
                seeded = (params if j == 0 or params.seed is None
                          else params.model_copy(update={"seed": (params.seed + j) % api.SEED_MODULUS}))
                choices.append((prompt, seeded, f"{rid}-{len(choices)}", _prompt_name(req.prompt_param, i, prompts)))
        return choices

    async def _prepared(self, req, chat: bool) -> tuple[list[list[int]], SamplingParams]:
        """``_prepare`` off the event loop: rendering a chat template and tokenising up to ``max_body_bytes`` of
        text takes tens of milliseconds that every other stream of this replica would wait."""
        return await asyncio.to_thread(self._prepare, req, chat)

    def _prepare(self, req, chat: bool) -> tuple[list[list[int]], SamplingParams]:
        """The request's prompts as token ids (one, or a batch's) and its sampling parameters."""
        if req.model != self.cfg.model_name:
            raise _no_model(req.model, self.cfg.model_name)
        field = req.prompt_param
        try:
            # without a length: 16 for a completion (OpenAI's and vLLM's default), for a chat the most allowed,
            # cut to the context left after the prompt (``_fit_context``), as OpenAI's and vLLM's chat defaults are
            params = req.sampling(self.cfg.max_tokens_limit if chat else min(16, self.cfg.max_tokens_limit))
        except ValidationError as exc:
            raise api.validation_error(exc) from None
        batch = 1 if chat else len(req.prompts)
        if batch * req.choices > self.MAX_CHOICES:
            what = f"{batch} prompts × n {req.choices}" if req.choices > 1 else f"a batch of {batch} prompts"
            raise api.APIError(400, f"{what} is more than the {self.MAX_CHOICES} choices a request may ask for; "
                               "split it into several requests", param="n" if req.choices > 1 else field,
                               code="invalid_value")
        try:
            prompts = self._encode(req, chat)
        except TemplateError as exc:  # a chat template's own refusal ("roles must alternate", ...)
            raise api.APIError(400, f"the model's chat template refused these messages: {exc}", param="messages",
                               code="invalid_messages") from None
        except (TypeError, UnicodeError) as exc:  # a lone surrogate ("\ud800"): JSON allows it, UTF-8 does not
            raise api.APIError(400, f"{field} holds text that is not valid Unicode ({type(exc).__name__}); send UTF-8 "
                               "text without unpaired surrogates", param=field, code="invalid_value") from None
        except ValueError as exc:
            raise api.APIError(400, str(exc), param=field, code="invalid_value") from None
        for i, prompt in enumerate(prompts):
            if len(prompt) > self.cfg.max_prompt_tokens:
                raise api.APIError(400, f"{_prompt_name(field, i, prompts)} has {len(prompt)} tokens; the limit is "
                                   f"{self.cfg.max_prompt_tokens}", param=field, code="context_length_exceeded")
        if params.max_tokens > self.cfg.max_tokens_limit:
            raise api.APIError(400, f"{req.length_param} {params.max_tokens} > limit {self.cfg.max_tokens_limit}",
                               param=req.length_param, code="invalid_value")
        return prompts, params

    def _encode(self, req, chat: bool) -> list[list[int]]:
        if chat:
            return [encode(self.tokenizer, [m.for_template() for m in req.messages], chat=True)]
        prompts, vocab = req.prompts, len(self.tokenizer)
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, list) and any(not 0 <= t < vocab for t in prompt):
                raise ValueError(f"{_prompt_name('prompt', i, prompts)}: token ids must be in [0, {vocab})")
        return [list(p) if isinstance(p, list) else encode(self.tokenizer, p, chat=False) for p in prompts]

    async def _plans(self) -> PlanProvider:
        """The replica's plans and what serves with them, set up by the first request that needs them. One
        shielded task does it, and ``self.plans`` is set last: the first request's client gone (a cancel) or
        the store failing in the middle left ``self.plans`` set without the dynamic-tree rules or the live
        planner, and every later request served without them for the replica's life."""
        if self.plans is None:
            task = getattr(self, "setting_up", None)
            if task is None or task.done() and (task.cancelled() or task.exception() is not None):  # else: again
                task = self.setting_up = asyncio.ensure_future(self._set_up())
                task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved if its waiters left
            await asyncio.shield(task)
        return self.plans

    async def _set_up(self) -> None:
        target = await self._target_actors()
        plans = PlanProvider(self.cfg, target["hardware_id"])
        if self.cfg.request_trees:
            self.families = TreeFamilies(plans, self.cfg.live_max_depth, self.cfg.request_trees_max_batch)
        if self.cfg.dynamic_trees:
            try:
                self.rules = await asyncio.to_thread(GrowRules, plans, self.cfg.dynamic_extend)
            except Exception:  # noqa: BLE001 - serve the plans' trees as they are rather than no request at all
                logger.exception("dynamic trees are off on this replica: their rules could not be made")
        if self.cfg.live_acceptance:
            self.live = LivePlanner(self.cfg, plans)
        self.plans = plans
        self._start(self._refresh_plans())
        self._start(self._keep_gauges())
        if self.live is not None:
            self._start(self._live_replans())

    def _start(self, loop) -> None:
        """Run a background loop on this replica's event loop, held here (the event loop keeps only a weak
        reference to a task) until ``__del__`` ends it."""
        self.background.append(asyncio.get_running_loop().create_task(loop))

    async def __del__(self) -> None:  # Serve awaits it when it stops this replica, after its requests end
        """Wait (up to ``FREE_WAIT_S``) for the requests still being freed on the actors — their clients left
        mid-step: without it their state stayed there until the actors' idle reaper, counted as held by the
        autoscaler and the models' drain — then end the background loops. Left running, a loop's next tick met
        the executor Serve had shut down and logged a "plan refresh failed" traceback while the replica stopped."""
        runner = getattr(self, "runner", None)  # none if the constructor failed before it set it
        if runner is not None and (left := await runner.drain(self.FREE_WAIT_S)):
            logger.warning("stopping with %d requests not yet freed on the actors; their idle reaper frees them", left)
        if (setting_up := getattr(self, "setting_up", None)) is not None:  # would start the loops after this
            setting_up.cancel()
            await asyncio.gather(setting_up, return_exceptions=True)
        tasks = getattr(self, "background", [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _target_actors(self) -> dict:
        try:
            return await asyncio.wait_for(self.target_deployment.actors.remote(), self.cfg.step_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a timeout, a dead or missing replica: all retryable
            logger.error("no target replica: %s: %s", type(exc).__name__, exc)
            raise _unavailable("no target model replica is ready (it may be restarting)") from None

    async def _keep_gauges(self) -> None:
        """The gauges' last values, set again every GAUGE_REFRESH_S: Ray drops a value not set for two report
        intervals (``metrics.HeldGauge``)."""
        while True:
            await asyncio.sleep(GAUGE_REFRESH_S)
            try:
                if self.plans is not None:
                    self.metrics.plans(self.plans.hardware, self.plans.held())
                self.metrics.refresh()
            except Exception:  # noqa: BLE001 - metrics must never kill serving; logged
                logger.exception("refreshing the gauges failed")

    async def _refresh_plans(self) -> None:
        reported = 0
        while True:
            await asyncio.sleep(self.cfg.plan_refresh_s)
            try:
                await asyncio.to_thread(self.plans.refresh)
            except Exception:  # noqa: BLE001 - a refresh must never kill serving; logged
                logger.exception("plan refresh failed; keeping the current plans")
            if self.rules is not None:
                try:
                    await asyncio.to_thread(self.rules.refresh)
                except Exception:  # noqa: BLE001 - the rules keep the last profile; logged
                    logger.exception("reading the hardware profile for dynamic trees failed; keeping the last")
            if self.rates is not None:
                self.metrics.step_rates(self.rates.summary())
            if self.plans.errors > reported:
                self.metrics.store_errors.inc(self.plans.errors - reported)
                reported = self.plans.errors

    async def _live_replans(self) -> None:
        """Every live_replan_s: re-plan (in a thread: the DP never runs on the request path) where the live
        estimate has left the served plan's bound, and export the estimate."""
        while True:
            await asyncio.sleep(self.cfg.live_replan_s)
            replanned = []
            try:
                replanned = await asyncio.to_thread(self.live.tick)
            except Exception:  # noqa: BLE001 - re-planning must never kill serving; logged
                logger.exception("live re-plan failed; keeping the current plans")
            self.metrics.live(self.live.live, replanned)

    async def _chunks(self, prompt: list[int], params: SamplingParams, rid: str, req, chat: bool,
                      received: float | None = None, which: str | None = None, ticket: Ticket | None = None):
        """The chunks of one generation. ``which``: a choice of several (``_choices``), named in errors;
        ``ticket``: its place for a slot (``_admit``: the request was admitted as a whole), its turn waited for
        instead of a 429."""
        if ticket is not None:
            await self.slots.claim(ticket)
        elif not self.slots.take():
            raise self._overloaded()
        self.metrics.active.set(self.active)
        received, first, handed = received or time.perf_counter(), None, False

        def leave() -> None:  # once: here, or when the Runner has freed the request (``handed``)
            self.slots.release()
            self.metrics.active.set(self.active)

        try:
            plans = await self._plans()
            batch = self.in_flight.batch()  # the bucket its steps plan for (its first fetch may be slow: here)
            active = await asyncio.to_thread(plans.get, params.temperature, batch)
            self.metrics.plan.set(active.planned.plan.n, tags=self.metrics.plan_tags(
                plans.hardware, active.source, params.temperature, batch_bucket(batch)))
            family = await asyncio.to_thread(self.families.get, params.temperature) if self.families else None
            rules = self.rules.for_request(params.temperature, self.in_flight.batch) if self.rules else None
            decoder = await self._decoder(lambda: plans.get(params.temperature, self.in_flight.batch()).planned.plan,
                                          req.speculative, family, rules)
            params = _fit_context(prompt, params, decoder.max_context, req, which)
            handed = True  # the slot is left when the request is freed on the actors, not when this ends: a
            # client gone mid-step ended this at once (Starlette cancels twice) and a new request took the slot
            # while the step still held a Runner thread and the actors' state
            async for chunk in self.runner.stream(decoder, prompt, params, rid, freed=leave):
                self.metrics.generated(len(chunk.token_ids))
                if first is None and (chunk.text or chunk.finish_reason):  # what the client gets first (a chunk
                    first = True  # of ids alone holds its text back: part of a stop string or of a character)
                    self.metrics.ttft.observe(time.perf_counter() - received)
                if chunk.stats is not None:
                    self.metrics.finished(chunk.stats)
                yield chunk
        except PromptError as exc:  # found by the engine before any token: still a proper 400
            param = {"prompt": req.prompt_param, "max_tokens": req.length_param}.get(exc.param)
            raise api.APIError(400, str(exc), param=param or exc.param, code=exc.code) from None
        except RequestForgotten as exc:
            logger.warning("request %s failed: %s", rid, exc)
            raise api.APIError(503, "the request went without a step for longer than request_idle_timeout_s "
                               f"({self.cfg.request_idle_timeout_s:g} s) and was freed on the target: its stream "
                               "was not read that long, or its prompt's prefill on the draft took that long; retry "
                               "it (an operator may raise request_idle_timeout_s)", type="server_error",
                               code="request_idle_timeout") from None
        except TargetUnavailable as exc:
            logger.error("request %s failed: %s", rid, exc)
            raise _unavailable("the target model failed while generating (it is being restarted)") from None
        finally:
            if not handed:
                leave()

    async def _decoder(self, plan, speculate: bool, family=None, rules=None) -> SpeculativeDecoder:
        """``plan``: each step's tree — the plan of the batch-size bucket of the requests in flight here now
        (trees are regrown every step, so a request's tree follows the batch as it grows and shrinks).
        ``family``: the request's tree from its own acceptance (``RequestTrees``) instead of the plan's.
        ``rules``: each step's dynamic-tree rule (``GrowRules``), None for the plan's tree as it is."""
        timeout = self.cfg.step_timeout_s
        if speculate and self.draft_deployment is not None:  # both replicas asked at once: one round trip
            target, draft = await asyncio.gather(self._target_actors(), self._draft_actor(timeout))
            if draft is not None and await self._pair_refusal(draft.actor, target, timeout):
                draft = None
            elif draft is not None:  # a request longer than the draft's context goes on with the target alone
                draft.max_context = self.draft_contexts.get(draft.actor._actor_id.hex())
        else:
            target, draft = await self._target_actors(), None
        policy = self._policy(family) if draft is not None else None
        target_ranks = RanksTarget(target["ranks"], timeout, self.cfg.prefill_chunk)
        return SpeculativeDecoder(target_ranks, draft, plan, tokenizer=self.tokenizer,
                                  eos_ids=tuple(target["eos_ids"]), max_context=target["max_context"],
                                  on_verdict=self.live.observe if self.live else None, policy=policy,
                                  dynamic=rules, first_step_alone=self.cfg.first_step_alone,
                                  unpruned_every=self.cfg.dynamic_unpruned_every)

    async def _draft_actor(self, timeout: float) -> ActorDraft | None:
        """The draft replica's actor, or None: speculation is optional, the request goes on with the target
        alone."""
        try:
            return ActorDraft(await asyncio.wait_for(self.draft_deployment.actors.remote(), timeout), timeout,
                              self.cfg.prefill_chunk)
        except Exception as exc:  # noqa: BLE001 - a timeout, a dead or missing replica
            logger.warning("no draft replica (%s); this request runs on the target alone", type(exc).__name__)
            return None

    async def _pair_refusal(self, actor, target: dict, timeout: float) -> str | None:
        """Why this draft actor cannot speculate for the target (None: it can), asked once per draft actor.
        A draft whose vocabulary or tokenizer differs from the target's would draw its uniform fallback over
        other ids than the verifier's (sampling no longer exactly the target's) or propose ids the target
        reads otherwise; ``sequoia-ray generate`` refuses such a pair, the service serves the target alone."""
        key = actor._actor_id.hex()
        if key not in self.pairs:
            try:
                meta = await asyncio.wait_for(actor.info.remote(), timeout)
            except Exception as exc:  # noqa: BLE001 - a dead or stuck draft: this request goes on alone, ask again
                logger.warning("the draft actor did not report its model (%s); this request runs on the target "
                               "alone", type(exc).__name__)
                return "no answer"
            self.pairs[key] = reason = pair_refusal(target, meta)
            self.draft_contexts[key] = meta.get("max_context")
            if reason:
                logger.error("%s; every request runs on the target alone until the draft is replaced", reason)
        return self.pairs[key]

    def _policy(self, family):
        """Each request's step policy: its own tree (``family``), inside the measured choice between the tree
        and the target alone (``self.rates``); None when neither is on."""
        if family is None and self.rates is None:
            return None

        def policy(params: SamplingParams):
            batch = self.in_flight.batch
            inner = family.policy(params, batch) if family is not None else None
            return self.rates.policy(params, batch, inner) if self.rates is not None else inner

        return policy

    async def _events(self, chunks, req, rid: str, chat: bool, prompt_tokens: int, choices: int = 1
                      ) -> AsyncIterator[dict]:
        """A stream's chunks, from ``chunks``' (choice index, chunk) pairs (``choices`` of them: a batch's or
        ``n``'s choices interleave, each event naming its ``index``; a chat sends each choice's role first).
        Without ``stream_options`` the last finish chunk carries the request's usage. With ``include_usage`` every
        chunk has ``usage: null`` and a last chunk with no choices carries it, as OpenAI sends it (a client that
        adds up the chunks' usages, as LangChain does, counted it twice when the finish chunk carried it too); with
        vLLM's ``continuous_usage_stats`` every chunk carries the usage so far. One ``created`` for the whole
        stream."""
        model, created = self.cfg.model_name, int(time.time())

        def with_usage(event: dict, produced: int, stats=None, finished: bool = False) -> dict:
            if req.usage_every_chunk or (finished and not req.usage_chunk):
                event["usage"] = api.usage(prompt_tokens, produced, stats)
            elif req.usage_chunk:
                event["usage"] = None
            return event

        if chat:
            for index in range(choices):
                yield with_usage(api.chat_chunk(rid, model, {"role": "assistant", "content": ""}, None, created, index),
                                 0)
        produced, finished = 0, []
        pending, offsets = [[] for _ in range(choices)], [0] * choices  # a choice's logprobs not sent yet
        async for index, chunk in chunks:
            produced += len(chunk.token_ids)
            pending[index] += _logprob_entries(chunk)  # a chunk of ids alone (its text held back) sends them later
            if chunk.text or chunk.finish_reason:
                logprobs = (None if req.logprob_count is None
                            else self._logprobs(pending[index], chat, offsets[index]))
                if logprobs is not None and not chat:
                    offsets[index] += sum(map(len, logprobs["tokens"]))
                pending[index] = []
                if chat:
                    delta = {"content": chunk.text} if chunk.text else {}
                    event = api.chat_chunk(rid, model, delta, chunk.finish_reason, created, index, logprobs)
                else:
                    event = api.completion_chunk(rid, model, chunk.text, chunk.finish_reason, created, index,
                                                 logprobs)
                if chunk.finish_reason:
                    finished.append(chunk.stats)
                last = len(finished) == choices
                stats = Stats.combined(finished).to_dict() if last else None
                yield with_usage(event, produced, stats, finished=last)
                if last and req.usage_chunk:
                    yield {**event, "choices": [], "usage": api.usage(prompt_tokens, produced, stats)}
