"""What a run does as it starts, once a config exists: jax.distributed for a multi-process run (distributed.py),
the config resolved for this process's devices (startup.py), and the run's directory and records (run_dir.py)."""
