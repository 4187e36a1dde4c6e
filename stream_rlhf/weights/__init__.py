"""Versioned weight sync from trainers to the stages that serve or forward the same model."""
