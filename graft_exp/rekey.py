"""``python -m graft_exp.rekey``: give every run of a store the run key this version computes.

A job finds its own past by ``graft.run_key`` (resume, skip, equal-compute references, shared GRPO baselines). When
the rule of what enters a key changes deliberately (docs/design.md, "Run keys"; README's upgrade notes), the runs
already in a store carry keys the new code no longer computes. This command recomputes each key from the resolved
config the job logged (its ``config.yaml`` artifact; a model run from its job's), re-tags the run (the replaced key
kept in ``graft.run_key_before``), maps a budget's reference (``train.gpu_hours_of`` or ``flops_of``) to its job's new key, and moves
each job's checkpoint directory (``<checkpoint_root>/<run key>``) to the new key, so a job requeued across the
upgrade resumes. Running it twice changes nothing the second time.

    python -m graft_exp.rekey                                   # sqlite:///mlflow.db, checkpoints as logged
    python -m graft_exp.rekey --tracking-uri http://host:5000 --checkpoint-root /scratch/ckpt --dry-run
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mlflow.tracking import MlflowClient
from rich.console import Console
from rich.table import Table

from graft_exp import schema
from graft_exp.config import BUDGET_SETTINGS
from graft_exp.tracking import (
    PARENT_TAG,
    TrackingError,
    check_store,
    logged_config,
    model_run_key,
    run_key,
    sqlite_file,
)


@dataclass
class Rekeyed:
    """One run's key before and after, and what happened to its job's checkpoint directory."""

    run_id: str
    kind: str            # job | model (role)
    label: str
    before: str
    after: str | None    # None: the run cannot be re-keyed (its job logged no config)
    checkpoints: str = ""


def budget_reference(config: dict) -> tuple[str, str] | None:
    """(setting, key) of the reference job a budgeted ``config`` names (``train.gpu_hours_of`` / ``flops_of``)."""
    train = config.get("train") or {}
    return next(((name, train[name]) for _, name in BUDGET_SETTINGS.values() if train.get(name) is not None), None)


def with_budget_reference(config: dict, new_key_of: dict[str, str]) -> dict:
    """``config`` with its budget's reference (a job's key) replaced by that job's new key."""
    found = budget_reference(config)
    if found is None or found[1] not in new_key_of:
        return config
    name, ref = found
    return {**config, "train": {**config["train"], name: new_key_of[ref]}}


def move_checkpoints(config: dict, before: str, after: str, root: Path | None, dry_run: bool) -> str:
    """Move ``<checkpoint_root>/<before>`` to ``<checkpoint_root>/<after>`` (the job's logged root unless
    ``root``); say what was done."""
    base = root if root is not None else Path(str(config.get("checkpoint_root", "checkpoints")))
    old, new = base / before, base / after
    if before == after or not old.is_dir():
        return ""
    if new.exists():
        return f"kept {old} ({new} exists)"
    if not dry_run:
        old.rename(new)
    return f"{old} -> {new.name}"


def rekey_store(uri: str, checkpoint_root: Path | None = None, dry_run: bool = False) -> list[Rekeyed]:
    """Re-key every run of every ``graft/`` experiment of ``uri`` (see the module docstring)."""
    client = MlflowClient(uri)
    experiments = [e.experiment_id for e in client.search_experiments(filter_string=schema.GRAFT_EXPERIMENTS)]
    runs = client.search_runs(experiments, f"tags.`{schema.RUN_KEY}` != ''", max_results=50000) if experiments \
        else []
    jobs = {r.info.run_id: r for r in runs if PARENT_TAG not in r.data.tags}
    with tempfile.TemporaryDirectory() as tmp:
        configs = {run_id: logged_config(client, run_id, Path(tmp) / run_id) for run_id in jobs}
    # A budget names its reference by key: re-key references first (a key never names a later job).
    new_key_of = {}
    for run in runs:
        if run.data.tags.get(schema.RUN_KEY_BEFORE):
            new_key_of[run.data.tags[schema.RUN_KEY_BEFORE]] = run.data.tags[schema.RUN_KEY]
    order = sorted(jobs, key=lambda rid: budget_reference(configs[rid] or {}) is not None)
    for run_id in order:
        if configs[run_id] is not None:
            configs[run_id] = with_budget_reference(configs[run_id], new_key_of)
            new_key_of[jobs[run_id].data.tags[schema.RUN_KEY]] = run_key(configs[run_id])
    done = []
    for run in runs:
        tags = run.data.tags
        parent = tags.get(PARENT_TAG, run.info.run_id)
        config = configs.get(parent)
        role = tags.get(schema.ROLE)
        is_job = PARENT_TAG not in tags
        after = None if config is None else run_key(config) if is_job else model_run_key(config, role)
        label = f"{tags.get(schema.PAIR)}/{tags.get(schema.METHOD)}/s{tags.get(schema.SEED)}" + \
            ("" if is_job else f" {tags.get(schema.MODEL)}")
        entry = Rekeyed(run.info.run_id, "job" if is_job else f"model {role}", label, tags[schema.RUN_KEY], after)
        if after is not None and after != entry.before:
            if not dry_run:
                client.set_tag(run.info.run_id, schema.RUN_KEY_BEFORE, entry.before)
                client.set_tag(run.info.run_id, schema.RUN_KEY, after)
            if is_job:
                entry.checkpoints = move_checkpoints(config, entry.before, after, checkpoint_root, dry_run)
        done.append(entry)
    return done


def report(entries: list[Rekeyed], dry_run: bool) -> None:
    table = Table(title="run keys" + (" (dry run: nothing changed)" if dry_run else ""))
    for col in ("run", "kind", "job", "before", "after", "checkpoints"):
        table.add_column(col)
    for e in entries:
        after = "no config.yaml: left as is" if e.after is None else "unchanged" if e.after == e.before else e.after
        table.add_row(e.run_id[:8], e.kind, e.label, e.before, after, e.checkpoints)
    console = Console()
    console.print(table)
    changed = sum(e.after is not None and e.after != e.before for e in entries)
    console.print(f"{changed} of {len(entries)} runs re-keyed" + (" (dry run)" if dry_run else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graft_exp.rekey", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tracking-uri", default="sqlite:///mlflow.db", help="the store (default: %(default)s)")
    parser.add_argument("--checkpoint-root", type=Path, default=None,
                        help="where the jobs' checkpoint directories are (default: each job's logged checkpoint_root)")
    parser.add_argument("--dry-run", action="store_true", help="print the new keys; change nothing")
    args = parser.parse_args(argv)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")   # one bar per run's config.yaml
    if args.checkpoint_root is not None and not args.checkpoint_root.is_dir():
        print(f"rekey: --checkpoint-root {args.checkpoint_root} is not a directory", file=sys.stderr)
        return 2
    db = sqlite_file(args.tracking_uri)
    if db is not None and not db.is_file():
        print(f"rekey: {args.tracking_uri} does not exist; give the store to re-key with --tracking-uri", file=sys.stderr)
        return 2
    try:
        check_store(args.tracking_uri, writing=not args.dry_run)
    except TrackingError as err:
        print(f"rekey: {err}", file=sys.stderr)
        return 2
    report(rekey_store(args.tracking_uri, args.checkpoint_root, args.dry_run), args.dry_run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
