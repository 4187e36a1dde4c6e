"""The `stream-rlhf` sub-commands, one module per group; `cli.py` parses and imports the one run."""
