"""The scheduler family: what a step runs, and the only writer of request progress.

Layered bottom up, so nothing imports what stands above it: :mod:`.output` (the work a step
runs and the tokens sampled for it), :mod:`.scheduler` (the mode-independent
:class:`~pagedkv.engine.sched.scheduler.Scheduler`), one implementation per cache mode
(:mod:`.paged` v1, :mod:`.recompute` v0), and :mod:`.factory`, which picks one.
"""
