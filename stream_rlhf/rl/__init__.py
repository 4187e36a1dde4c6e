"""RL jobs: the config users write, its compilation into broker topics and stage processes, and the
driver that warm-starts, evaluates and summarises a run."""
