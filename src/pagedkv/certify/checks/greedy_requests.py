"""Sending greedy completions and judging them against the reference (CRT-010, CRT-011)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedkv.certify.context import CertifyContext
from pagedkv.certify.divergence import first_divergence
from pagedkv.certify.reference import Reference, ReferenceRun
from pagedkv.certify.verdicts import CheckResult, Divergence, Verdict


def greedy_body(model: str, prompt: tuple[int, ...], max_tokens: int) -> dict[str, Any]:
    """A greedy completion of exactly ``max_tokens`` tokens (EOS ignored) of a token-id
    prompt: the request a divergence report reproduces."""
    return {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


@dataclass(frozen=True, slots=True)
class GreedyCase:
    """One greedy request's outcome.

    Attributes:
        body: the request sent.
        verdict: pass, fail or tie; skip when the server refused it with a 4xx.
        detail: one line.
        divergence: where the text left the reference's, if it did.
    """

    body: dict[str, Any]
    verdict: Verdict
    detail: str
    divergence: Divergence | None = None


def run_greedy(context: CertifyContext, prompt: tuple[int, ...]) -> GreedyCase:
    """Send one greedy request and compare its text with the reference's.

    Precondition: the reference of ``prompt`` is already computed (so threads only read it).
    """
    max_tokens = context.profile.new_tokens
    body = greedy_body(context.model, prompt, max_tokens)
    answer = context.client.post("/completions", body)
    if 400 <= answer.status < 500:
        return GreedyCase(body, Verdict.SKIP, f"refused with {answer.status}: {answer.text[:200]}")
    if answer.status != 200:
        return GreedyCase(body, Verdict.FAIL, f"answered {answer.status}: {answer.text[:200]}")
    try:
        text = str(answer.body["choices"][0]["text"])
    except (TypeError, KeyError, IndexError):
        return GreedyCase(body, Verdict.FAIL, f"no choices[0].text in {answer.text[:200]}")
    verdict, detail, divergence = judge(
        context.reference, context.reference.greedy(prompt, max_tokens), text
    )
    return GreedyCase(body, verdict, detail, divergence)


def judge(
    reference: Reference, run: ReferenceRun, text: str
) -> tuple[Verdict, str, Divergence | None]:
    """``text`` against the reference's ``run``: pass when equal; at the first diverging
    token, tie when the reference's top-2 margin there is within the dtype's tie tolerance,
    else fail (CRT-011)."""
    divergence = first_divergence(reference, run, text)
    if divergence is None:
        return Verdict.PASS, "token-exact", None
    where = (
        f"token {divergence.index}: reference {divergence.reference_text!r}, "
        f"server {divergence.server_text!r} (top-2 margin {divergence.margin:.4g})"
    )
    if divergence.margin <= reference.tie_tolerance:
        return Verdict.TIE, f"tie at {where}", divergence
    return Verdict.FAIL, f"differs at {where}", divergence


def summarize(
    name: str, spec_ids: tuple[str, ...], capability: str, cases: list[GreedyCase]
) -> CheckResult:
    """One verdict for many cases: the first fail if any, else the first skip (the capability
    is missing), else the first tie, else pass."""
    for verdict in (Verdict.FAIL, Verdict.SKIP, Verdict.TIE):
        found = [c for c in cases if c.verdict is verdict]
        if found:
            first = found[0]
            return CheckResult(
                name,
                spec_ids,
                capability,
                verdict,
                f"{len(found)} of {len(cases)} requests {verdict.value}; first: {first.detail}",
                first.divergence,
                first.body,
            )
    return CheckResult(
        name, spec_ids, capability, Verdict.PASS, f"{len(cases)} requests token-exact"
    )
