"""Prompt datasets and the synthetic tasks with verifiable rewards."""
