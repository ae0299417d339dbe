"""The served model: listed by ``/v1/models``, the default of a request without ``model``,
the only name accepted; ``/health`` answers (SRV-012, SRV-030, SRV-050)."""

from __future__ import annotations

from pagedkv.certify.checks.errors import body_problem
from pagedkv.certify.checks.greedy_requests import greedy_body
from pagedkv.certify.context import CertifyContext
from pagedkv.certify.verdicts import CheckResult, Verdict, result_of

#: A model name no server serves.
UNKNOWN_MODEL = "pagedkv-certify-no-such-model"


class ServedModelCheck:
    """``GET /v1/models`` lists the served name and ``GET /health`` answers 200; a request
    without ``model`` is answered 200 naming the served model; a request naming another model
    is answered 404 with OpenAI's error body."""

    name = "served_model"
    spec_ids: tuple[str, ...] = ("SRV-012", "SRV-030", "SRV-050")
    capability = "/completions"

    def run(self, context: CertifyContext) -> CheckResult:
        models = context.client.get("/models")
        listed = (
            [m.get("id") for m in (models.body or {}).get("data", []) if isinstance(m, dict)]
            if isinstance(models.body, dict)
            else []
        )
        if models.status != 200 or context.model not in listed:
            detail = f"/v1/models answered {models.status} listing {listed!r}"
            return result_of(self, Verdict.FAIL, detail)
        health = context.client.get("/health", root=True)
        if health.status != 200:
            return result_of(self, Verdict.FAIL, f"/health answered {health.status}")
        body = greedy_body(context.model, (1, 2, 3), 2)
        del body["model"]
        answer = context.client.post("/completions", body)
        named = answer.body.get("model") if isinstance(answer.body, dict) else None
        if answer.status != 200 or named != context.model:
            detail = f"without model: answered {answer.status} naming {named!r}"
            return result_of(self, Verdict.FAIL, detail, body)
        other = {**body, "model": UNKNOWN_MODEL}
        problem = body_problem(context.client.post("/completions", other), 404)
        if problem is not None:
            return result_of(self, Verdict.FAIL, f"unknown model: {problem}", other)
        return result_of(self, Verdict.PASS, f"{context.model!r} listed, default and only")
