"""A prepared model snapshot is the one the catalog names: ``python -m graft_exp.prepare`` downloads each hub model
at its pinned ``revision`` (conf/catalog/models.yaml) and records it beside the snapshot (``RECORD``); a job checks
that record and the model's prompt format against the snapshot's real tokenizer (``prompts.check_format``) at
validation, and again on the node before Ray starts."""

from __future__ import annotations

import json
from pathlib import Path

from graft_exp import prompts

#: The record ``prepare`` writes into each snapshot folder: which hub id and revision it holds.
RECORD = "graft_snapshot.json"


def record(folder: Path, hf_id: str, revision: str | None) -> None:
    """Write ``folder``'s record: ``hf_id`` at ``revision`` (None: the hub's newest when it was fetched)."""
    (folder / RECORD).write_text(json.dumps({"hf_id": hf_id, "revision": revision}, indent=1) + "\n")


def recorded_revision(folder: Path) -> str | None:
    """The revision ``folder``'s record names, or None (no record, or an unpinned download)."""
    path = folder / RECORD
    return json.loads(path.read_text()).get("revision") if path.is_file() else None


def revision_problem(folder: Path, key: str, pinned: str | None) -> str | None:
    """Why the snapshot in ``folder`` is not model ``key`` at the ``pinned`` revision, or None (or nothing pinned)."""
    if not pinned:
        return None
    found = recorded_revision(folder)
    if found == pinned:
        return None
    where = f"is at revision {found}" if found else "has no record of its revision"
    other = prompts.model_override(key, "revision", found or "null")
    return (f"the snapshot of {key} in {folder} {where}, and the catalog pins {pinned}: run `python -m "
            f"graft_exp.prepare --models {key}` again, or set {other} to train the snapshot you have (a run key of "
            "its own)")


def check_tokenizer(tokenizer, key: str, format_name: str, where: str) -> int:
    """``prompts.check_format`` of the catalog format ``format_name`` for model ``key``; returns its end of turn."""
    return prompts.check_format(tokenizer, prompts.prompt_format(format_name, key), key,
                                where)


def check_prepared(folder: Path, key: str, entry) -> int | None:
    """The prepared snapshot ``folder`` of model ``key`` (catalog ``entry``) is at its pinned revision and prompts
    and stops in its format; returns the end-of-turn id. Raises ValueError naming the fix."""
    from transformers import AutoTokenizer

    problem = revision_problem(folder, key, entry.get("revision"))
    if problem:
        raise ValueError(problem)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as err:
        raise ValueError(f"the snapshot of {key} in {folder} has no loadable tokenizer ({err}): run `python -m "
                         f"graft_exp.prepare --models {key}` again") from None
    if entry.get("prompt_format") is None:   # a model the project built, in its tokenizer's own template
        prompts.check_own_template(tokenizer, f"models.{key} ({folder})")
        return prompts.end_of_turn_id(tokenizer)
    return check_tokenizer(tokenizer, key, entry["prompt_format"], str(folder))
