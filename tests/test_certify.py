"""``pagedkv certify`` against pagedkv's own server on a tiny checkpoint (every check passes),
and against servers made wrong on purpose (a proxy in front of it), each of which fails the
check that covers its fault, with the first diverging token named (specs/certify.md)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from certify_proxy import (
    BareErrorBody,
    BrokenAfterStreams,
    ClaimEveryPromptCached,
    CorruptOneToken,
    DropDone,
    DropErrorParam,
    DropField,
    DropSharedPage,
    DropStreamChunk,
    FailBesidePoison,
    IgnoreCacheSalt,
    LeakKVOnLongRequests,
    LeakKVOnStreams,
    MiscountUsage,
    Mutation,
    RefuseStreams,
    RefuseUnknownFields,
    ReverseChoices,
    ServeAnyModel,
    ServerErrorOnBadInput,
    ShiftLogprobs,
    ShiftTokenize,
    SwapTwoResponses,
    proxy,
)
from server_harness import running, wait_idle
from serving_models import tiny_chat_model

from pagedkv.backend import load_engine
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
from pagedkv.certify.checks.greedy_requests import judge
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
from pagedkv.certify.context import Check
from pagedkv.certify.reference import Reference, ReferenceRun
from pagedkv.certify.report import CertifyReport
from pagedkv.certify.run import CertifyOptions, all_checks, certify
from pagedkv.certify.verdicts import Verdict
from pagedkv.engine.config import EngineConfig
from pagedkv.entrypoints.cli.main import main
from pagedkv.entrypoints.server.app import create_app
from pagedkv.entrypoints.server.async_engine import AsyncEngine

MODEL = "certified-model"
#: Small pages and pool, a small token budget per step: no two of the quick profile's 4 long
#: requests (96 + 8 tokens, 26 pages each) fit in 40 pages together, so the engine preempts
#: whenever two overlap, and each 96-token prompt is prefilled in chunks of at most 48 tokens.
CONFIG = EngineConfig(page_size=4, num_pages=40, max_num_batched_tokens=48, max_model_len=160)
#: The page size of CONFIG, which DropSharedPage loses one of.
PAGE = 4


@dataclass(frozen=True)
class Served:
    url: str
    model_dir: Path
    bridge: AsyncEngine


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model_dir = tiny_chat_model(tmp_path_factory.mktemp("certify-model"))
    app = create_app(load_engine(model_dir, CONFIG), MODEL)
    with running(app) as server:
        yield Served(server.url, model_dir, server.bridge)


def run_against(url: str, served: Served, checks: list[Check]) -> CertifyReport:
    return certify(CertifyOptions(url, served.model_dir, MODEL, quick=True), checks)


def only(report: CertifyReport, name: str) -> Verdict:
    (result,) = [r for r in report.results if r.name == name]
    return result.verdict


@pytest.mark.spec("CRT-002", "CRT-003", "CRT-004", "CRT-010", "CRT-012")
@pytest.mark.spec("CRT-020", "CRT-021", "CRT-022", "CRT-030", "CRT-031")
@pytest.mark.spec("CRT-023", "CRT-024", "CRT-025", "CRT-026", "CRT-027", "CRT-040", "CRT-041")
@pytest.mark.spec("CRT-050", "CRT-051", "CRT-060")
def test_quick_certify_of_pagedkvs_own_server_passes(served: Served, tmp_path: Path) -> None:
    out = tmp_path / "report"
    status = main(
        ["certify", "--url", f"{served.url}/v1", "--model", str(served.model_dir), "--quick"]
        + ["--out", str(out)]
    )
    report = json.loads((out / "certify.json").read_text())
    verdicts = {r["name"]: r["verdict"] for r in report["results"]}
    assert verdicts == {check.name: "pass" for check in all_checks()}, report
    assert len(verdicts) == 31
    assert status == 0
    assert report["passed"] is True
    assert report["served_model"] == MODEL  # found through /v1/models
    assert (
        "| greedy_page_boundaries | CRT-010, CRT-011 | pass |" in (out / "certify.md").read_text()
    )
    stats = wait_idle(served.bridge)
    assert stats.preemptions > 0, "the long requests were meant to make the server preempt"


@pytest.mark.spec("CRT-010", "CRT-011", "CRT-002")
def test_a_lost_page_of_a_shared_prefix_fails_with_the_first_diverging_token(
    served: Served,
) -> None:
    with proxy(served.url, DropSharedPage(PAGE)) as url:
        report = run_against(url, served, [PageBoundaryCheck()])
    (result,) = report.results
    assert result.verdict is Verdict.FAIL, result
    assert result.divergence is not None
    assert result.divergence.reference_text != result.divergence.server_text
    assert result.divergence.margin > 1e-3
    assert result.request is not None
    assert len(result.request["prompt"]) > 2 * PAGE
    markdown = report.to_markdown()
    assert f"First diverging token: index {result.divergence.index}" in markdown
    (written,) = report.to_json()["results"]
    assert written["verdict"] == "fail"
    assert written["request"] == result.request
    assert written["divergence"]["index"] == result.divergence.index
    assert written["divergence"]["server_text"] == result.divergence.server_text
    assert written["divergence"]["margin"] == result.divergence.margin
    assert json.dumps(result.request) in markdown
    assert report.exit_status == 1


@pytest.mark.spec("CRT-010", "CRT-011")
def test_two_concurrent_requests_given_each_others_text_fail(served: Served) -> None:
    with proxy(served.url, SwapTwoResponses()) as url:
        report = run_against(url, served, [PageBoundaryCheck()])
    (result,) = report.results
    assert result.verdict is Verdict.FAIL, result
    assert result.divergence is not None
    assert result.divergence.reference_text != result.divergence.server_text
    assert "2 of 12 requests fail" in result.detail


@pytest.mark.spec("CRT-011", "CRT-012")
@pytest.mark.parametrize("check", [SamePromptCheck(), LongConcurrentCheck()])
def test_one_corrupted_token_fails_at_that_token(served: Served, check: Check) -> None:
    with proxy(served.url, CorruptOneToken()) as url:
        report = run_against(url, served, [check])
    (result,) = report.results
    assert result.verdict is Verdict.FAIL, result
    assert result.divergence is not None
    assert result.divergence.index > 0  # all but its last character is the reference's
    # the server's text from the diverging token on holds the corrupted character
    assert set(result.divergence.server_text) & {"#", "@"}, result.divergence


#: Each check of a certify run, with a server made wrong for it (a proxy in front of pagedkv's
#: own) that it must fail (CRT-007).
FAULTS: list[tuple[Mutation, Check]] = [
    (MiscountUsage(), UsageCheck()),
    (DropStreamChunk(), StreamAddsUpCheck()),
    (ServerErrorOnBadInput(), BadInputCheck()),
    (ClaimEveryPromptCached(), CachedTokensCheck()),
    (IgnoreCacheSalt(), CacheSaltCheck()),
    (DropField("stop"), StopStringCheck()),
    (DropField("stop_token_ids"), StopTokenCheck()),
    (DropField("min_tokens"), MinTokensCheck()),
    (DropField("n"), ParallelChoicesCheck()),
    (DropField("echo"), EchoCheck()),
    (BrokenAfterStreams(), DisconnectCheck()),
    (LeakKVOnStreams(), DisconnectFreesKVCheck()),
    (ShiftLogprobs(), LogprobsCheck()),
    (ShiftLogprobs(), PromptLogprobsCheck()),
    (DropField("seed"), SeededSamplingCheck()),
    (ServeAnyModel(), ServedModelCheck()),
    (ReverseChoices(), PromptShapesCheck()),
    (DropField("logit_bias"), LogitBiasCheck()),
    (RefuseUnknownFields(), UnknownFieldCheck()),
    (DropDone(), StreamAddsUpCheck()),
    (DropField("max_completion_tokens"), ChatCheck()),
    (ShiftLogprobs(), ChatLogprobsCheck()),
    (ShiftTokenize(), TokenizeCheck()),
    (BareErrorBody(), ErrorBodyCheck()),
    (DropErrorParam(), ParamErrorsCheck()),
    (ServerErrorOnBadInput(), ContextLengthCheck()),
    (ServerErrorOnBadInput(), InvalidUnicodeCheck()),
    (FailBesidePoison(), PoisonedNeighbourCheck()),
    (LeakKVOnLongRequests(), LeaveBeforeAnswerCheck()),
]


@pytest.mark.spec("CRT-020", "CRT-021", "CRT-022", "CRT-030", "CRT-031", "CRT-007")
@pytest.mark.spec("CRT-023", "CRT-024", "CRT-025", "CRT-026", "CRT-027", "CRT-040", "CRT-041")
@pytest.mark.spec("CRT-050", "CRT-051", "CRT-060")
@pytest.mark.parametrize(("mutation", "check"), FAULTS)
def test_each_semantic_fault_fails_its_check(
    served: Served, mutation: Mutation, check: Check
) -> None:
    with proxy(served.url, mutation) as url:
        report = run_against(url, served, [check])
    (result,) = report.results
    assert result.verdict is Verdict.FAIL, result
    assert result.request is not None


@pytest.mark.spec("CRT-001", "CRT-003")
def test_a_faithful_proxy_passes_and_an_unreachable_server_is_an_error(
    served: Served, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with proxy(served.url, Mutation()) as url:
        report = run_against(url, served, [UsageCheck(), BadInputCheck()])
    assert [r.verdict for r in report.results] == [Verdict.PASS, Verdict.PASS]
    capsys.readouterr()
    status = main(
        ["certify", "--url", "http://127.0.0.1:1/v1", "--model", str(served.model_dir)]
        + ["--quick", "--out", str(tmp_path)]
    )
    assert status == 1
    assert capsys.readouterr().err == (
        "pagedkv certify: error: GET http://127.0.0.1:1/v1/models: [Errno 111] Connection refused\n"
    )


@pytest.mark.spec("CRT-001", "CRT-003")
def test_a_capability_the_server_lacks_is_skipped_with_the_reason(served: Served) -> None:
    with proxy(served.url, RefuseStreams()) as url:
        report = run_against(url, served, [StreamAddsUpCheck()])
    (result,) = report.results
    assert result.verdict is Verdict.SKIP
    assert "refused with 400" in result.detail
    assert report.exit_status == 0


@pytest.mark.spec("CRT-011")
def test_a_divergence_within_the_tie_tolerance_is_a_tie_with_its_margin(served: Served) -> None:
    reference = Reference(served.model_dir)
    tokens = tuple(reference.tokenizer.encode("def fibonacci(n):"))
    assert len(tokens) >= 3
    other = reference.decode(tokens[:2]) + "#"
    margins = [5.0] * len(tokens)
    margins[2] = reference.tie_tolerance / 2
    tie = ReferenceRun((1,), tokens, tuple(margins))
    verdict, detail, divergence = judge(reference, tie, other)
    assert verdict is Verdict.TIE
    assert divergence is not None
    assert divergence.index == 2
    assert divergence.margin == reference.tie_tolerance / 2
    assert f"{divergence.margin:.4g}" in detail
    margins[2] = 5.0
    verdict, _, divergence = judge(reference, ReferenceRun((1,), tokens, tuple(margins)), other)
    assert verdict is Verdict.FAIL
    assert judge(reference, tie, reference.decode(tokens))[0] is Verdict.PASS


@pytest.mark.spec("CRT-007")
def test_every_check_has_a_server_made_wrong_for_it() -> None:
    """Each check a run asks is failed by at least one proxy of :data:`FAULTS` in the test
    above, so no check (and no SRV requirement it certifies) is one that cannot fail."""
    shown = {check.name for _, check in FAULTS}
    shown |= {PageBoundaryCheck.name, SamePromptCheck.name, LongConcurrentCheck.name}
    assert {check.name for check in all_checks()} <= shown, {
        check.name for check in all_checks()
    } - shown


@pytest.mark.spec("CRT-010")
def test_the_reference_decodes_as_transformers_generate(served: Served) -> None:
    """The reference's cached step-by-step greedy run equals transformers' own greedy
    ``generate`` over the whole sequence: a reference that passes its cache by a name the
    installed transformers does not read (each step then sees one token alone) fails."""
    reference = Reference(served.model_dir)
    prompt = tuple(reference.encode("def fibonacci(n):"))
    run = reference.greedy(prompt, 8)
    generated = reference.model.generate(
        torch.tensor([list(prompt)]),
        do_sample=False,
        max_new_tokens=8,
        min_new_tokens=8,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert tuple(int(t) for t in generated[0, len(prompt) :]) == run.token_ids
