"""Process-level services: errors, jax.distributed, storage paths (local and gs://), signals."""
