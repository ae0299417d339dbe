"""``/tokenize``, ``/detokenize`` and ``/version``, with vLLM's request and response bodies.

Tokenization runs on the text worker, apart from the engine thread (SRV-115), through the same
path as a generation request, so ``/tokenize`` gives exactly the token ids (and count) that
request would be charged, and refuses a text too long to fit just as it would be (SRV-116).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from pagedkv import __version__
from pagedkv.entrypoints.server.async_engine import ChatPrompt, PromptInput
from pagedkv.entrypoints.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionResponse,
)
from pagedkv.entrypoints.server.request_checks import check_request
from pagedkv.entrypoints.server.state import check_model, server_state

router = APIRouter()


@router.post("/tokenize")
async def tokenize(
    body: TokenizeCompletionRequest | TokenizeChatRequest, request: Request
) -> TokenizeResponse:
    """The token ids of a text (as ``/v1/completions`` encodes it) or of a conversation (as
    ``/v1/chat/completions`` renders it)."""
    state = server_state(request)
    check_request(body)
    check_model(state, body.model)
    prompt: PromptInput
    if isinstance(body, TokenizeChatRequest):
        prompt = ChatPrompt(tuple(m.template_message() for m in body.messages))
    else:
        prompt = body.prompt
    tokens = await state.engine.tokenize(prompt)
    strs = await state.engine.detokenize(tokens, each=True) if body.return_token_strs else None
    # The tokenizer's own ints: not validated again, one by one (SRV-141).
    return TokenizeResponse.model_construct(
        count=len(tokens),
        max_model_len=state.engine.max_model_len,
        tokens=tokens,
        token_strs=strs,
    )


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """The text of token ids, special tokens skipped; ids outside the vocabulary decode to
    nothing, as in the tokenizer."""
    state = server_state(request)
    check_request(body)
    check_model(state, body.model)
    (text,) = await state.engine.detokenize(body.tokens)
    return DetokenizeResponse(prompt=text)


@router.get("/version")
async def version() -> VersionResponse:
    """The pagedkv version serving this API."""
    return VersionResponse(version=__version__)
