"""Process-level services that know no config: errors, storage paths (local and gs://), signals, what process 0
prints."""
