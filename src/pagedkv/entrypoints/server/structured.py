"""A request's structured-output constraint, from whichever field gave it (SRV-130).

OpenAI's ``response_format``, vLLM's ``structured_outputs`` and vLLM's older ``guided_json``,
``guided_regex``, ``guided_choice`` and ``guided_grammar`` all say the same thing; a request
gives at most one of them (two are a 400 naming the second). The engine compiles the
constraint when the request is submitted; one it cannot compile is a 400 naming the field the
request used (SRV-131).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.engine.structured import StructuredOutputsParams
from pagedkv.entrypoints.server.errors import APIError
from pagedkv.entrypoints.server.protocol import SamplingFields, StructuredOutputsField
from pagedkv.entrypoints.server.request_checks import refused_fields
from pagedkv.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class Constraint:
    """A request's constraint and the request field it came from (for error messages)."""

    params: StructuredOutputsParams
    field: str


def _bad(field: str, message: str) -> APIError:
    return APIError(400, f"{field}: {message}", param=field, code="invalid_structured_outputs")


def _vllm_field(given: StructuredOutputsField) -> StructuredOutputsParams:
    """vLLM's ``structured_outputs`` object as engine parameters.

    Raises:
        APIError: a field of it this server refuses, or not exactly one constraint.
    """
    for name, (reason, neutral) in refused_fields(type(given)).items():
        value = getattr(given, name)
        if value is not None and value not in neutral:
            field = f"structured_outputs.{name}"
            raise APIError(
                400,
                f"{field} is not supported by this server: {reason}",
                param=field,
                code="unsupported_field",
            )
    try:
        return StructuredOutputsParams(
            json=given.json_schema,
            regex=given.regex,
            choice=given.choice,
            grammar=given.grammar,
            json_object=given.json_object,
            disable_any_whitespace=given.disable_any_whitespace,
        )
    except InvalidRequest as exc:
        raise _bad("structured_outputs", str(exc)) from None


def _candidates(body: SamplingFields) -> list[tuple[str, StructuredOutputsParams]]:
    """Every constraint the request gives, with its field, in declaration order."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    try:
        fmt = body.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise _bad("response_format", "json_schema needs its schema")
            schema = fmt.json_schema.json_schema
            found.append(("response_format", StructuredOutputsParams(json=schema)))
        if body.structured_outputs is not None:
            found.append(("structured_outputs", _vllm_field(body.structured_outputs)))
        if body.guided_json is not None:
            found.append(("guided_json", StructuredOutputsParams(json=body.guided_json)))
        if body.guided_regex is not None:
            found.append(("guided_regex", StructuredOutputsParams(regex=body.guided_regex)))
        if body.guided_choice is not None:
            found.append(("guided_choice", StructuredOutputsParams(choice=body.guided_choice)))
        if body.guided_grammar is not None:
            found.append(("guided_grammar", StructuredOutputsParams(grammar=body.guided_grammar)))
    except InvalidRequest as exc:
        raise _bad(_field_of(body, found), str(exc)) from None
    return found


def _field_of(body: SamplingFields, found: list[tuple[str, StructuredOutputsParams]]) -> str:
    """The field whose value was being read when it proved invalid: the first one set that
    is not yet in ``found``."""
    done = {name for name, _ in found}
    for name in (
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    ):
        if getattr(body, name) is not None and name not in done:
            return name
    return "structured_outputs"


def request_constraint(body: SamplingFields) -> Constraint | None:
    """The request's structured-output constraint, ``None`` without one.

    Raises:
        APIError: 400 for a malformed constraint or two of them in one request.
    """
    found = _candidates(body)
    if not found:
        return None
    if len(found) > 1:
        first, second = found[0][0], found[1][0]
        raise APIError(
            400,
            f"{second} cannot be given with {first}: a request takes one structured-output "
            "constraint",
            param=second,
            code="invalid_structured_outputs",
        )
    field, params = found[0]
    return Constraint(params, field)
