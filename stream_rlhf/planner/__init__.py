"""Predicting a run before it starts: a simulator of the dataflow (`simulator.py`) over a graph of
stage costs (`graph.py`)."""
