"""HF config -> megatron model, HF <-> megatron weight adapter, CPU shims."""
