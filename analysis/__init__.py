"""Regenerate the paper's tables and figures from MLflow alone.

    python -m analysis tables  --tracking-uri URI --out DIR [--experiment NAME ...]
    python -m analysis figures --tracking-uri URI --out DIR
    python -m analysis compare --out DIR

Pipeline: :mod:`analysis.store` (MLflow -> pandas, in bulk) -> :mod:`analysis.results` (cells, missing runs)
-> :mod:`analysis.rules` (the paper's reporting rules) -> :mod:`analysis.tables` / :mod:`analysis.figures`
-> :mod:`analysis.render`; :mod:`analysis.compare` sets the result beside the paper's own numbers.
"""
