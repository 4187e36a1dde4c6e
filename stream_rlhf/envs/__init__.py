"""Environments of multi-turn and tool-using episodes: the interface a user implements
(`environment.py`), the engine-side record of an episode's tokens (`episode.py`), the runner that
calls environments outside the decode loop (`stepper.py`), their config (`config.py`) and the
embedded calculator tool (`calculator.py`)."""
