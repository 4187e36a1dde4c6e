"""Model building: tiny configs, tokenizer, value and reward heads, checkpoints, packing."""
