from graft_exp.sweep.planning import SweepError, expand, plan, replace

__all__ = ["SweepError", "expand", "plan", "replace"]
