"""A tracking outage longer than MLflow's client retries (docs/tracking.md, "Tracking outages"): the real
``mlflow server`` on PostgreSQL (``python -m graft_exp.server``) is stopped under a real tiny job whose client
retries are shortened (MLFLOW_HTTP_REQUEST_MAX_RETRIES=1, no backoff) and started again: while training goes on
(the job keeps its records in its spool and sends them), after the last step (the job waits, then sends), or only
after the job has ended (``python -m graft_exp.tracking send``, refused by another store first). Each time the
job exits 0, its three runs end FINISHED, and every metric of every step is there once, equal bit for bit to an
uninterrupted job's. A spool that cannot be written stops the job in one line."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
import requests
from mlflow.tracking import MlflowClient
from support.mlflow_records import assert_same_records, histories, model_runs
from support.ports import free_port

from graft_exp import schema, tracking
from graft_exp.server import read_credentials

STEPS = 16
# The smallest tiny job whose outage falls inside training: 2 rollouts per prompt, one validation and checkpoint
# half-way; the server's stop and the shortened retries take a few of its steps.
JOB = [f"train.max_steps={STEPS}", "method.n=2", "train.batch_prompts=4", "train.minibatch_prompts=2",
       "eval.val_every=8", "eval.runs=1", "eval.samples=1", "eval.max_problems=4", "backend.progress=false",
       "train.save_every=8"]
# MLflow's client gives up after one immediate retry (default: 7 retries over about four minutes).
SHORT_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}


def postgres_installed() -> bool:
    return any(Path("/usr/lib/postgresql").glob("*/bin/initdb"))


class Server:
    """``python -m graft_exp.server`` on loopback with a user that writes: stopped and started again by the tests."""

    def __init__(self):
        # As root PostgreSQL runs as `postgres`, which cannot enter pytest's private temporary directory.
        self.dir = Path(tempfile.mkdtemp(prefix="graft-outage-server-"))
        self.dir.chmod(0o711)
        self.port = free_port()
        self.start_args = ["start", "--host", "127.0.0.1", "--port", str(self.port), "--pg-port", str(free_port()),
                           "--workers", "2"]
        self.uri = f"http://127.0.0.1:{self.port}"

    def cli(self, *args: str) -> None:
        done = subprocess.run([sys.executable, "-m", "graft_exp.server", *args, "--dir", str(self.dir)],
                              capture_output=True, text=True, timeout=400, check=False)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    def start(self) -> None:
        self.cli(*self.start_args)

    def answers(self) -> bool:
        try:
            return requests.get(f"{self.uri}/health", timeout=5).ok
        except requests.RequestException:
            return False

    def stop(self) -> None:
        self.cli("stop", "--keep-db")   # the mlflow server only: the outage, not a new database


@pytest.fixture
def server(started_server, monkeypatch):
    """The module's server, this test process one of its users; started again after a test that failed while it
    was stopped."""
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", started_server.user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", started_server.password)
    yield started_server
    if not started_server.answers():
        started_server.start()


@pytest.fixture(scope="module")
def started_server():
    if not postgres_installed():
        pytest.skip("PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb); CI installs "
                    "the `postgresql` Debian package in .ci/run")
    s = Server()
    try:
        s.start()
        s.cli("add-user", "jobs")
        s.user, s.password = read_credentials(s.dir / "users" / "jobs.credentials")
        yield s
    finally:
        subprocess.run([sys.executable, "-m", "graft_exp.server", "stop", "--dir", str(s.dir)],
                       capture_output=True, timeout=120, check=False)
        shutil.rmtree(s.dir, ignore_errors=True)


def job_env(server: Server | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["OMP_NUM_THREADS"] = "1"   # the same arithmetic in the uninterrupted job and the interrupted ones
    if server is not None:
        env.update(MLFLOW_TRACKING_URI=server.uri, MLFLOW_TRACKING_USERNAME=server.user,
                   MLFLOW_TRACKING_PASSWORD=server.password, **SHORT_RETRIES)
    return env


def records(client: MlflowClient, job_id: str) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Every metric history of a job run and its model runs, by run ("job", then the roles)."""
    return {"job": histories(client, job_id),
            **{role: histories(client, run.info.run_id) for role, run in model_runs(client, job_id).items()}}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The records of the same job in a SQLite store, nothing stopped."""
    where = tmp_path_factory.mktemp("uninterrupted")
    uri = f"sqlite:///{where}/mlflow.db"
    done = subprocess.run([sys.executable, "-m", "graft_exp", *JOB, f"tracking.uri={uri}",
                           f"checkpoint_root={where / 'ckpt'}", "study=uninterrupted"],
                          cwd=where, env=job_env(), capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("graft/uninterrupted")
    job = client.search_runs([exp.experiment_id], f"tags.`{tracking.PARENT_TAG}` IS NULL")[0]
    return records(client, job.info.run_id)


class Job:
    """A tiny job training into the server, its output in a log file."""

    def __init__(self, server: Server, tmp_path: Path, study: str, *overrides: str):
        self.log, self.ckpt, self.study = tmp_path / "job.log", tmp_path / "ckpt", study
        # rerun=true: the tests' jobs share a run key (study is not part of it), each trains a run of its own
        argv = [sys.executable, "-m", "graft_exp", *JOB, "tracking=server", "tracking.outage_probe_s=1",
                f"study={study}", "rerun=true", f"checkpoint_root={self.ckpt}", *overrides]
        self.started = time.monotonic()
        with open(self.log, "w") as out:
            self.process = subprocess.Popen(argv, cwd=tmp_path, env=job_env(server), stdout=out,
                                            stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text()

    def until(self, what: str, done, timeout_s: float = 300) -> None:
        """Wait, while the job runs, until ``done()``."""
        deadline = time.monotonic() + timeout_s
        while not done():
            assert self.process.poll() is None, f"the job ended before {what}:\n{self.output()[-3000:]}"
            assert time.monotonic() < deadline, f"no {what} in {timeout_s} s:\n{self.output()[-3000:]}"
            time.sleep(0.1)

    def spooled(self) -> bool:
        return any(p.stat().st_size > 0 for p in self.ckpt.glob(f"*/{tracking.SPOOL_DIR}/records.jsonl"))

    def wait(self) -> float:
        assert self.process.wait(timeout=600) == 0, self.output()[-4000:]
        return time.monotonic() - self.started

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
            self.process.wait()


def trained_steps(client: MlflowClient, study: str) -> int:
    """The newest step of ``train/reward_mean`` any run of the study holds."""
    exp = client.get_experiment_by_name(f"graft/{study}")
    if exp is None:
        return 0
    return max((m.step for run in client.search_runs([exp.experiment_id])
                for m in client.get_metric_history(run.info.run_id, "train/reward_mean")), default=0)


def tally(got: dict, expected: dict) -> dict[str, int]:
    """Metric values (key, step) of every run present, duplicated and lost against the uninterrupted job's."""
    counts = {"present": 0, "duplicated": 0, "lost": 0}
    for label, metrics in expected.items():
        for key, history in metrics.items():
            steps = Counter(step for step, _ in got.get(label, {}).get(key, []))
            counts["present"] += len(steps)
            counts["duplicated"] += sum(c - 1 for c in steps.values())
            counts["lost"] += len({step for step, _ in history} - set(steps))
    return counts


def check_records(server: Server, study: str, uninterrupted: dict) -> dict[str, int]:
    """The job's three runs FINISHED with the gap closed, their artifacts there, and every metric of every step once,
    equal to the uninterrupted job's (``assert_same_records``: bit for bit, wall-clock metrics by their steps).
    Returns what is present, duplicated and lost."""
    client = MlflowClient(server.uri)
    exp = client.get_experiment_by_name(f"graft/{study}")
    runs = client.search_runs([exp.experiment_id], "")
    assert len(runs) == 3
    job = next(run for run in runs if tracking.PARENT_TAG not in run.data.tags)
    for run in runs:
        assert run.info.status == "FINISHED", run.data.tags.get("mlflow.runName")
        assert re.fullmatch(r"\S+ to \S+: \d+ records kept in the job's spool, sent in order at \S+",
                            run.data.tags[schema.TRACKING_GAP]), run.data.tags[schema.TRACKING_GAP]
    got = records(client, job.info.run_id)
    counts = tally(got, uninterrupted)
    assert counts["lost"] == counts["duplicated"] == 0, counts
    assert set(got) == set(uninterrupted)
    for label in got:
        assert_same_records(got[label], uninterrupted[label], label)
    for run in model_runs(client, job.info.run_id).values():
        assert {"trajectories", "prompt_success.parquet", "transfers"} <= \
            {a.path for a in client.list_artifacts(run.info.run_id)}
    assert "config.yaml" in {a.path for a in client.list_artifacts(job.info.run_id)}
    return counts


@pytest.mark.service
@pytest.mark.slow
def test_an_outage_during_training_costs_no_step(server, uninterrupted, tmp_path, record_property):
    job = Job(server, tmp_path, "outage-mid", "tracking.outage_wait_s=120")
    try:
        client = MlflowClient(server.uri)
        job.until("step 2 in the store", lambda: trained_steps(client, "outage-mid") >= 2)
        stopped = time.monotonic()
        server.stop()
        job.until("a spooled record", job.spooled)
        # Frozen while the server starts again (seconds), so that the store answers before its last step.
        os.kill(job.process.pid, signal.SIGSTOP)
        server.start()
        down_s = time.monotonic() - stopped
        os.kill(job.process.pid, signal.SIGCONT)
        took = job.wait()
    finally:
        job.kill()
    out = job.output()
    assert "does not answer after MLflow's retries" in out and "answers again: sent the" in out, out[-3000:]
    assert "waiting up to" not in out                  # sent while training, not at the end
    assert not list(job.ckpt.glob(f"*/{tracking.SPOOL_DIR}"))
    counts = check_records(server, "outage-mid", uninterrupted)
    print(f"\nserver down {down_s:.1f} s mid-training: exit 0, FINISHED, {counts}, job {took:.1f} s")
    record_property("outage_mid_training_down_s", round(down_s, 1))


@pytest.mark.service
@pytest.mark.slow
def test_a_store_back_after_the_last_step_is_waited_for(server, uninterrupted, tmp_path):
    job = Job(server, tmp_path, "outage-end", "tracking.outage_wait_s=300")
    try:
        client = MlflowClient(server.uri)
        job.until("step 2 in the store", lambda: trained_steps(client, "outage-end") >= 2)
        stopped = time.monotonic()
        server.stop()
        job.until("the wait at the job's end", lambda: "waiting up to 300 s" in job.output())
        server.start()
        down_s = time.monotonic() - stopped
        took = job.wait()
    finally:
        job.kill()
    assert "answers again: sent the" in job.output()
    counts = check_records(server, "outage-end", uninterrupted)
    print(f"\nserver down {down_s:.1f} s, back after the last step: exit 0, FINISHED, {counts}, job {took:.1f} s")


@pytest.mark.service
@pytest.mark.slow
def test_a_spool_left_at_the_end_is_sent_later_by_its_command(server, uninterrupted, tmp_path):
    job = Job(server, tmp_path, "outage-later", "tracking.outage_wait_s=0")
    try:
        client = MlflowClient(server.uri)
        job.until("step 2 in the store", lambda: trained_steps(client, "outage-later") >= 2)
        server.stop()
        job.wait()
    finally:
        job.kill()
    out = job.output()
    said = re.search(r"send them with: (python -m graft_exp\.tracking send (\S+))\n", out)
    assert said, out[-3000:]
    job_dir = Path(said.group(2))
    assert (job_dir / tracking.SPOOL_DIR / "records.jsonl").is_file()

    def send(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "graft_exp.tracking", "send", str(job_dir), *extra],
                              env=job_env(server), capture_output=True, text=True, timeout=300, check=False)
    down = send()
    assert down.returncode == 1 and "does not answer" in down.stderr and len(down.stderr.splitlines()) == 1, \
        down.stderr
    server.start()
    # Another database behind the address the command is given: refused in one line, the spool kept.
    other = f"sqlite:///{tmp_path / 'other.db'}"
    tracking.ensure_store(other, "graft/outage-later")
    refused = send("--tracking-uri", other)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "holds no run" in refused.stderr and len(refused.stderr.splitlines()) == 1, refused.stderr
    assert (job_dir / tracking.SPOOL_DIR / "records.jsonl").is_file()
    unfinished = MlflowClient(server.uri).search_runs(
        [MlflowClient(server.uri).get_experiment_by_name("graft/outage-later").experiment_id], "")
    assert {run.info.status for run in unfinished} == {"RUNNING"}   # the store never heard the job end
    sent = send()
    assert sent.returncode == 0 and re.search(r"sent \d+ tracking records", sent.stdout), sent.stdout + sent.stderr
    assert not (job_dir / tracking.SPOOL_DIR).exists()
    counts = check_records(server, "outage-later", uninterrupted)
    print(f"\nserver down past the job's end, spool sent by its command: FINISHED, {counts}")


def test_a_spool_that_cannot_be_written_stops_the_job(tmp_path, monkeypatch):
    """Nothing answers at the store's address and the job's directory is a file: the first write the client gives
    up on raises ``SpoolError``, one line naming the spool."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    dead = f"http://127.0.0.1:{free_port()}"
    (tmp_path / "job").write_text("not a directory")
    spool = tracking.Spool(tmp_path / "job" / tracking.SPOOL_DIR, dead, MlflowClient(dead), probe_every_s=1)
    run = tracking.TrackedRun(MlflowClient(dead), "0" * 32)
    run.keep_in(spool)
    with pytest.raises(tracking.SpoolError) as raised:
        run.log_metrics({"train/reward_mean": 0.5}, 1)
    message = str(raised.value)
    assert "\n" not in message and f"cannot keep the job's tracking records in {spool.dir}" in message
    assert "resumes from its newest checkpoint" in message
