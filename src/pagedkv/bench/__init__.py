"""Benchmarks of pagedkv against its alternatives, measured in one run on one machine.

Every headline figure is a ratio between two systems (or between a system and an ideal)
measured in the same run, on the same machine, checkpoint and fixed-seed workload, so that it
means something on any machine. One module per workload:

* :mod:`~pagedkv.bench.mixed`: throughput and TTFT on a mixed prompt/output-length workload;
* :mod:`~pagedkv.bench.shared_prefix`: prefill tokens and TTFT with a shared system prompt, and
  a multi-turn chat;
* :mod:`~pagedkv.bench.decode`: batch-1 decode on a Qwen3-0.6B-shaped checkpoint against the
  memory-bandwidth bound (full mode only);
* :mod:`~pagedkv.bench.memory`: KV-cache utilisation and concurrency in a fixed KV byte budget;
* :mod:`~pagedkv.bench.scaling`: throughput against concurrency, and the engine's own share of
  a decode step;
* :mod:`~pagedkv.bench.micro`: the KVManager's per-page cost against the pool size.

:mod:`~pagedkv.bench.workloads` is the table of them all; every system a workload measures
offers :class:`~pagedkv.bench.system.SystemUnderTest`. Run ``pagedkv bench --help``. The
project's own measurements (vLLM's CPU backend as a peer, the CI gate) extend this package from
``bench/pagedkv_bench``, which is not installed (``bench/README.md`` says why).
"""
