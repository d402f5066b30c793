"""A job's tracking spool: what its runs would have logged while the tracking store does not answer (after MLflow's
client has retried), kept in order in the job's directory and sent in that order, each record once, when the store
answers again (docs/tracking.md, "Tracking outages").

    python -m graft_exp.tracking send DIR [--tracking-uri URI] [--wait SECONDS]   # DIR: the job's directory

``DIR/tracking-spool/`` holds ``outage.json`` (the store, when it stopped answering, the job's runs),
``records.jsonl`` (one record a line: metrics with their steps and timestamps, params, tags, an artifact, a run's
end; each appended and fsync'd before the job goes on), ``files/<n>/`` (the files record n logs, copied, since the
job rewrites its own) and ``sent`` (how many records the store holds; a replay cut short goes on from there). Every
write of a ``TrackedRun`` is such a record, sent straight away while the store answers (``send``).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import requests
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from graft_exp import schema
from graft_exp.tracking.store import TrackingError

log = logging.getLogger("graft_exp.tracking")

SPOOL_DIR = "tracking-spool"
MAX_BATCH = 1000   # MLflow's log_batch limit on metrics per call
MAX_PARAMS = 100   # ... and on params per call
#: How long the probe of a store that stopped answering waits for its answer (no retries: the job is training).
PROBE_TIMEOUT_S = 10
#: The gap tag's value while the records are being sent (a replay cut short leaves it; the next one replaces it).
BEING_SENT = "being sent"


class SpoolError(TrackingError):
    """The spool cannot be written: the job stops rather than lose what it could not record."""


class OtherStore(TrackingError):
    """The store answers, but without the job's runs (another database behind the same address)."""


class StoreDown(TrackingError):
    """The store still does not answer; the spool is kept."""


def outage(err: BaseException) -> bool:
    """Whether ``err``, raised by MLflow's client after its retries, says the store did not answer (a connection
    refused or timed out, a 5xx: the server or its database down) rather than that it refused the request."""
    if isinstance(err, MlflowException):
        return err.get_http_status_code() >= 500
    if isinstance(err, requests.HTTPError):   # an artifact upload's status (MLflow raises it as requests does)
        return err.response is not None and err.response.status_code >= 500
    return isinstance(err, requests.RequestException)


def first_line(err: BaseException | str, limit: int = 200) -> str:
    """An error's first line, cut to ``limit`` characters (MLflow's connection errors run to a screenful)."""
    text = str(err).strip()
    line = text.splitlines()[0] if text else type(err).__name__
    return line if len(line) <= limit else line[:limit] + "..."


def now_ms() -> int:
    return int(time.time() * 1000)


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def send(client: MlflowClient, run_id: str, record: dict, base: Path | None = None) -> None:
    """One record into run ``run_id``, through MLflow's client; an artifact's ``local`` path is relative to
    ``base`` (the spool) where it was copied there."""
    op = record["op"]
    if op == "metrics":
        metrics = [Metric(key, value, timestamp, step) for key, value, timestamp, step in record["metrics"]]
        for i in range(0, len(metrics), MAX_BATCH):
            client.log_batch(run_id, metrics=metrics[i:i + MAX_BATCH])
    elif op == "params":
        params = [Param(key, value) for key, value in record["params"].items()]
        for i in range(0, len(params), MAX_PARAMS):
            client.log_batch(run_id, params=params[i:i + MAX_PARAMS])
    elif op == "tags":
        client.log_batch(run_id, tags=[RunTag(key, value) for key, value in record["tags"].items()])
    elif op in ("artifact", "artifacts"):
        local = Path(record["local"]) if base is None else base / record["local"]
        log_file = client.log_artifact if op == "artifact" else client.log_artifacts
        log_file(run_id, str(local), record["path"])
    elif op == "status":
        client.set_terminated(run_id, record["status"], record["end_time"])
    else:
        raise ValueError(f"unknown spool record {op!r}")


def command(job_dir: Path) -> str:
    """The command that sends a job's spool later."""
    return f"python -m graft_exp.tracking send {job_dir}"


def _fsync_tree(path: Path) -> None:
    """Flush ``path`` (a file, or a directory with everything in it) to the disk, as the records are."""
    for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
        fd = os.open(item, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Spool:
    """The spool of one job, shared by its job run and model runs (``TrackedRun.keep_in``), so that their records
    keep one order. While the store answers, a write goes straight to it; the first write MLflow's client gives up
    on starts an outage: from then on every write is appended here, and at most every ``probe_every_s`` a write
    asks the store, without retries, whether it answers again with the job's runs; then the whole spool is sent,
    in order, before anything new."""

    def __init__(self, directory: Path, uri: str, client: MlflowClient, probe_every_s: float):
        self.dir, self.uri, self.client, self.probe_every_s = Path(directory), uri, client, probe_every_s
        self.runs: list[str] = []
        self.since: str | None = None     # when the store stopped answering (UTC); None while it answers
        self.count = 0                    # records in the spool
        self._lock = threading.RLock()    # the driver's threads share the job's spool
        self._holder = None               # the open lock file: one process at a time appends or sends
        self._probed = 0.0
        self._refused = False             # the refusal of another store, said once

    @property
    def pending(self) -> bool:
        """Whether the store has not answered since the spool began (records may be waiting)."""
        return self.since is not None

    @property
    def job_dir(self) -> Path:
        return self.dir.parent

    @property
    def records_file(self) -> Path:
        return self.dir / "records.jsonl"

    def attach(self, run_id: str) -> None:
        with self._lock:
            self.runs.append(run_id)
            if self.pending:
                self._write_outage()

    # ------------------------------------------------------------------ the job's writes and reads
    def write(self, run_id: str, record: dict) -> None:
        """``record`` into run ``run_id``: sent while the store answers, else kept here (``SpoolError`` when it
        cannot be)."""
        with self._lock:
            if not self.pending:
                try:
                    send(self.client, run_id, record)
                    return
                except Exception as err:
                    if not outage(err):
                        raise
                    self.begin(err)
            self.append(run_id, record)
            self.retry()

    def read(self, read):
        """``read()``'s answer, or None while the store does not answer (the caller then knows less, and the
        replay drops what the store already holds)."""
        with self._lock:
            if self.pending:
                self.retry()
                if self.pending:
                    return None
            try:
                return read()
            except Exception as err:
                if not outage(err):
                    raise
                self.begin(err)
                return None

    def retry(self) -> None:
        """Send the spool if the store answers again; asked at most every ``probe_every_s``."""
        if time.monotonic() - self._probed >= self.probe_every_s:
            self._probed = time.monotonic()
            self.try_send()

    def try_send(self) -> bool:
        """Probe the store and send the spool where it answers with the job's runs. True when everything is sent;
        False while it does not answer, or answers without the job's runs (said once)."""
        try:
            self.check_store()
            self.replay()
            return True
        except OtherStore as err:
            if not self._refused:
                log.error("%s", err)
                self._refused = True
        except StoreDown:
            pass
        except Exception as err:   # it answered the probe, then not the replay: the spool stays, to the next probe
            if not outage(err):
                raise
        return False

    def settle(self, wait_s: float) -> bool:
        """At the job's end: wait up to ``wait_s`` for the store and send the spool; otherwise leave it, saying in
        one line how to send it later. True when nothing is left."""
        with self._lock:
            if not self.pending:
                return True
            deadline = time.monotonic() + wait_s
            log.warning("the tracking store %s has not answered since %s: waiting up to %.0f s to send the job's %d "
                        "kept records", self.uri, self.since, wait_s, self.count)
            while not self.try_send():
                left = deadline - time.monotonic()
                if self._refused or left <= 0:
                    log.warning("the job's %d tracking records since %s are kept in %s; send them with: %s",
                                self.count, self.since, self.dir, command(self.job_dir))
                    return False
                time.sleep(min(self.probe_every_s, left))
            return True

    # ------------------------------------------------------------------ keeping
    def begin(self, err: BaseException) -> None:
        """The store stopped answering: open the spool (continuing one this job left), say so once."""
        self.since = utc_now()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._hold()
            self.count = len(self.records()) if self.records_file.exists() else 0
            self._write_outage()
        except OSError as err2:
            raise self._cannot(err2) from None
        log.warning("the tracking store %s does not answer after MLflow's retries (%s): training goes on, its "
                    "records kept in %s and sent when the store answers", self.uri, first_line(err), self.dir)

    def append(self, run_id: str, record: dict) -> None:
        """One record at the spool's end, on the disk before the job goes on; an artifact's files copied beside it."""
        entry = {"run": run_id, **record}
        try:
            if record["op"] in ("artifact", "artifacts"):
                source = Path(record["local"])
                target = self.dir / "files" / str(self.count) / source.name
                shutil.rmtree(target.parent, ignore_errors=True)   # a copy a crash left before its record
                target.parent.mkdir(parents=True)
                if source.is_dir():
                    shutil.copytree(source, target)
                else:
                    shutil.copy2(source, target)
                _fsync_tree(target.parent)
                entry["local"] = str(target.relative_to(self.dir))
            with open(self.records_file, "a") as f:
                f.write(json.dumps(entry) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:
            raise self._cannot(err) from None
        self.count += 1

    def _cannot(self, err: OSError) -> SpoolError:
        return SpoolError(f"cannot keep the job's tracking records in {self.dir} ({err.strerror or err}) while "
                          f"{self.uri} does not answer: the job stops here, before it records what it cannot keep; "
                          "launching it again resumes from its newest checkpoint and sends what the spool holds")

    def _write_outage(self) -> None:
        self._atomic(self.dir / "outage.json", json.dumps({"uri": self.uri, "since": self.since, "runs": self.runs}))

    def _atomic(self, path: Path, text: str) -> None:
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as err:
            raise self._cannot(err) from None

    def _hold(self) -> None:
        """Lock the spool for this process: a ``send`` while the job still writes it would send records twice."""
        if self._holder is not None:
            return
        holder = open(self.dir / "lock", "a")   # noqa: SIM115 (held open while this process owns the spool)
        try:
            fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder.close()
            raise TrackingError(f"the spool {self.dir} is being written or sent by another process (its job still "
                                "running?): nothing sent") from None
        self._holder = holder

    def _release(self) -> None:
        if self._holder is not None:
            self._holder.close()
            self._holder = None

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.records_file.read_text().splitlines() if line.strip()]

    def sent(self) -> int:
        path = self.dir / "sent"
        return int(path.read_text()) if path.exists() else 0

    # ------------------------------------------------------------------ sending
    def check_store(self) -> None:
        """Raise ``StoreDown`` unless the store answers, ``OtherStore`` when it answers without the job's first run.
        One request and no retries: the job is training meanwhile."""
        run_id = self.runs[0]
        if self.uri.startswith(("http://", "https://")):
            from mlflow.utils.credentials import get_default_host_creds
            from mlflow.utils.rest_utils import http_request

            try:   # MLflow's own request, with its credentials and TLS settings, without its retries
                response = http_request(get_default_host_creds(self.uri), "/api/2.0/mlflow/runs/get", "GET",
                                        max_retries=0, timeout=PROBE_TIMEOUT_S, params={"run_id": run_id})
            except MlflowException as err:
                raise StoreDown(str(err)) from None
            if response.status_code == 404:
                raise self._other(run_id)
            if response.status_code != 200:
                raise StoreDown(f"{response.status_code} {response.reason}")
            return
        try:
            self.client.get_run(run_id)
        except MlflowException as err:
            if err.error_code == "RESOURCE_DOES_NOT_EXIST":
                raise self._other(run_id) from None
            if outage(err):
                raise StoreDown(str(err)) from None
            raise

    def _other(self, run_id: str) -> OtherStore:
        return OtherStore(f"the tracking store {self.uri} answers but holds no run {run_id} of this job (another "
                          f"database behind the same address?): nothing sent, the spool {self.dir} is kept; once the "
                          f"job's own store is back, send it with: {command(self.job_dir)}")

    def replay(self) -> int:
        """Send the spool's records not yet sent, in order, each once, and remove the spool. A record may already be
        in the store (its request failed after the server took it, or a replay stopped after sending it), and one
        logged while the job could not read the run may repeat what the run holds: metrics at a step the run has
        and params it has are left out. The runs carry ``graft.tracking_gap`` while it sends, and after it the
        outage's start and end. Returns how many records it sent."""
        with self._lock:
            self._hold()
            records, done = self.records(), self.sent()
            todo = records[done:]
            runs = {}
            for run_id in dict.fromkeys([*self.runs, *(r["run"] for r in todo)]):
                try:
                    runs[run_id] = self.client.get_run(run_id)
                except MlflowException as err:
                    if err.error_code == "RESOURCE_DOES_NOT_EXIST":
                        raise self._other(run_id) from None
                    raise
            back = utc_now()
            gap = f"{self.since} to {back}: {len(records)} records kept in the job's spool"
            earlier = {run_id: [g for g in run.data.tags.get(schema.TRACKING_GAP, "").split("; ")
                                if g and not g.endswith(BEING_SENT)] for run_id, run in runs.items()}
            for run_id in runs:
                send(self.client, run_id, {"op": "tags", "tags": {
                    schema.TRACKING_GAP: "; ".join([*earlier[run_id], f"{gap}, {BEING_SENT}"])}})
            held: dict[tuple[str, str], set[int]] = {}
            for i, record in enumerate(todo, start=done):
                record = self._new_part(record, runs[record["run"]], held)
                if record is not None:
                    send(self.client, record["run"], record, self.dir)
                self._atomic(self.dir / "sent", str(i + 1))
            for run_id in runs:
                send(self.client, run_id, {"op": "tags", "tags": {
                    schema.TRACKING_GAP: "; ".join([*earlier[run_id], f"{gap}, sent in order at {utc_now()}"])}})
            log.info("the tracking store %s answers again: sent the %d records kept since %s, in order", self.uri,
                     len(todo), self.since)
            shutil.rmtree(self.dir)
            self._release()
            self.since, self.count = None, 0
            return len(todo)

    def _new_part(self, record: dict, run, held: dict[tuple[str, str], set[int]]) -> dict | None:
        """What of ``record`` the run does not hold yet (None: nothing)."""
        run_id = record["run"]
        if record["op"] == "metrics":
            new = []
            for key, value, timestamp, step in record["metrics"]:
                if (run_id, key) not in held:
                    stored = self.client.get_metric_history(run_id, key) if key in run.data.metrics else []
                    held[(run_id, key)] = {m.step for m in stored}
                if step not in held[(run_id, key)]:
                    held[(run_id, key)].add(step)
                    new.append([key, value, timestamp, step])
            return {**record, "metrics": new} if new else None
        if record["op"] == "params":
            new = {k: v for k, v in record["params"].items() if k not in run.data.params}
            run.data.params.update(new)
            return {**record, "params": new} if new else None
        return record

    @classmethod
    def left_in(cls, job_dir: Path, uri: str | None = None, client: MlflowClient | None = None) -> Spool | None:
        """The spool a job left in ``job_dir`` (None: none), to send to ``uri`` (default: the store it was kept
        for)."""
        directory = Path(job_dir) / SPOOL_DIR
        if not (directory / "outage.json").is_file():
            return None
        outage_state = json.loads((directory / "outage.json").read_text())
        uri = uri or outage_state["uri"]
        spool = cls(directory, uri, client or MlflowClient(uri), probe_every_s=0)
        spool.runs, spool.since = list(outage_state["runs"]), outage_state["since"]
        spool.count = len(spool.records()) if spool.records_file.exists() else 0
        return spool


def send_left(job_dir: Path, uri: str | None = None, wait_s: float = 0.0) -> int:
    """Send the spool a job left in ``job_dir`` (waiting up to ``wait_s`` for the store); how many records it sent
    (0: no spool). Raises ``StoreDown`` (still not answering) or ``OtherStore`` (another database), the spool kept."""
    spool = Spool.left_in(job_dir, uri)
    if spool is None:
        return 0
    deadline = time.monotonic() + wait_s
    while True:
        try:
            spool.check_store()
            return spool.replay()
        except StoreDown as err:
            if time.monotonic() >= deadline:
                raise StoreDown(f"the tracking store {spool.uri} does not answer ({first_line(err)}): "
                                f"nothing sent, the spool {spool.dir} is kept; send it later with: "
                                f"{command(spool.job_dir)}") from None
            time.sleep(min(5.0, max(deadline - time.monotonic(), 0.0)))
