"""``pagedkv certify``: a black-box conformance run against any OpenAI-compatible server.

The server is reached only over HTTP (:mod:`pagedkv.certify.client`); the reference is computed
from the checkpoint the server serves with transformers (:mod:`pagedkv.certify.reference`).
Nothing here imports the engine it certifies (specs/certify.md).
"""
