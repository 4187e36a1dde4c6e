"""Checkpoints of a whole run and `stream-rlhf run --resume`: what each stateful stage saves, how
a checkpoint is written so that a half-written one is never picked, and how a run continues."""
