"""The ways people use pagedkv: the ``pagedkv`` command line (:mod:`.cli`) and the
OpenAI-compatible HTTP server (:mod:`.server`). Both build engines through a Backend and hold
them only as the Engine Protocol."""
