"""The project's own measurements: ``make bench`` and ``make bench-gate``.

``pagedkv bench`` (:mod:`pagedkv.bench`, installed) runs pagedkv's workloads, beside the
transformers baselines a user compares against, and writes the results. This package, which
is not installed, adds what only the project's published figures and its CI need:

* :mod:`~pagedkv_bench.peers`: the peers workload, pagedkv beside transformers and vLLM's CPU
  backend on the Qwen3-0.6B shape;
* :mod:`~pagedkv_bench.vllm_peer` and :mod:`~pagedkv_bench.vllm_worker`: vLLM run from its own
  virtualenv as a subprocess, over a JSON-lines protocol;
* :mod:`~pagedkv_bench.gate`: the CI regression gate against ``bench/floors.json``;
* :mod:`~pagedkv_bench.cli`: ``python -m pagedkv_bench``, the installed command line with the
  peers workload in its table and ``--gate FLOORS``.

It imports :mod:`pagedkv.bench`; nothing installed imports it. Run it with ``bench/`` on the
path (``PYTHONPATH=bench``, as the Makefile does). This file imports nothing, so that the vLLM
worker can run in vLLM's virtualenv.
"""
