"""The OpenAI-compatible HTTP server: :func:`pagedkv.server.app.create_app`."""
