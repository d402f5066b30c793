"""``python -m graft_exp.sweep``: ``planning`` (sweep files into ordered jobs; pure), ``state``
(their state from MLflow and the scheduler, the status table), ``launch`` (multiruns that start each job once
what it needs is trained)
and the command line in ``__main__``."""

from graft_exp.sweep.planning import SweepError, expand, plan, replace

__all__ = ["SweepError", "expand", "plan", "replace"]
