"""Streamed text adds up to the non-streamed text, stop strings included, with the finish
reason on the last delta, a usage event when asked and ``[DONE]`` last (CRT-021; SRV-003,
SRV-102)."""

from __future__ import annotations

from typing import Any

from pagedkv.certify.checks.greedy_requests import greedy_body
from pagedkv.certify.context import CertifyContext
from pagedkv.certify.prompts import PromptSource
from pagedkv.certify.verdicts import CheckResult, Verdict, result_of


class StreamAddsUpCheck:
    """The same greedy request sent streamed (``stream_options.include_usage``) and not, then
    again with a stop string cut from the middle of the text: the streamed
    ``choices[0].text`` deltas must concatenate to the non-streamed text, the last delta of
    the choice must carry its finish reason, a usage event must count the tokens, and the
    stream must end with ``[DONE]``."""

    name = "stream_adds_up"
    spec_ids: tuple[str, ...] = ("CRT-021", "SRV-003", "SRV-102")
    capability = "stream: true on /completions"

    def run(self, context: CertifyContext) -> CheckResult:
        source = PromptSource(
            context.reference.vocab_size, list(context.reference.tokenizer.all_special_ids), 24
        )
        body = greedy_body(context.model, source.tokens(9), context.profile.new_tokens)
        first = self._compare(context, body, usage=True)
        if first is not None:
            return first
        text = context.reference.decode(
            context.reference.greedy(tuple(body["prompt"]), context.profile.new_tokens).token_ids
        )
        middle = len(text) // 2
        stopped = {**body, "stop": [text[middle : middle + 3]]} if len(text) > 3 else body
        second = self._compare(context, stopped, usage=False)
        if second is not None:
            return second
        return result_of(self, Verdict.PASS, "streams add up, stop string included")

    def _compare(
        self, context: CertifyContext, body: dict[str, Any], usage: bool
    ) -> CheckResult | None:
        """``None`` if the streamed answer of ``body`` matches the whole one, else why not."""
        whole = context.client.post("/completions", body)
        streamed_body: dict[str, Any] = {**body, "stream": True}
        if usage:
            streamed_body["stream_options"] = {"include_usage": True}
        stream = context.client.stream("/completions", streamed_body)
        if 400 <= stream.status < 500:
            return result_of(self, Verdict.SKIP, f"stream refused with {stream.status}")
        if whole.status != 200 or stream.status != 200:
            detail = f"answered {whole.status} (whole), {stream.status} (streamed)"
            return result_of(self, Verdict.FAIL, detail, streamed_body)
        choice = whole.body["choices"][0]
        streamed = "".join(_delta(event) for event in stream.events)
        problems = []
        if streamed != choice["text"]:
            problems.append(f"streamed {streamed!r} but whole {choice['text']!r}")
        with_choices = [e for e in stream.events if isinstance(e, dict) and e.get("choices")]
        last = with_choices[-1]["choices"][0].get("finish_reason") if with_choices else None
        if last != choice.get("finish_reason"):
            problems.append(
                f"last delta's finish reason {last!r}, whole's {choice.get('finish_reason')!r}"
            )
        if usage:
            counted = [e["usage"] for e in stream.events if isinstance(e, dict) and e.get("usage")]
            if not counted or counted[-1].get("completion_tokens") != len(
                context.reference.greedy(tuple(body["prompt"]), body["max_tokens"]).token_ids
            ):
                problems.append(f"usage events {counted!r}")
        if not stream.done:
            problems.append("no [DONE] at the end")
        if problems:
            return result_of(self, Verdict.FAIL, "; ".join(problems), streamed_body)
        return None


def _delta(event: Any) -> str:
    """The text of the first choice of one completions chunk ('' for a usage-only chunk)."""
    choices = event.get("choices") if isinstance(event, dict) else None
    if not choices:
        return ""
    return str(choices[0].get("text") or "")
