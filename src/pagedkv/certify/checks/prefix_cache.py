"""Prefix reuse visible in ``cached_tokens`` where the server reports it, and ``cache_salt``
isolation (CRT-030, CRT-031)."""

from __future__ import annotations

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


def _fresh_prompt(context: CertifyContext, offset: int) -> tuple[int, ...]:
    """A prompt new to the server (drawn from the run's fresh seed plus ``offset``), several
    pages long at every page size of the profile."""
    source = PromptSource(
        context.reference.vocab_size,
        list(context.reference.tokenizer.all_special_ids),
        context.fresh_seed + offset,
    )
    return source.tokens(2 * max(context.profile.page_sizes) + 5)


class CachedTokensCheck:
    """A fresh prompt sent twice, one after the other: the first answer must report no cached
    token (nothing was cached), the second at most the prompt's length; prefix reuse is shown
    when it reports more than 0. A server that reports no ``cached_tokens``, or 0 both times
    (no prefix cache), is skipped with that reason."""

    name = "cached_tokens_reported"
    spec_ids: tuple[str, ...] = ("CRT-030",)
    capability = "usage.prompt_tokens_details.cached_tokens with a prefix cache"

    def run(self, context: CertifyContext) -> CheckResult:
        prompt = _fresh_prompt(context, offset=0)
        body = greedy_body(context.model, prompt, 2)
        first = context.client.post("/completions", body)
        second = context.client.post("/completions", body)
        before, after = cached_tokens(first), cached_tokens(second)
        if before is None or after is None:
            return self._result(Verdict.SKIP, "no cached_tokens reported", None)
        if before != 0:
            detail = f"a prompt never sent before reports {before} cached tokens"
            return self._result(Verdict.FAIL, detail, body)
        if after > len(prompt):
            detail = f"{after} cached tokens of a {len(prompt)}-token prompt"
            return self._result(Verdict.FAIL, detail, body)
        if after == 0:
            return self._result(Verdict.SKIP, "a repeated prompt reports 0 cached tokens", None)
        return self._result(Verdict.PASS, f"repeat reports {after} of {len(prompt)} cached", None)

    def _result(self, verdict: Verdict, detail: str, body: dict[str, Any] | None) -> CheckResult:
        return CheckResult(self.name, self.spec_ids, self.capability, verdict, detail, None, body)


class CacheSaltCheck:
    """A fresh prompt sent with one ``cache_salt``, then with another, then with the first
    again: the other salt must report no cached token (it would tell one tenant what another
    sent); the first salt's repeat shows reuse still works within a salt. Skipped when the
    server refuses ``cache_salt`` or reports no reuse at all."""

    name = "cache_salt_isolation"
    spec_ids: tuple[str, ...] = ("CRT-031",)
    capability = "cache_salt and cached_tokens"

    def run(self, context: CertifyContext) -> CheckResult:
        prompt = _fresh_prompt(context, offset=1)
        salted = {**greedy_body(context.model, prompt, 2), "cache_salt": "certify-tenant-a"}
        other = {**salted, "cache_salt": "certify-tenant-b"}
        first = context.client.post("/completions", salted)
        if 400 <= first.status < 500:
            return self._result(Verdict.SKIP, f"cache_salt refused with {first.status}", None)
        crossed = context.client.post("/completions", other)
        again = context.client.post("/completions", salted)
        leaked, reused = cached_tokens(crossed), cached_tokens(again)
        if leaked is None or reused is None:
            return self._result(Verdict.SKIP, "no cached_tokens reported", None)
        if leaked != 0:
            detail = f"another salt reports {leaked} cached tokens of the first salt's prompt"
            return self._result(Verdict.FAIL, detail, other)
        if reused == 0:
            return self._result(Verdict.SKIP, "the same salt reports no reuse either", None)
        return self._result(
            Verdict.PASS, f"other salt 0 cached, same salt {reused} of {len(prompt)}", None
        )

    def _result(self, verdict: Verdict, detail: str, body: dict[str, Any] | None) -> CheckResult:
        return CheckResult(self.name, self.spec_ids, self.capability, verdict, detail, None, body)
