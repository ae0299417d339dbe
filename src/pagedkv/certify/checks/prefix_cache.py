"""Prefix reuse visible in ``cached_tokens`` where the server reports it, and ``cache_salt``
isolation (CRT-030, CRT-031; SRV-004, SRV-070).

A server caches whole blocks only, of a size certify cannot ask (16 tokens for vLLM on a GPU,
128 on its CPU backend): a check whose repeat reports no reuse tries again with a longer fresh
prompt, two blocks of 128 and then of 512 tokens and a few more, until reuse shows or the
server refuses the length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedkv.certify.checks.greedy_requests import greedy_body
from pagedkv.certify.client import Answer
from pagedkv.certify.context import CertifyContext
from pagedkv.certify.prompts import PromptSource
from pagedkv.certify.verdicts import CheckResult, Verdict


def cached_tokens(answer: Answer) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a 200 answer; ``None`` when absent."""
    if answer.status != 200 or not isinstance(answer.body, dict):
        return None
    usage = answer.body.get("usage") or {}
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) else None


def until_reuse_shows(
    prompts: list[tuple[int, ...]], attempt: Callable[[tuple[int, ...]], CheckResult]
) -> CheckResult:
    """``attempt`` on each prompt, shortest first, until one is not skipped for want of
    reuse; a refused prompt ends the search (the server takes no longer one)."""
    outcome: CheckResult | None = None
    for prompt in prompts:
        outcome = attempt(prompt)
        if outcome.verdict is not Verdict.SKIP or "refused" in outcome.detail:
            break
    if outcome is None:
        raise ValueError("no prompt to attempt")
    return outcome


#: Block sizes (tokens) whose two blocks a longer prompt covers when a shorter showed no reuse.
LARGER_BLOCKS = (128, 512)


def _fresh_prompts(context: CertifyContext, offset: int) -> list[tuple[int, ...]]:
    """Prompts new to the server (drawn from the run's fresh seed plus ``offset``), shortest
    first: two pages and a few tokens at the profile's largest page size, then two blocks of
    each of :data:`LARGER_BLOCKS` and a few tokens."""
    source = PromptSource(
        context.reference.vocab_size,
        list(context.reference.tokenizer.all_special_ids),
        context.fresh_seed + offset,
    )
    blocks = (max(context.profile.page_sizes), *LARGER_BLOCKS)
    return [source.tokens(2 * block + 5) for block in blocks]


class CachedTokensCheck:
    """A fresh prompt sent twice, one after the other: the first answer must report no cached
    token (nothing was cached), the second at most the prompt's length; prefix reuse is shown
    when it reports more than 0. A server that reports no ``cached_tokens``, or 0 both times
    (no prefix cache), is skipped with that reason."""

    name = "cached_tokens_reported"
    spec_ids: tuple[str, ...] = ("CRT-030", "SRV-004")
    capability = "usage.prompt_tokens_details.cached_tokens with a prefix cache"

    def run(self, context: CertifyContext) -> CheckResult:
        return until_reuse_shows(_fresh_prompts(context, offset=0), lambda p: self._try(context, p))

    def _try(self, context: CertifyContext, prompt: tuple[int, ...]) -> CheckResult:
        body = greedy_body(context.model, prompt, 2)
        first = context.client.post("/completions", body)
        if 400 <= first.status < 500:
            return self._skip(f"a {len(prompt)}-token prompt refused with {first.status}")
        second = context.client.post("/completions", body)
        before, after = cached_tokens(first), cached_tokens(second)
        if before is None or after is None:
            return self._skip("no cached_tokens reported")
        if before != 0:
            detail = f"a prompt never sent before reports {before} cached tokens"
            return self._result(Verdict.FAIL, detail, body)
        if after > len(prompt):
            detail = f"{after} cached tokens of a {len(prompt)}-token prompt"
            return self._result(Verdict.FAIL, detail, body)
        if after == 0:
            return self._skip(f"a repeated {len(prompt)}-token prompt reports 0 cached tokens")
        return self._result(Verdict.PASS, f"repeat reports {after} of {len(prompt)} cached", None)

    def _skip(self, detail: str) -> CheckResult:
        return self._result(Verdict.SKIP, detail, None)

    def _result(self, verdict: Verdict, detail: str, body: dict[str, Any] | None) -> CheckResult:
        return CheckResult(self.name, self.spec_ids, self.capability, verdict, detail, None, body)


class CacheSaltCheck:
    """A fresh prompt sent with one ``cache_salt``, then with another, then with the first
    again: the other salt must report no cached token (it would tell one tenant what another
    sent); the first salt's repeat shows reuse still works within a salt. Skipped when the
    server refuses ``cache_salt`` or reports no reuse at all."""

    name = "cache_salt_isolation"
    spec_ids: tuple[str, ...] = ("CRT-031", "SRV-070", "SRV-101")
    capability = "cache_salt and cached_tokens"

    def run(self, context: CertifyContext) -> CheckResult:
        return until_reuse_shows(_fresh_prompts(context, offset=1), lambda p: self._try(context, p))

    def _try(self, context: CertifyContext, prompt: tuple[int, ...]) -> CheckResult:
        salted = {**greedy_body(context.model, prompt, 2), "cache_salt": "certify-tenant-a"}
        other = {**salted, "cache_salt": "certify-tenant-b"}
        first = context.client.post("/completions", salted)
        if 400 <= first.status < 500:
            return self._skip(f"cache_salt ({len(prompt)} tokens) refused with {first.status}")
        crossed = context.client.post("/completions", other)
        again = context.client.post("/completions", salted)
        leaked, reused = cached_tokens(crossed), cached_tokens(again)
        if leaked is None or reused is None:
            return self._skip("no cached_tokens reported")
        if leaked != 0:
            detail = f"another salt reports {leaked} cached tokens of the first salt's prompt"
            return self._result(Verdict.FAIL, detail, other)
        if reused == 0:
            return self._skip(f"the same salt reports no reuse of {len(prompt)} tokens either")
        return self._result(
            Verdict.PASS, f"other salt 0 cached, same salt {reused} of {len(prompt)}", None
        )

    def _skip(self, detail: str) -> CheckResult:
        return self._result(Verdict.SKIP, detail, None)

    def _result(self, verdict: Verdict, detail: str, body: dict[str, Any] | None) -> CheckResult:
        return CheckResult(self.name, self.spec_ids, self.capability, verdict, detail, None, body)
