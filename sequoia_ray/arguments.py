"""Command-line helpers shared by every entry point (``cli/``, ``tuning/profile.py``): a parser whose
usage errors are one line and exit code 2, argument types that say what was wrong, the one-line form of
any input error, and the profiling job's arguments.

Light on purpose: importing this module imports argparse and pydantic only (no torch, transformers or
Ray), so building a parser stays fast. Defaults live in the pydantic models; an argument the user did not
give is ``None`` here and the model fills it in.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, TypeAdapter, ValidationError

from sequoia_ray.config import ProfileJobConfig
from sequoia_ray.devices import DEVICE_CHOICES
from sequoia_ray.paths import user_path
from sequoia_ray.prompts import load_prompts

EXIT_BAD_INPUT = 2


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2), not a usage dump."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


def one_line(exc: Exception) -> str:
    """A readable single line for any input error (pydantic's multi-line report included)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            return "; ".join(_one_error(e) for e in errors())
        except (TypeError, KeyError):
            pass
    return " ".join(str(exc).split()).replace("Value error, ", "")


def _one_error(error: dict) -> str:
    """One pydantic error: "field: message (got value)"; an error of the whole model (a check across fields, its
    ``loc`` empty) is its message alone (it read ": message (got {<every field>...)")."""
    message = error["msg"].removeprefix("Value error, ")
    if not error["loc"]:
        return message
    return f"{'.'.join(map(str, error['loc']))}: {message} (got {error.get('input')!r:.60})"


# ---- argument types ------------------------------------------------------------------------------
def check_output(path: str, flag: str) -> None:
    """A file a command writes at its end, checked at its start (before the models load and the work runs):
    ValueError naming ``flag`` when it is a folder, its folder does not exist, or either cannot be written."""
    target = user_path(path)
    folder = target.parent
    if target.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a file name")
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"{flag} {path} cannot be written by this user; give a path it can write")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


FULL = "full"


def vocab_size(text: str) -> int | str:
    """The draft head's kept ids (an integer >= 1), or ``full`` / ``null`` (the whole head; ``draft_vocab``
    None: ``--help`` says "null or 'full'", as the config file takes them)."""
    if text.lower() in (FULL, "null", "none"):
        return FULL
    return positive_int(text)


def depth(text: str) -> int | None:
    """Tree levels, root included, or ``unbounded``."""
    if text.lower() in ("unbounded", "none", "inf"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or 'unbounded'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1 (levels, root included)")
    return value


def nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or math.isinf(value):  # inf: `serve --profile-seconds inf` loaded the models, then
        raise argparse.ArgumentTypeError(f"{value} must be a finite number >= 0")  # failed on int(inf * share)
    return value


def field_type(model: type[BaseModel], name: str):
    """An argument type that checks a value as ``model``'s field ``name`` does (its type and bounds: the model is
    the one home of both), before any work is done with it."""
    field = model.model_fields[name]
    adapter = TypeAdapter(Annotated[(field.annotation, *field.metadata)])

    def check(text: str):
        try:
            return adapter.validate_python(text)
        except ValidationError as exc:
            msg = exc.errors()[0]["msg"]
            raise argparse.ArgumentTypeError(f"{text!r}: {msg[:1].lower()}{msg[1:]}") from None

    check.__name__ = name  # argparse names the type in some errors
    return check


def described(model: type[BaseModel], name: str) -> str:
    """A field's description and default, as argparse help (the model is the one home of both)."""
    field = model.model_fields[name]
    default = None if field.default_factory is not None else field.default
    shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
    return f"{field.description} (default: {shown})"


def given(args: argparse.Namespace, names: list[str]) -> dict:
    """The arguments among ``names`` the user gave (not None): what overrides a model's defaults."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


# ---- the profiling job (``sequoia-ray profile`` and ``tuning/profile.py``) -------------------------
def noise_fraction(text: str) -> float:
    """``--max-noise``: a fraction as the job config's ``max_noise`` checks it, at most 1. ``25`` meant as 25%
    was a bound of 2500%: the noise check turned off without a word (a config may still set more, e.g. the
    tests' tiny models, whose sub-millisecond timings are all noise)."""
    value = field_type(ProfileJobConfig, "max_noise")(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text!r} is over 1 (100%): a fraction, e.g. 0.25 for 25%; did you mean "
                                         f"{value / 100:g}?")
    return value



_JOB_PLAIN = ["draft", "target", "max_depth", "width", "prompts", "dtype", "draft_quantize", "linears", "layers",
              "draft_vocab", "device", "tp_size", "max_noise"]


def add_job_args(p: argparse.ArgumentParser) -> None:
    """The ProfileJobConfig fields as options; defaults and help come from the model."""
    def doc(name: str) -> str:
        return described(ProfileJobConfig, name)

    p.add_argument("--storage", required=True, help=ProfileJobConfig.model_fields["storage"].description)
    p.add_argument("--draft", help=doc("draft"))
    p.add_argument("--target", help=doc("target"))
    p.add_argument("--temperatures", help="comma-separated; " + doc("temperatures"))
    p.add_argument("--budgets", help="comma-separated; " + doc("budgets"))
    p.add_argument("--max-depth", type=int, help=doc("max_depth"))
    p.add_argument("--width", type=int, help=doc("width"))
    p.add_argument("--prompts", help=doc("prompts"))
    p.add_argument("--acceptance", action="append", default=[], metavar="T=FILE",
                   help="use this acceptance vector for temperature T instead of measuring (repeatable)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help=doc("dtype"))
    p.add_argument("--draft-quantize", choices=["int8"], help=doc("draft_quantize"))
    p.add_argument("--linears", choices=["auto", "packed", "aten"], help=doc("linears"))
    p.add_argument("--layers", choices=["auto", "traced", "eager"], help=doc("layers"))
    p.add_argument("--draft-vocab", type=vocab_size, help=doc("draft_vocab"))
    p.add_argument("--device", choices=DEVICE_CHOICES, help=doc("device"))
    p.add_argument("--tp-size", type=int, help=doc("tp_size"))
    p.add_argument("--max-noise", type=noise_fraction, metavar="FRACTION", help=doc("max_noise"))
    p.add_argument("--smoke-test", action="store_true", help=ProfileJobConfig.model_fields["smoke_test"].description)


def _floats(text: str, name: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--{name} {text!r} must be comma-separated numbers") from None
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"--{name} {text!r} must be finite numbers (not inf or nan)")
    return values


def _acceptance_files(items: list[str]) -> dict[float, str]:
    acceptance = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--acceptance {item!r} must be T=FILE, e.g. 0.6=acc.json")
        t, path = item.split("=", 1)
        temps = _floats(t, "acceptance") if t.strip() and path else ()
        if len(temps) != 1:
            raise ValueError(f"--acceptance {item!r} must be T=FILE with one temperature T and a file, "
                             "e.g. 0.6=acc.json")
        acceptance[temps[0]] = path
    return acceptance


def _check_acceptance(cfg: ProfileJobConfig) -> None:
    """Every ``--acceptance T=FILE`` read now, before any model loads: T one of the temperatures profiled (another
    would be dropped), the file a usable vector, measured at T when it records its temperature (``measure`` does)."""
    from sequoia_ray.tree.acceptance_vector import AcceptanceError, AcceptanceVector

    for t, text in cfg.acceptance.items():
        if t not in cfg.temperatures:
            raise ValueError(f"--acceptance {t}={text}: {t} is not a profiled temperature (--temperatures "
                             f"{','.join(map(str, cfg.temperatures))}); add it to --temperatures or drop this")
        try:
            _, recorded = AcceptanceVector.parse_recorded(text)
        except AcceptanceError as exc:
            raise ValueError(f"--acceptance {t}={text}: {exc}") from None
        if recorded is not None and recorded != t:
            raise ValueError(f"--acceptance {t}={text}: the file was measured at temperature {recorded}, not {t}; "
                             f"give it as {recorded}={text} (and {recorded} in --temperatures)")
        for role, profiled in (("draft", cfg.draft), ("target", cfg.target)):
            measured = _recorded_model(text, role)
            if measured is not None and not _same_model(measured, profiled):
                raise ValueError(f"--acceptance {t}={text}: the file was measured with {role} {measured!r}, not the "
                                 f"{role} profiled here ({profiled!r}); measure this pair (sequoia-ray measure) or "
                                 f"profile with --{role} {measured}")


def model_source(source: str) -> str:
    """A ``--draft``/``--target`` value as the trials read it (``sequoia_ray.models.loading.resolve``): a name it
    knows (``default-draft``, ``tiny-target``) and a hub id (``Qwen/Qwen2.5-0.5B``) as given, a local path
    absolute — one written as a path (``./m``, ``~/m``, ``/m``) or one that exists here (``m``, ``m/``,
    ``m.gguf``), as ``resolve`` would have loaded it in this directory. Left relative, ``./m`` named nothing
    in the trial's directory, and ``m`` was taken there for a hub id."""
    from sequoia_ray.models.loading import DEFAULT_DRAFT, DEFAULT_TARGET, TINY_DRAFT, TINY_TARGET

    path = user_path(source)
    if source in (DEFAULT_DRAFT, DEFAULT_TARGET, TINY_DRAFT, TINY_TARGET) or not source.strip():
        return source  # names first, as resolve reads them; "" is resolve's to refuse (Path("") is here)
    local = source.startswith(("/", ".", "~")) or path.exists()
    return str(path.resolve()) if local and not is_uri(source) else source


def _recorded_model(text: str, role: str) -> str | None:
    """The draft or target an acceptance file records (``measure`` writes both; None: a number list, or none)."""
    import json

    if not text.endswith(".json"):
        return None
    try:
        value = json.loads(user_path(text).read_text()).get(role)
    except (OSError, ValueError, AttributeError):
        return None  # read already, by parse_recorded
    return value if isinstance(value, str) and value else None


def _same_model(a: str, b: str) -> bool:
    """Whether two model sources may name one model: False only when they surely differ — two paths here to
    different folders or files, or two names or hub ids that differ. A path against a hub id (a snapshot of
    it?) or a path that does not exist here (written on another machine) cannot be told apart: True."""
    a, b = model_source(a), model_source(b)
    if a == b:
        return True
    pa, pb = Path(a), Path(b)
    if pa.is_absolute() and pb.is_absolute() and pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return pa.is_absolute() or pb.is_absolute()


def job_config(args: argparse.Namespace, **extra) -> ProfileJobConfig:
    """The validated job config from parsed arguments; bad values raise ValueError naming them."""
    fields = given(args, _JOB_PLAIN)  # draft_vocab FULL: the config reads 'full' as the full head itself
    if args.temperatures is not None:
        fields["temperatures"] = _floats(args.temperatures, "temperatures")
    if args.budgets is not None:
        budgets = _floats(args.budgets, "budgets")
        if any(b != int(b) for b in budgets):
            raise ValueError(f"--budgets {args.budgets!r} must be whole numbers")
        fields["budgets"] = tuple(int(b) for b in budgets)
    cfg = ProfileJobConfig(storage=args.storage, acceptance=_acceptance_files(args.acceptance),
                           smoke_test=args.smoke_test, **fields, **extra)
    _check_acceptance(cfg)
    if cfg.prompts and not is_uri(cfg.prompts):  # read here, before Ray (as the acceptance files): a file that does
        # not read failed tuning/profile.py's trial, with Tune's traceback
        try:
            load_prompts(cfg.prompts)
        except OSError as exc:
            raise ValueError(f"--prompts: {exc}") from None
    return cfg


URI_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")  # RFC 3986's scheme, then ':'


def is_uri(location: str) -> bool:
    """Whether a store ``location`` is a URI (``s3://b/p``, ``file:/abs/path``: pyarrow opens it) rather than a
    local path (``plans``, ``/data/plans``). Looking for ``://`` took ``file:/abs/path`` for a relative path and
    made a folder ``file:`` in the working directory."""
    return URI_SCHEME.match(location) is not None


def shown_uri(location: str) -> str:
    """A store ``location`` as messages, logs and ``/v1/models`` may show it: a URI without its user info and its
    query (pyarrow reads ``s3://KEY:SECRET@bucket/p`` as credentials, and a query may hold a secret too: Azure's
    ``client_secret``); a local path as it is (a ``?`` there is part of a folder's name)."""
    if not is_uri(location):
        return location
    scheme, _, rest = location.partition(":")
    rest = rest.split("?", 1)[0]
    if rest.startswith("//"):  # the authority: [user[:password]@]host[:port]
        authority, slash, path = rest[2:].partition("/")
        rest = "//" + authority.rpartition("@")[2] + slash + path
        if user_info(location):  # a secret with a "/" in it (AWS's often have one), unescaped, ends past the first
            rest = "//" + rest[2:].rpartition("@")[2]  # "/": the user info runs to the last "@"
    return f"{scheme}:{rest}".rstrip("/")


def user_info(location: str) -> str:
    """A URI's ``KEY:SECRET`` user info as given, up to its last "@" (a secret may hold "/" unescaped); "" when it
    has none: no "@", or what comes before the first "/" is a host or host:port (``hdfs://nn:8020/run@2024``)."""
    rest = location.partition(":")[2].split("?", 1)[0]
    if not rest.startswith("//"):
        return ""
    user, at, _ = rest[2:].rpartition("@")
    first = rest[2:].split("/", 1)[0]
    if "@" in first:  # the user info within the authority: ``s3://KEY:SECRET@bucket``
        return first.rpartition("@")[0]
    port = first.partition(":")[2]
    return user if at and port and not port.isdigit() else ""


def without_secrets(text: str, location: str) -> str:
    """``text`` (a library's error, say) with ``location`` and its user info and query as ``shown_uri`` hides them:
    pyarrow's "Cannot parse URI: 's3://KEY:SECRET@bucket/p'" put the secret back into a message that began with
    the URI shown without it."""
    shown = shown_uri(location)
    text = text.replace(location, shown)
    if is_uri(location):
        query = location.partition("?")[2]
        for secret in (query, user_info(location)):
            if secret:
                text = text.replace(secret, "***")
    return text
