"""pagedkv: a spec-driven reference inference engine for Qwen3 on a paged KV cache."""

__version__ = "0.1.0"
