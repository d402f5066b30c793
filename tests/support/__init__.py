"""Helpers of the tests, not tests: stand-ins, a private Slurm cluster, the bad-input table, record readers.

``tests/`` is on ``sys.path`` under pytest (its test files are not a package), so tests import these as
``support.<module>``; the scripts among them (``bad_inputs.py``, ``private_slurm.py``,
``verl_placement_probe.py``) also run by path.
"""
