"""vLLM's v1 KV cache manager as a pagedkv backend (the conformance suite's worked example)."""
