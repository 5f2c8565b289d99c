"""Metrics, their writers, summaries, profiling, progress and the will-it-fit memory check."""
