"""Metrics, step timelines and the progress shown while a job runs."""
