"""The README's results table for the tiny pair, from MLflow: benchmark average (test/avg, the mean of
the final evaluation runs of each model's best checkpoint) per method, model and seed.

    python benchmarks/tiny_results.py [--tracking-uri sqlite:///mlflow.db] [--methods grpo_n8,sgt,graft]

Prints a Markdown table: each model's mean +- sample std over seeds, and the two models' average.
"""

from __future__ import annotations

import argparse

import pandas as pd
from mlflow.tracking import MlflowClient


def model_scores(uri: str, methods: list[str]) -> pd.DataFrame:
    """One row per (method, model, seed): mean of the run's test/avg values and its best step."""
    client = MlflowClient(uri)
    experiments = [e.experiment_id for e in client.search_experiments(filter_string="name LIKE 'graft/%'")]
    runs = client.search_runs(experiments, "attributes.status = 'FINISHED'", max_results=5000) if experiments else []
    rows = []
    for run in runs:
        tags = run.data.tags
        if "graft.role" not in tags or tags["graft.method"] not in methods or tags.get("graft.pair") != "tiny":
            continue
        history = client.get_metric_history(run.info.run_id, "test/avg")
        rows.append({"method": tags["graft.method"], "model": tags["graft.model"], "seed": int(tags["graft.seed"]),
                     "test_avg": sum(m.value for m in history) / len(history),
                     "best_step": int(tags["graft.best_step"])})
    return pd.DataFrame(rows)


def table(scores: pd.DataFrame, methods: list[str]) -> str:
    models = sorted(scores["model"].unique(), key=lambda m: m != "tiny-char-llama")
    lines = ["| method | " + " | ".join(models) + " | average of both | seeds |",
             "|---" * (len(models) + 3) + "|"]
    for method in methods:
        block = scores[scores.method == method]
        if block.empty:
            continue
        cells = []
        for model in models:
            values = block[block.model == model].test_avg * 100
            cells.append(f"{values.mean():.1f} ± {values.std(ddof=1):.1f}")
        both = block.groupby("seed").test_avg.mean() * 100
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {both.mean():.1f} ± {both.std(ddof=1):.1f} | "
                     + ",".join(str(s) for s in sorted(block.seed.unique())) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tracking-uri", default="sqlite:///mlflow.db")
    parser.add_argument("--methods", default="grpo_n8,sgt,graft")
    args = parser.parse_args()
    methods = args.methods.split(",")
    scores = model_scores(args.tracking_uri, methods)
    if scores.empty:
        raise SystemExit(f"no FINISHED tiny-pair model runs of {', '.join(methods)} in {args.tracking_uri}")
    print(table(scores, methods))
    print()
    print(scores.sort_values(["method", "model", "seed"]).to_string(index=False))


if __name__ == "__main__":
    main()
