"""Qwen3 layers and the checkpoint loader."""
