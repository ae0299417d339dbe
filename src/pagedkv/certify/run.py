"""A certify run: every check of the profile against one server, in order."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pagedkv.certify.checks.bad_input import BadInputCheck
from pagedkv.certify.checks.chat import ChatCheck, ChatLogprobsCheck
from pagedkv.certify.checks.disconnect import (
    DisconnectCheck,
    DisconnectFreesKVCheck,
    LeaveBeforeAnswerCheck,
)
from pagedkv.certify.checks.errors import (
    ContextLengthCheck,
    ErrorBodyCheck,
    InvalidUnicodeCheck,
    ParamErrorsCheck,
)
from pagedkv.certify.checks.greedy_paging import (
    LongConcurrentCheck,
    PageBoundaryCheck,
    SamePromptCheck,
)
from pagedkv.certify.checks.logprobs import LogprobsCheck, PromptLogprobsCheck
from pagedkv.certify.checks.poisoned import PoisonedNeighbourCheck
from pagedkv.certify.checks.prefix_cache import CachedTokensCheck, CacheSaltCheck
from pagedkv.certify.checks.prompt_shapes import PromptShapesCheck
from pagedkv.certify.checks.request_fields import (
    EchoCheck,
    LogitBiasCheck,
    MinTokensCheck,
    ParallelChoicesCheck,
    StopStringCheck,
    StopTokenCheck,
    UnknownFieldCheck,
)
from pagedkv.certify.checks.seeded import SeededSamplingCheck
from pagedkv.certify.checks.served_model import ServedModelCheck
from pagedkv.certify.checks.streaming import StreamAddsUpCheck
from pagedkv.certify.checks.tokenize import TokenizeCheck
from pagedkv.certify.checks.usage import UsageCheck
from pagedkv.certify.client import ServerClient
from pagedkv.certify.context import CertifyContext, Check
from pagedkv.certify.profile import FULL, QUICK
from pagedkv.certify.reference import Reference
from pagedkv.certify.report import CertifyReport


@dataclass(frozen=True, slots=True)
class CertifyOptions:
    """What a run is asked.

    Attributes:
        url: the server's base URL, ending in ``/v1``.
        model_dir: the checkpoint the server serves.
        served_model_name: the name to give as ``model``; ``None``: the first ``/models`` lists.
        quick: the quick profile rather than the full one.
    """

    url: str
    model_dir: Path
    served_model_name: str | None = None
    quick: bool = False


def all_checks() -> list[Check]:
    """Every check, in the order a run asks them."""
    return [
        ServedModelCheck(),
        PageBoundaryCheck(),
        SamePromptCheck(),
        LongConcurrentCheck(),
        PromptShapesCheck(),
        UsageCheck(),
        StopStringCheck(),
        StopTokenCheck(),
        MinTokensCheck(),
        ParallelChoicesCheck(),
        EchoCheck(),
        LogitBiasCheck(),
        UnknownFieldCheck(),
        StreamAddsUpCheck(),
        ChatCheck(),
        ChatLogprobsCheck(),
        TokenizeCheck(),
        BadInputCheck(),
        ErrorBodyCheck(),
        ParamErrorsCheck(),
        ContextLengthCheck(),
        InvalidUnicodeCheck(),
        CachedTokensCheck(),
        CacheSaltCheck(),
        LogprobsCheck(),
        PromptLogprobsCheck(),
        SeededSamplingCheck(),
        PoisonedNeighbourCheck(),
        DisconnectCheck(),
        DisconnectFreesKVCheck(),
        LeaveBeforeAnswerCheck(),
    ]


def certify(options: CertifyOptions, checks: Sequence[Check] | None = None) -> CertifyReport:
    """Run ``checks`` (default: :func:`all_checks`) against the server.

    Raises:
        ServerUnreachable: the server does not answer.
    """
    client = ServerClient(options.url)
    model = options.served_model_name or client.first_model()
    reference = Reference(options.model_dir)
    profile = QUICK if options.quick else FULL
    context = CertifyContext(client, reference, model, profile, secrets.randbits(31))
    results = tuple(check.run(context) for check in (checks or all_checks()))
    return CertifyReport(options.url, str(options.model_dir), model, profile.name, results)
