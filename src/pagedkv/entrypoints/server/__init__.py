"""The OpenAI-compatible HTTP server: :func:`pagedkv.entrypoints.server.app.create_app`."""
