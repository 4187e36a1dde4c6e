"""Engines, one seam each: train (`engines.py`: torch, megatron), forward-only (`forward_engine.py`:
reward model, PRM, vision tower), the Medusa heads (`medusa_engine.py`) and rollout
(`rollout_engine.py`: torch, vLLM). An engine loads and owns its model, device and optimizer;
stages ask it for numbers."""
