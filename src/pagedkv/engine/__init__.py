"""Scheduler, step plans, model runner, sampler, request state and the LLM API."""
