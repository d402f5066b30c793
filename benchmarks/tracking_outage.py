"""A tracking outage longer than MLflow's client retries, with the client's DEFAULT retries: what a job does and
what it costs (docs/tracking.md, "Tracking outages").

    python benchmarks/tracking_outage.py [--down 360] [--steps 40] [overrides ...]

Starts ``python -m graft_exp.server`` (PostgreSQL + ``mlflow server``; needs root and Debian's ``postgresql``) on
loopback, runs a tiny job into it uninterrupted, then the same job again (``rerun=true``) with
``python -m graft_exp.server stop --keep-db`` issued once the job has logged step 2 and ``start`` again ``--down``
seconds later (MLflow's default retries give up after about four minutes; ``tracking.*`` at its defaults: a probe
every 30 s, up to 300 s of waiting at the job's end). Prints the job's exit status, its runs' end states, the
per-step metric values present, duplicated and lost against the uninterrupted job's, whether every
non-wall-clock metric is equal bit for bit, the job's lines about the outage, and the time the outage cost it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.mlflow_records import histories, model_runs
from support.ports import free_port

from graft_exp import schema, tracking
from graft_exp.server import read_credentials

JOB = ["method.n=2", "train.batch_prompts=4", "train.minibatch_prompts=2", "eval.runs=1", "eval.samples=1",
       "eval.max_problems=4", "backend.progress=false", "tracking=server", "rerun=true"]


def server(where: Path, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "graft_exp.server", *args, "--dir", str(where)], check=True,
                   capture_output=True, text=True, timeout=400)


def records(client: MlflowClient, study: str) -> tuple[dict, dict]:
    """(each run's metric histories, each run's status), by run: "job" and the roles."""
    exp = client.get_experiment_by_name(f"graft/{study}")
    job = client.search_runs([exp.experiment_id], f"tags.`{tracking.PARENT_TAG}` IS NULL")[0]
    runs = {"job": job, **model_runs(client, job.info.run_id)}
    return ({label: histories(client, run.info.run_id) for label, run in runs.items()},
            {label: run.info.status for label, run in runs.items()})


def trained_steps(client: MlflowClient, study: str) -> int:
    exp = client.get_experiment_by_name(f"graft/{study}")
    if exp is None:
        return 0
    return max((m.step for run in client.search_runs([exp.experiment_id])
                for m in client.get_metric_history(run.info.run_id, "train/reward_mean")), default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--down", type=float, default=360, help="seconds the server is stopped")
    parser.add_argument("--steps", type=int, default=40, help="train.max_steps of the job")
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides for the job")
    args = parser.parse_args()
    where = Path(tempfile.mkdtemp(prefix="graft-outage-bench-"))
    data = Path(tempfile.mkdtemp(prefix="graft-outage-server-"))
    data.chmod(0o711)   # PostgreSQL runs as `postgres` under root, and must reach it
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    start = ["start", "--host", "127.0.0.1", "--port", str(port), "--pg-port", str(free_port()), "--workers", "2"]
    try:
        server(data, *start)
        server(data, "add-user", "jobs")
        user, password = read_credentials(data / "users" / "jobs.credentials")
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        env.update(MLFLOW_TRACKING_URI=uri, MLFLOW_TRACKING_USERNAME=user, MLFLOW_TRACKING_PASSWORD=password,
                   OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        os.environ.update(MLFLOW_TRACKING_USERNAME=user, MLFLOW_TRACKING_PASSWORD=password)
        job = [sys.executable, "-m", "graft_exp", *JOB, f"train.max_steps={args.steps}",
               f"eval.val_every={args.steps // 2}", f"train.save_every={args.steps // 2}", *args.overrides]
        print(" ".join(job[1:]), flush=True)

        started = time.monotonic()
        subprocess.run([*job, "study=uninterrupted", f"checkpoint_root={where / 'ckpt-a'}"], cwd=where, env=env,
                       check=True, capture_output=True, timeout=1800)
        uninterrupted_s = time.monotonic() - started

        client = MlflowClient(uri)
        log = where / "outage.log"
        started = time.monotonic()
        with open(log, "w") as out:
            process = subprocess.Popen([*job, "study=outage", f"checkpoint_root={where / 'ckpt-b'}"], cwd=where,
                                       env=env, stdout=out, stderr=subprocess.STDOUT)
        while trained_steps(client, "outage") < 2:
            if process.poll() is not None:
                raise SystemExit(f"the job ended before step 2:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        print(f"injected: python -m graft_exp.server stop --keep-db (at step 2, {time.monotonic() - started:.0f} s "
              f"into the job); start again {args.down:.0f} s later", flush=True)
        server(data, "stop", "--keep-db")
        stopped = time.monotonic()
        while time.monotonic() - stopped < args.down and process.poll() is None:
            time.sleep(1)
        ended_while_down = process.poll() is not None
        server(data, *start)
        down_s = time.monotonic() - stopped
        code = process.wait(timeout=3600)
        outage_s = time.monotonic() - started

        expected, _ = records(client, "uninterrupted")
        got, status = records(client, "outage")
        present = duplicated = lost = 0
        for label, metrics in expected.items():
            for key, history in metrics.items():
                steps = Counter(step for step, _ in got[label].get(key, []))
                present += len(steps)
                duplicated += sum(c - 1 for c in steps.values())
                lost += len({step for step, _ in history} - set(steps))
        equal = all({k: v for k, v in got[label].items() if k not in schema.WALL_CLOCK} ==
                    {k: v for k, v in expected[label].items() if k not in schema.WALL_CLOCK} for label in expected)
        text = log.read_text()
        lines = [line.split(" - ", 1)[-1] for line in text.splitlines()
                 if "[graft_exp.tracking]" in line]
        when = ("after the job had ended: its spool left for the command" if ended_while_down else
                "while the job waited at its end" if "waiting up to" in text else "while the job trained")
        print(f"server down {down_s:.0f} s; back {when}")
        print(f"job exit status {code}; runs: {', '.join(f'{k} {v}' for k, v in status.items())}")
        print(f"metric values (key, step) present {present}, duplicated {duplicated}, lost {lost}; every "
              f"non-wall-clock metric equal to the uninterrupted job's bit for bit: {equal}")
        print("the job said:\n  " + "\n  ".join(line[:240] for line in lines))
        print(f"job time {outage_s:.0f} s against {uninterrupted_s:.0f} s uninterrupted: the outage cost "
              f"{outage_s - uninterrupted_s:.0f} s")
    finally:
        subprocess.run([sys.executable, "-m", "graft_exp.server", "stop", "--dir", str(data)],
                       capture_output=True, timeout=120, check=False)
        shutil.rmtree(where, ignore_errors=True)
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
