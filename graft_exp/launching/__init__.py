"""Launching jobs and sweeps: pre-launch checks (Hydra callback), job states, sweep files."""
