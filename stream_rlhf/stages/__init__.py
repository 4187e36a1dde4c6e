"""The RLHF stages: one file per role, each a Stage that runs as its own process."""
