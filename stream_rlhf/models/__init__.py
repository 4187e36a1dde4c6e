"""Model building: tiny configs, tokenizer, value and reward heads, checkpoints, packing."""

from transformers.utils import logging as hf_logging

# every stage process loads models through this package: no "Loading weights" bars, and no tqdm
# multiprocessing lock that a stage's os._exit would leave behind (resource_tracker's "leaked
# semaphore" warning at the end of a run)
hf_logging.disable_progress_bar()
