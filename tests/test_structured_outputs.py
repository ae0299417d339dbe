"""Structured outputs in the engine (specs/engine.md ENG-190..ENG-196), on a tiny seeded Qwen3
checkpoint whose random weights would write anything: every output that parses or matches is
the grammar's doing."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from serving_models import tool_chat_model

from pagedkv import LLM, SamplingParams, StructuredOutputsParams
from pagedkv.engine.grammar import GrammarCompiler
from pagedkv.engine.outputs import FinishReason
from pagedkv.engine.structured import InvalidStructuredOutputs
from pagedkv.errors import InvalidRequest

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "ok", "role"],
    "additionalProperties": False,
}
JSON = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tool_chat_model(tmp_path_factory.mktemp("structured-model"))


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[LLM]:
    with LLM(str(model_dir), num_pages=128, page_size=8, max_model_len=512) as engine:
        yield engine


def run(llm: LLM, params: SamplingParams, prompt: str = "hello") -> list[Any]:
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return list(out.outputs)


def check_json(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.spec("ENG-190")
def test_schema_outputs_validate_at_temperature_one(llm: LLM) -> None:
    """Twenty samples at temperature 1.0 all parse and validate, and end by the grammar.
    Catches: a mask not applied (random tokens never parse), or applied to the wrong row."""
    outputs = run(
        llm, SamplingParams(n=20, temperature=1.0, seed=3, max_tokens=200, structured_outputs=JSON)
    )
    for completion in outputs:
        assert completion.finish_reason is FinishReason.STOP, completion.text
        check_json(completion.text)


@pytest.mark.spec("ENG-190")
@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        (
            StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"),
            lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t),
        ),
        (
            StructuredOutputsParams(choice=["yes", "no", "maybe"]),
            lambda t: t in ("yes", "no", "maybe"),
        ),
        (
            StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
            lambda t: isinstance(json.loads(t), dict),
        ),
        (
            StructuredOutputsParams(grammar='start: "say " WORD\nWORD: /[a-c]{1,4}/'),
            lambda t: re.fullmatch(r"say [a-c]{1,4}", t),
        ),
    ],
    ids=["regex", "choice", "json_object", "lark"],
)
def test_every_kind_of_constraint_holds(llm: LLM, constraint: Any, check: Any) -> None:
    """Each kind of constraint, sampled eight times: every completion that stops matches.
    Catches: a kind compiled as another, or its matcher ignored."""
    outputs = run(
        llm,
        SamplingParams(n=8, temperature=1.0, seed=5, max_tokens=120, structured_outputs=constraint),
    )
    stopped = [c for c in outputs if c.finish_reason is FinishReason.STOP]
    assert stopped, [c.text for c in outputs]
    for completion in stopped:
        assert check(completion.text), completion.text


@pytest.mark.spec("ENG-190")
def test_one_constraint_exactly() -> None:
    """None or two constraints are refused naming what was given. Catches: the second one
    silently dropped."""
    with pytest.raises(InvalidRequest, match=r"exactly one.*regex, choice"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(InvalidRequest, match="got none"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequest, match="structured_outputs must be"):
        SamplingParams(structured_outputs={"json": {}})  # type: ignore[arg-type]


@pytest.mark.spec("ENG-191")
def test_unconstrained_rows_sample_as_alone(llm: LLM) -> None:
    """A seeded unconstrained request gives the same tokens alone and beside constrained
    ones. Catches: a mask applied to every row of the batch, or shifted by one row."""
    free = SamplingParams(temperature=1.0, seed=11, max_tokens=24)
    alone = llm.generate(["hello"], free, use_tqdm=False)[0].outputs[0].token_ids
    constrained = SamplingParams(temperature=1.0, seed=12, max_tokens=24, structured_outputs=JSON)
    outs = llm.generate(
        ["hello", "hello", "hello"], [constrained, free, constrained], use_tqdm=False
    )
    assert outs[1].outputs[0].token_ids == alone


@pytest.mark.spec("ENG-192")
def test_composes_with_seed_stream_penalties_bias_and_prefix_caching(
    llm: LLM, model_dir: Path
) -> None:
    """Seeded constrained samples repeat exactly (generate twice, and streamed through the
    engine), with penalties and a bias they still validate, and prefix caching off gives the
    same tokens. Catches: matchers shared between samples or requests, state left from a
    previous request, a control applied after the mask re-allowing a refused token."""
    params = SamplingParams(n=3, temperature=1.0, seed=21, max_tokens=48, structured_outputs=JSON)
    first = [c.token_ids for c in run(llm, params)]
    assert [c.token_ids for c in run(llm, params)] == first
    assert len({tuple(t) for t in first}) > 1  # each sample its own draw and its own matcher
    streamed: dict[int, list[int]] = {}
    for output in llm.engine.stream("hello", params):
        for completion in output.outputs:
            streamed[completion.index] = completion.token_ids
    assert [streamed[i] for i in range(3)] == first
    controlled = SamplingParams(
        n=3,
        temperature=1.0,
        seed=2,
        max_tokens=120,
        presence_penalty=1.5,
        frequency_penalty=1.0,
        repetition_penalty=1.3,
        logit_bias={5: 50.0, 6: 50.0},
        structured_outputs=JSON,
    )
    for completion in run(llm, controlled):
        check_json(completion.text)
    with LLM(
        str(model_dir), num_pages=128, page_size=8, max_model_len=512, enable_prefix_caching=False
    ) as uncached:
        assert [c.token_ids for c in run(uncached, params)] == first


@pytest.mark.spec("ENG-192")
def test_stop_strings_cut_inside_the_grammar(llm: LLM) -> None:
    """A stop string ends a constrained output where it appears, as for any other.
    Catches: a grammar end overriding the stop string's cut."""
    (completion,) = run(
        llm,
        SamplingParams(
            temperature=0,
            max_tokens=40,
            stop=["-"],
            structured_outputs=StructuredOutputsParams(regex=r"[0-9]{2}-[a-z]{2}"),
        ),
    )
    assert completion.stop_reason == "-"
    assert re.fullmatch(r"[0-9]{2}", completion.text)


@pytest.mark.spec("ENG-193")
def test_preemption_keeps_the_grammar_state(model_dir: Path) -> None:
    """Six seeded constrained requests on a pool too small for all of them are preempted
    and recomputed, and give exactly the tokens they give on a large pool, all valid.
    Catches: a matcher reset on preemption (the recomputed output then restarts the
    grammar mid-document and stops parsing) or fed the recomputed tokens twice."""
    params = [
        SamplingParams(temperature=1.0, seed=40 + i, max_tokens=40, structured_outputs=JSON)
        for i in range(6)
    ]
    prompts = ["hello"] * 6
    with LLM(str(model_dir), num_pages=256, page_size=4, max_model_len=256) as roomy:
        want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    with LLM(str(model_dir), num_pages=16, page_size=4, max_model_len=64) as tight:
        outs = tight.generate(prompts, params, use_tqdm=False)
        assert tight.engine.stats().preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == want
    for out in outs:
        if out.outputs[0].finish_reason is FinishReason.STOP:
            check_json(out.outputs[0].text)


@pytest.mark.spec("ENG-193")
def test_a_matcher_out_of_step_is_rebuilt_from_the_tokens(llm: LLM) -> None:
    """A matcher given a history it never saw (as after a fork, or a lost state) rebuilds
    itself from the tokens: its mask equals a fresh matcher's fed the same tokens.
    Catches: a matcher that only ever appends, which would apply a stale state."""
    tokenizer = llm.get_tokenizer()
    compiler = GrammarCompiler(
        tokenizer.backend_tokenizer.to_str(), len(tokenizer), [tokenizer.eos_token_id]
    )
    grammar = compiler.compile(JSON)
    prefix = tokenizer.encode('{"name":"ab","age":4', add_special_tokens=False)
    other = tokenizer.encode('{"name":"xyz","age":7', add_special_tokens=False)
    moved = compiler.matcher(grammar)
    moved.sync(prefix)
    moved.sync(other)  # not a continuation of prefix: rebuilt
    fresh = compiler.matcher(grammar)
    fresh.sync(other)
    assert moved.consumed == list(other)
    assert bool((moved.bitmask() == fresh.bitmask()).all())
    with pytest.raises(InvalidStructuredOutputs, match="breaks the grammar"):
        compiler.matcher(grammar).sync(tokenizer.encode("[1]", add_special_tokens=False))


@pytest.mark.spec("ENG-194")
@pytest.mark.parametrize(
    ("constraint", "problem"),
    [
        (
            StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/x"}}}),
            "json cannot be compiled.*x",
        ),
        (StructuredOutputsParams(regex="a(b"), "regex cannot be compiled"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "grammar cannot be compiled"),
    ],
    ids=["dangling-ref", "bad-regex", "bad-grammar"],
)
def test_a_constraint_that_cannot_compile_is_refused(
    llm: LLM, constraint: StructuredOutputsParams, problem: str
) -> None:
    """Refused at add_request with the field and problem named, nothing queued. Catches: an
    error surfacing mid-generation as a failed request, or a 500 in the server."""
    with pytest.raises(InvalidStructuredOutputs, match=problem):
        llm.engine.add_request("hello", SamplingParams(structured_outputs=constraint))
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")


@pytest.mark.spec("ENG-195")
def test_a_complete_grammar_ends_the_output(llm: LLM) -> None:
    """The tiny model has no EOS id, so nothing but the grammar ends these outputs early:
    each stops when its three digits are written, their text kept. Catches: generation
    running on to max_tokens after the grammar completed, or the last token's text dropped."""
    for completion in run(
        llm,
        SamplingParams(
            n=4,
            temperature=1.0,
            seed=1,
            max_tokens=50,
            structured_outputs=StructuredOutputsParams(regex="[0-9]{3}"),
        ),
    ):
        assert completion.finish_reason is FinishReason.STOP
        assert re.fullmatch("[0-9]{3}", completion.text), completion.text


@pytest.mark.spec("ENG-196")
def test_chat_renders_tools_through_the_template(llm: LLM) -> None:
    """``LLM.chat(tools=...)`` puts the tool declarations in the prompt as Qwen3's template
    writes them. Catches: tools accepted and dropped."""
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    messages = [{"role": "user", "content": "weather?"}]
    (out,) = llm.chat(messages, SamplingParams(max_tokens=2), tools=[tool], use_tqdm=False)
    prompt = llm.get_tokenizer().decode(out.prompt_token_ids)
    assert "<tools>" in prompt
    assert '"get_weather"' in prompt
    (plain,) = llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)
    assert "<tools>" not in llm.get_tokenizer().decode(plain.prompt_token_ids)


@pytest.mark.spec("ENG-191")
def test_packed_masks_unpack_to_exactly_their_tokens() -> None:
    """Unit: the packed mask of tokens {0, 5, 31, 32, 70} refuses every other token, those
    past the packed words included. Catches: a byte or bit order mix-up, which would allow
    the wrong tokens while every test on a lucky vocabulary passes."""
    import torch

    from pagedkv.engine.grammar import refused_tokens

    allowed = [0, 5, 31, 32, 70]
    words = torch.zeros(3, dtype=torch.int32)
    for token in allowed:
        word = int(words[token // 32]) & 0xFFFFFFFF
        word |= 1 << (token % 32)
        words[token // 32] = word - (1 << 32) if word >= 1 << 31 else word
    refused = refused_tokens(words.unsqueeze(0), 100)[0]
    assert refused.shape == (100,)
    assert [t for t in range(100) if not refused[t]] == allowed
