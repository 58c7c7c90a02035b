"""A shared store of tree plans and hardware profiles under any ``pyarrow.fs`` URI.

Default is a local directory; on a cluster ``s3://bucket/prefix`` (add ``?endpoint_override=host:port&
scheme=http`` for an S3-compatible server) or anything else ``pyarrow.fs.FileSystem.from_uri`` opens.

Key layout (every file JSON with ``schema_version``, validated on every read)::

    <root>/plans/<hardware>/<pair>/t<temperature>/<UTC timestamp>-<random>.json          (batch bucket 1)
    <root>/plans/<hardware>/<pair>/t<temperature>-b<bucket>/<UTC timestamp>-<random>.json  (buckets 2, 4, 8, 16)
    <root>/profiles/<hardware>/<UTC timestamp>-<random>.json

``<pair>`` is a readable slug of the draft and target names plus a short hash of both; ``<temperature>``
is the request temperature rounded to one decimal (``t0.0`` = greedy); ``<bucket>`` is the batch-size
bucket the plan was chosen for (``sequoia_ray.hardware.BATCH_BUCKETS``). Bucket 1 keeps the layout of
before buckets existed, so a store written then reads as bucket 1, and a reader of then never sees the
other buckets' files (they sit in sibling folders, outside the bucket-1 folder it lists). Publishing never overwrites: each
publish writes a new uniquely named file (to a temporary name first, then moved into place), so
concurrent publishers cannot corrupt each other and the latest plan is the last name in sort order. A name's
stamp is never before the folder's newest (``_new_name``), so a clock stepped back does not hide a publish.

Retention: after each publish the folder keeps its newest ``keep`` files (``KEEP_FILES`` by default; 0 = all)
and loses the temporary files of publishers that died mid-write (older than ``STALE_TMP_S``). Live re-plans
publish for as long as a service runs, and every server lists each bucket folder every ``plan_refresh_s``:
without it the listings (on S3, a request per 1,000 names) grew without end.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow.fs as pafs

from sequoia_ray.arguments import is_uri, one_line, shown_uri, without_secrets
from sequoia_ray.config import PLAN_FALLBACK_FILES, PLAN_KEEP_FILES, check_plan_keep
from sequoia_ray.hardware import BATCH_BUCKETS, ID_UNSAFE, HardwareProfile, ProfileError, batch_bucket
from sequoia_ray.paths import user_path
from sequoia_ray.tree.plan_file import PlanFormatError, PlannedTree

logger = logging.getLogger(__name__)
FALLBACK_FILES = PLAN_FALLBACK_FILES  # older files a fetch tries when the newest does not read (corrupt, a new schema)
KEEP_FILES = PLAN_KEEP_FILES  # published files a folder keeps after a publish (the newest); older ones deleted
STALE_TMP_S = 3600.0  # a publish's temporary file older than this was left by a publisher that died mid-write
PRUNE_MAX = 16  # files one publish deletes at most (the oldest first): a folder of thousands (a store kept whole,
# then pruned) shrinks over several publishes, each bounded (on S3 a delete is ~3 requests, and a live re-plan
# publishes under the lock a bucket's first request waits on)


class PlanNotFound(LookupError):
    """No plan (or profile) is published for this key."""


class StoreError(RuntimeError):
    """The store is unreachable or holds a file that is not a valid plan/profile (names the key)."""


class _Gone(StoreError):
    """A listed file was deleted before it was read: another publisher pruned it (newer files were published)."""


def temperature_bucket(temperature: float) -> str:
    if temperature < 0:
        raise ValueError(f"temperature {temperature} must be >= 0")
    return f"t{round(temperature, 1) + 0.0:.1f}"  # + 0.0: -0.0 (which passes ">= 0") is t0.0, not t-0.0


def pair_key(draft: str, target: str) -> str:
    slug = "__".join(re.sub(r"[^A-Za-z0-9.]+", "-", Path(x.rstrip("/")).name or x).strip("-")[:40]
                     for x in (draft, target))
    digest = hashlib.sha256(f"{draft}\0{target}".encode()).hexdigest()[:8]
    return f"{slug}-{digest}"


def safe_name(part: str, what: str) -> str:
    if not part or ID_UNSAFE.search(part) or part in (".", ".."):
        raise ValueError(f"{what} {part!r} may hold only letters, digits, '.', '_' and '-'")
    return part


STAMP = "%Y%m%dT%H%M%S%fZ"  # a file name's UTC time, to the microsecond: names sort in time order


def _new_name(newest: str | None = None) -> str:
    """A new file's name: ``<UTC stamp>-<random>.json``, its stamp now or, when ``newest`` (the folder's latest
    file) is stamped at or after now, 1 µs after it. Readers take the last name in sort order as the latest, so a
    publish from a clock stepped back (NTP) or behind another host's must still sort last: with the wall clock
    alone it sorted before the newer-stamped plan, which went on being served, and a provider that had already
    loaded it swapped back. The format is unchanged, so readers of before sort the names alike."""
    now = _dt.datetime.now(_dt.timezone.utc)
    last = _stamp_of(newest)
    if last is not None and last >= now:
        try:
            now = last + _dt.timedelta(microseconds=1)
        except OverflowError:  # a hand-made name stamped at the end of time: nothing can sort after it
            raise StoreError(f"{newest} is stamped {last:%Y-%m-%d}: a new plan cannot sort after it and would never "
                             "be read; remove or rename that file") from None
    return f"{now.strftime(STAMP)}-{uuid.uuid4().hex[:8]}.json"


def _stamp_of(path: str | None) -> _dt.datetime | None:
    """The UTC time in a stamped file name (``_new_name``), None for another name."""
    stamp = (path or "").rsplit("/", 1)[-1].split("-", 1)[0]
    try:
        return _dt.datetime.strptime(stamp, STAMP).replace(tzinfo=_dt.timezone.utc)
    except ValueError:
        return None


def _published(name: str) -> bool:
    """Whether a file name is a publish's (``_new_name``): a stamp, then ``.json``. A name copied in by hand
    (``2nd-try.json``: it sorted after every stamp and was served over each later publish) is not, nor is a
    publish's temporary file."""
    return name.endswith(".json") and _stamp_of(name) is not None




def plan_bucket(temperature: float, batch: int = 1) -> str:
    """A plan's folder name under its pair: ``t0.6`` (batch bucket 1), ``t0.6-b4``."""
    return temperature_bucket(temperature) + ("" if batch == 1 else f"-b{batch}")


def parse_bucket(name: str) -> tuple[float, int] | None:
    """``plan_bucket``'s inverse: ``t0.6-b4`` -> (0.6, 4); None for a name that is not a plan folder's."""
    match = re.fullmatch(r"t(\d+\.\d)(?:-b(\d+))?", name)
    if match is None or int(match[2] or 1) not in BATCH_BUCKETS:
        return None
    return float(match[1]), int(match[2] or 1)


def _misfiled(prov, key: PlanKey) -> str | None:
    """What a plan read from ``key``'s folder was published for, when that is not ``key`` (a folder copied to the
    wrong place: a plan of another machine, pair, temperature or batch was served silently); None when it is, or
    when the file does not say (files of before a field was recorded). ``prov``: its ``Provenance``."""
    recorded = {"hardware": prov.hardware, "draft": prov.draft, "target": prov.target}
    wrong = [f"{name} {value!r}" for name, value in recorded.items() if value not in (None, getattr(key, name))]
    if prov.temperature is not None and temperature_bucket(prov.temperature) != temperature_bucket(key.temperature):
        wrong.append(f"temperature {prov.temperature}")
    if (prov.batch or 1) != key.batch:
        wrong.append(f"batch bucket {prov.batch}")
    return ", ".join(wrong) or None


@dataclass(frozen=True)
class PlanKey:
    hardware: str
    draft: str
    target: str
    temperature: float
    batch: int = 1  # the batch bucket (1, 2, 4, 8, 16); ``batch_bucket(batch_size)`` maps a batch size to it

    def __post_init__(self) -> None:
        if self.batch not in BATCH_BUCKETS:
            fix = f"use batch_bucket({self.batch}) = {batch_bucket(self.batch)}" if self.batch >= 1 else "use >= 1"
            raise ValueError(f"batch {self.batch} is not a batch bucket {BATCH_BUCKETS}; {fix}")

    def folder(self) -> str:
        return "/".join(["plans", safe_name(self.hardware, "hardware id"), pair_key(self.draft, self.target),
                         plan_bucket(self.temperature, self.batch)])


class PlanStore:
    def __init__(self, uri: str, *, keep: int = KEEP_FILES) -> None:
        self.uri, self.keep = uri, check_plan_keep(keep)
        try:
            if is_uri(uri):
                self.fs, root = pafs.FileSystem.from_uri(uri)
            else:
                self.fs, root = pafs.LocalFileSystem(), str(user_path(uri).resolve())
        except (ValueError, OSError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise StoreError(f"cannot open plan store {shown_uri(uri)!r}: {without_secrets(str(exc), uri)}") from None
        self.root = root.rstrip("/")
        self._skipped: set[str] = set()  # files that did not read, logged once each (``_newest_valid``)
        self.skips, self.last_skip = 0, None  # every skip, and why the latest was (a caller counts them as errors)
        self._thread = threading.local()  # ``skips_here``: this thread's skips (fetches run in several threads)

    def skips_here(self) -> int:
        """The skips of fetches made by the calling thread: a caller counting the files its own fetch skipped reads
        this before and after it (``skips`` moves with every thread's fetches)."""
        return getattr(self._thread, "skips", 0)

    def check_writable(self) -> None:
        """The store's folder made and a probe file written and removed there, so that a store that cannot be
        written (a folder of root's, an S3 bucket without credentials or a wrong endpoint: ~6 s to find the
        endpoint unreachable) is said when a job starts, not at its first publish after profiling (StoreError
        naming the store). A store that cannot delete is refused too: a publish moves a temporary file into
        place, which on S3 is a copy and a delete."""
        if is_uri(self.uri):
            self._check_uri_writable()
            return
        probe = Path(self.root) / f".probe-{uuid.uuid4().hex}"
        try:
            probe.parent.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise StoreError(f"plan store {self.root} cannot be written ({exc.strerror or exc}); give a folder "
                             "this user can write") from None

    def _check_uri_writable(self) -> None:
        probe = f"{self.root}/.probe-{uuid.uuid4().hex}"
        try:
            self.fs.create_dir(self.root, recursive=True)
            with self.fs.open_output_stream(probe) as out:
                out.write(b"")
        except OSError as exc:
            raise StoreError(f"plan store {self._shown_uri()} cannot be written ({one_line(exc)}); check "
                             f"its URI, endpoint and credentials{self._credentials_hint()}") from None
        try:
            self.fs.delete_file(probe)
        except OSError as exc:  # a publish moves its temporary file into place: on S3 a copy, then a delete
            raise StoreError(f"plan store {self._shown_uri()} takes files but cannot delete them ({one_line(exc)});"
                             " a publish moves a temporary file into place (on S3: a copy and a delete), so grant "
                             "the delete too (s3:DeleteObject)") from None

    def _credentials_hint(self) -> str:
        return " (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)" if self.uri.startswith("s3:") else ""

    # ---- plans ---------------------------------------------------------------------------------
    def publish_plan(self, planned: PlannedTree, key: PlanKey) -> str:
        prov = replace(planned.provenance, draft=key.draft, target=key.target, temperature=key.temperature,
                       hardware=key.hardware,  # the key's fields; what it was measured with stays
                       batch=None if key.batch == 1 else key.batch)  # None = 1: readers of before accept it
        stamped = PlannedTree(planned.plan, planned.acceptance, planned.budget, planned.max_depth,
                              planned.expected_tokens, prov)
        return self._publish(key.folder(), stamped.dumps())

    def fetch_plan(self, key: PlanKey) -> tuple[PlannedTree, str]:
        """The latest plan for ``key`` that reads, and its path; PlanNotFound if none, StoreError if none of the
        newest few reads (see ``_newest_valid``)."""
        def read(path: str) -> PlannedTree:
            planned = self.read_plan(path)
            if wrong := _misfiled(planned.provenance, key):
                raise StoreError(f"{self._display(path)}: a plan for {wrong} filed under {key.folder()}; move it to "
                                 "its own key's folder or delete it")
            return planned

        return self._newest_valid(key.folder(), f"no plan for hardware {key.hardware!r}, pair {key.draft!r} -> "
                                                f"{key.target!r}, temperature {key.temperature}, batch bucket "
                                                f"{key.batch}; run tuning/profile.py", read)

    def read_plan(self, path: str) -> PlannedTree:
        """The plan at ``path`` (one of ``list_plans``); StoreError if corrupt or unreadable."""
        try:
            return PlannedTree.loads(self._read(path), source=self._display(path))
        except PlanFormatError as exc:
            raise StoreError(str(exc)) from None

    def list_plans(self) -> list[str]:
        return [p for p in self._files("plans") if p.endswith(".json")]

    def plan_folders(self, hardware: str, draft: str, target: str) -> set[str]:
        """The bucket folders (``t0.6``, ``t0.6-b4``) a hardware and pair have plans in: one listing of the pair's
        folder, not of its files (a server looks every ``plan_refresh_s``). StoreError if unreachable."""
        folder = "/".join(["plans", safe_name(hardware, "hardware id"), pair_key(draft, target)])
        return {i.base_name for i in self._infos(folder, recursive=False) if i.type == pafs.FileType.Directory}

    # ---- profiles ------------------------------------------------------------------------------
    def publish_profile(self, profile: HardwareProfile) -> str:
        return self._publish(f"profiles/{safe_name(profile.hardware_id, 'hardware id')}",
                             json.dumps(profile.to_dict(), indent=1))

    def fetch_profile(self, hardware: str) -> HardwareProfile:
        def read(path: str) -> HardwareProfile:
            try:
                prof = HardwareProfile.from_dict(json.loads(self._read(path)), source=self._display(path))
            except (ValueError, ProfileError, RecursionError) as exc:  # RecursionError: JSON nested too deeply
                raise StoreError(f"{self._display(path)}: {type(exc).__name__}: {exc}"[:500]) from None
            if prof.hardware_id != hardware:
                raise StoreError(f"{self._display(path)}: a profile of {prof.hardware_id!r} filed under {hardware!r}")
            return prof

        return self._newest_valid(f"profiles/{safe_name(hardware, 'hardware id')}",
                                  f"no profile for hardware {hardware!r}; run tuning/profile.py", read)[0]

    # ---- reports -------------------------------------------------------------------------------
    def put_report(self, name: str, data: bytes) -> str:
        """A human-facing artifact (a PNG heatmap, a table) under <root>/reports/; returns its path."""
        path = f"{self.root}/reports/{safe_name(name, 'report name')}"
        try:
            self.fs.create_dir(f"{self.root}/reports", recursive=True)
            with self.fs.open_output_stream(path) as out:
                out.write(data)
        except OSError as exc:
            raise StoreError(f"cannot write {self._display(path)}: {exc}") from None
        return self._display(path)

    # ---- the filesystem --------------------------------------------------------------------------
    def _publish(self, folder: str, text: str) -> str:
        stamped = self._stamped(folder)
        final = f"{self.root}/{folder}/{_new_name(stamped[-1] if stamped else None)}"
        tmp = f"{self.root}/{folder}/.tmp-{uuid.uuid4().hex}"
        try:
            self.fs.create_dir(f"{self.root}/{folder}", recursive=True)
            with self.fs.open_output_stream(tmp) as out:
                out.write(text.encode())
            self.fs.move(tmp, final)
        except OSError as exc:
            raise StoreError(f"cannot publish to {self._display(final)}: {exc}") from None
        self._prune(folder)
        return final

    def _prune(self, folder: str) -> None:
        """Delete ``folder``'s published files but the newest ``keep``, and its stale temporary files. Never fails
        the publish that calls it (logged): a file another publisher deleted first is fine, a reader that listed
        one of them before it went lists the folder again (``_newest_valid``)."""
        if not self.keep:
            return
        try:
            files = [i for i in self._infos(folder, recursive=False) if i.type == pafs.FileType.File]
        except StoreError as exc:
            logger.warning("plan store: could not list %s to prune it: %s", folder, exc)
            return
        stamped = sorted(i.path for i in files if _published(i.base_name))
        now = time.time()
        stale = [i.path for i in files if i.base_name.startswith(".tmp-") and i.mtime is not None
                 and now - i.mtime.timestamp() > STALE_TMP_S]
        for path in (stamped[:-self.keep] + stale)[:PRUNE_MAX]:
            try:
                self.fs.delete_file(path)
            except FileNotFoundError:
                pass  # deleted by another publisher's prune
            except OSError as exc:
                logger.warning("plan store: could not delete %s while pruning (%s); left in place",
                               self._display(path), exc)
                return

    def _newest_valid(self, folder: str, missing: str, read):
        """``(read(path), path)`` for the newest file in ``folder`` that reads. A newer one that does not (truncated
        by hand, written by a newer schema during an upgrade) is logged once per store and path and skipped, so it
        does not hide the good plan before it; at most ``FALLBACK_FILES`` older ones are tried, then the newest's
        StoreError is raised."""
        for relisted in (False, True):
            names = self._stamped(folder)
            if not names:
                raise PlanNotFound(missing)
            try:
                return self._first_readable(names, read)
            except _Gone:  # pruned since the listing: newer files were published meanwhile, list them
                if relisted:
                    raise

    def _first_readable(self, names: list[str], read):
        first = None
        for path in reversed(names[-1 - FALLBACK_FILES:]):
            try:
                return read(path), path
            except _Gone:
                raise
            except StoreError as exc:
                first = first or exc
                self.skips, self.last_skip = self.skips + 1, f"StoreError: {exc}"
                self._thread.skips = self.skips_here() + 1
                if path not in self._skipped:
                    self._skipped.add(path)
                    logger.error("plan store: skipping %s, which does not read: %s", self._display(path), exc)
        raise first

    def _stamped(self, folder: str) -> list[str]:
        """The published files of ``folder`` itself (``_published``; not a subfolder's: an old plan moved to
        ``archive/`` sorted after every publish by its path and was served), oldest first."""
        return sorted(i.path for i in self._infos(folder, recursive=False)
                      if i.type == pafs.FileType.File and _published(i.base_name))

    def _files(self, folder: str) -> list[str]:
        return sorted(i.path for i in self._infos(folder, recursive=True) if i.type == pafs.FileType.File)

    def _infos(self, folder: str, *, recursive: bool) -> list:
        selector = pafs.FileSelector(f"{self.root}/{folder}", recursive=recursive, allow_not_found=True)
        try:
            return self.fs.get_file_info(selector)
        except OSError as exc:
            raise StoreError(f"plan store {self._shown_uri()} is unreachable: {exc}") from None

    def _read(self, path: str) -> bytes:
        try:
            with self.fs.open_input_stream(path) as f:
                return f.read()
        except FileNotFoundError as exc:
            raise _Gone(f"cannot read {self._display(path)}: {exc}") from None
        except OSError as exc:
            raise StoreError(f"cannot read {self._display(path)}: {exc}") from None

    def _display(self, path: str) -> str:
        return f"{self._shown_uri()}/{path[len(self.root) + 1:]}" if path.startswith(self.root) else path

    def _shown_uri(self) -> str:
        """The store's URI without credentials or query (``shown_uri``), for messages."""
        return shown_uri(self.uri).rstrip("/")
