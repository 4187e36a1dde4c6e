"""Predicting a run before it starts: a simulator of the dataflow (`simulator.py`) over a graph of
stage costs (`graph.py`), costs from a run's trace (`calibrate.py`) or from the config alone
(`analytic.py` at `devices.py`'s figures, this machine's timed by `micro_calibration.py`), and the
search over schedules, placements and ranks (`search.py`, `rank_search.py`)."""
