"""The `megatron` train engine: megatron-core's GPTModel with tensor x pipeline x context x data
parallelism over a stage group (`engine.py`), its CPU shims (`shim.py`), its config (`config.py`),
the model built from a Hugging Face config (`model.py`), its packed micro-batch (`batch.py`), the
context-parallel attention (`cp_attention.py`) and sequence split (`context.py`), the HF <->
megatron weight mapping (`weights.py`, one small file per architecture: `arch_qwen2.py`,
`arch_llama.py`, `arch_qwen2_vl.py`) and offload of its buffers' storages to pinned host memory
(`offload.py`). Needs the `megatron` extra."""
