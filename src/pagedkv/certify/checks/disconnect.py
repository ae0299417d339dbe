"""Clients that go away mid-stream or before their answer (CRT-040, CRT-041; SRV-020,
SRV-021, SRV-022)."""

from __future__ import annotations

import time
from typing import Any

from pagedkv.certify.checks.greedy_requests import greedy_body, run_greedy
from pagedkv.certify.context import CertifyContext
from pagedkv.certify.metrics import KV_USAGE, sample_sum
from pagedkv.certify.prompts import PromptSource
from pagedkv.certify.verdicts import CheckResult, Verdict, result_of

#: Tokens each left stream asks for: far more than arrive before its client goes away.
LONG_STREAM_TOKENS = 128
#: Seconds between two reads of ``/metrics`` while waiting.
POLL_S = 0.1


def _disconnect_all(context: CertifyContext, seed: int) -> tuple[dict[str, Any], list[int]]:
    """Long streamed requests, as many as the profile's same-prompt clients, each left after
    its first event; ``(one body, the statuses)``."""
    source = PromptSource(
        context.reference.vocab_size, list(context.reference.tokenizer.all_special_ids), seed
    )
    bodies = [
        {**greedy_body(context.model, source.tokens(12), LONG_STREAM_TOKENS), "stream": True}
        for _ in range(context.profile.same_prompt_clients)
    ]
    statuses = context.in_parallel(
        lambda body: context.client.open_stream_and_leave("/completions", body), bodies
    )
    return bodies[0], statuses


def wait_for_idle_kv(context: CertifyContext, idle: float) -> tuple[bool, str]:
    """Read ``/metrics`` every :data:`POLL_S` seconds for up to the profile's ``settle_s``
    until the KV usage is back to ``idle``; ``(whether it came back, one line)``."""
    deadline = time.monotonic() + context.profile.settle_s
    usage: float | None = None
    while time.monotonic() < deadline:
        text = context.client.metrics()
        usage = sample_sum(text, KV_USAGE) if text is not None else None
        if usage is not None and usage <= idle:
            return True, f"{KV_USAGE} back to {usage:g} (idle {idle:g})"
        time.sleep(POLL_S)
    return False, f"{KV_USAGE} {usage} after {context.profile.settle_s:g} s, idle {idle:g}"


class DisconnectCheck:
    """Clients leave long streams after their first event; the server must then answer a
    greedy request with the reference's text."""

    name = "disconnect_mid_stream"
    spec_ids: tuple[str, ...] = ("CRT-040", "SRV-020")
    capability = "stream: true on /completions"

    def run(self, context: CertifyContext) -> CheckResult:
        _, statuses = _disconnect_all(context, seed=50)
        if any(400 <= s < 500 for s in statuses):
            return self._result(Verdict.SKIP, f"streams refused: {statuses}", None)
        probe = PromptSource(
            context.reference.vocab_size, list(context.reference.tokenizer.all_special_ids), 51
        ).tokens(9)
        context.reference.greedy(probe, context.profile.new_tokens)
        after = run_greedy(context, probe)
        if after.verdict is not Verdict.PASS:
            detail = f"after {len(statuses)} disconnects: {after.detail}"
            return self._result(Verdict.FAIL, detail, after.body)
        return self._result(
            Verdict.PASS, f"answers token-exact after {len(statuses)} disconnects", None
        )

    def _result(self, verdict: Verdict, detail: str, body: dict[str, Any] | None) -> CheckResult:
        return CheckResult(self.name, self.spec_ids, self.capability, verdict, detail, None, body)


class DisconnectFreesKVCheck:
    """``vllm:kv_cache_usage_perc`` comes back to its idle value (read before) within the
    profile's ``settle_s`` seconds of clients leaving long streams. Skipped where ``/metrics``
    does not report it."""

    name = "disconnect_frees_kv"
    spec_ids: tuple[str, ...] = ("CRT-041", "SRV-020", "SRV-022")
    capability = f"/metrics with {KV_USAGE}"

    def run(self, context: CertifyContext) -> CheckResult:
        text = context.client.metrics()
        idle = sample_sum(text, KV_USAGE) if text is not None else None
        if idle is None:
            return self._result(Verdict.SKIP, f"/metrics reports no {KV_USAGE}", None)
        body, statuses = _disconnect_all(context, seed=52)
        if any(400 <= s < 500 for s in statuses):
            return self._result(Verdict.SKIP, f"streams refused: {statuses}", None)
        back, detail = wait_for_idle_kv(context, idle)
        return self._result(Verdict.PASS if back else Verdict.FAIL, detail, None if back else body)

    def _result(self, verdict: Verdict, detail: str, body: dict[str, Any] | None) -> CheckResult:
        return CheckResult(self.name, self.spec_ids, self.capability, verdict, detail, None, body)


#: Seconds a client waits for a long non-streamed answer before it goes away: far less than
#: 128 decode steps take on any server.
LEAVE_AFTER_S = 0.05


class LeaveBeforeAnswerCheck:
    """Clients send long non-streamed requests and go away :data:`LEAVE_AFTER_S` seconds
    later; ``vllm:kv_cache_usage_perc`` must come back to its idle value within the profile's
    ``settle_s``. Skipped where ``/metrics`` does not report it, or where every answer came
    before its client left."""

    name = "leave_before_answer_frees_kv"
    spec_ids: tuple[str, ...] = ("SRV-021", "SRV-022")
    capability = f"/metrics with {KV_USAGE}"

    def run(self, context: CertifyContext) -> CheckResult:
        text = context.client.metrics()
        idle = sample_sum(text, KV_USAGE) if text is not None else None
        if idle is None:
            return result_of(self, Verdict.SKIP, f"/metrics reports no {KV_USAGE}")
        source = PromptSource(
            context.reference.vocab_size, list(context.reference.tokenizer.all_special_ids), 53
        )
        bodies = [
            greedy_body(context.model, source.tokens(12), LONG_STREAM_TOKENS)
            for _ in range(context.profile.same_prompt_clients)
        ]
        left = context.in_parallel(
            lambda body: context.client.post_and_leave("/completions", body, LEAVE_AFTER_S),
            bodies,
        )
        if not any(left):
            return result_of(self, Verdict.SKIP, "every answer came before its client left")
        back, detail = wait_for_idle_kv(context, idle)
        detail = f"{sum(left)} clients left; {detail}"
        verdict = Verdict.PASS if back else Verdict.FAIL
        return result_of(self, verdict, detail, None if back else bodies[0])
