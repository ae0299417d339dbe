"""The ``pagedkv`` command line: :mod:`.main` parses it and dispatches to a command's module
(``demo``, ``generate``, ``serve``; ``bench`` lives in :mod:`pagedkv.bench`); the flags that
build an engine are shared in :mod:`.engine_args`."""
