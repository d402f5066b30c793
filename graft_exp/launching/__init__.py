"""Launching jobs and sweeps: pre-launch checks (Hydra callback), scheduler state, sweep files."""
