"""vLLM's engine arguments, shapes and priority scheduling (specs/engine.md ENG-180..ENG-189).

The argument table is checked without loading a model where it can be; the shapes and the
scheduler run over the hash stand-in model; a few checks load the embedded model through
``LLM``, as a vLLM script does.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedkv.backend import reference_backend
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.engine_args import (
    CPU_KVCACHE_SPACE_ENV,
    ENGINE_ARGS,
    EngineArgs,
    UnknownEngineArgument,
    UnsupportedEngineArgument,
    engine_args_from_kwargs,
    normalize_dtype,
)
from pagedkv.engine.llm import LLM, run_to_completion
from pagedkv.engine.outputs import Logprob, RequestOutput
from pagedkv.engine.params import InvalidSamplingParams, SamplingParams
from pagedkv.errors import InvalidRequest, UnsupportedPriority
from pagedkv.model_source import resolve_model
from pagedkv.testing.hash_runner import HashRunner

VOCAB = 64
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def hash_engine(**fields: Any) -> LLMEngine:
    config = EngineConfig(**{"page_size": 4, "num_pages": 32, **fields})
    built = reference_backend().create_engine(HashRunner(VOCAB, config.num_pages, 4), config)
    assert isinstance(built, LLMEngine)
    return built


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(seed=0, enforce_eager=True, trust_remote_code=True, gpu_memory_utilization=0.9)


# -- the table ----------------------------------------------------------------------------------


@pytest.mark.spec("ENG-180")
def test_the_table_names_vllm_arguments_each_an_engine_field() -> None:
    """Every row of the table is a field of EngineArgs (a row without one would be a flag
    accepted and dropped), and vLLM's names are all there."""
    names = {spec.name for spec in ENGINE_ARGS}
    fields = set(EngineArgs.__dataclass_fields__)
    assert names <= fields, names - fields
    vllm = {
        "tokenizer",
        "served_model_name",
        "dtype",
        "seed",
        "max_model_len",
        "block_size",
        "enable_prefix_caching",
        "max_num_seqs",
        "max_num_batched_tokens",
        "gpu_memory_utilization",
        "enforce_eager",
        "chat_template",
        "trust_remote_code",
        "scheduling_policy",
        "tensor_parallel_size",
    }
    assert vllm <= names, vllm - names


@pytest.mark.spec("ENG-180", "ENG-183")
def test_engine_arguments_reach_the_engine_config() -> None:
    """Each given argument lands in the EngineConfig; max_model_len left out is the model's
    own (1024 for the embedded model), not a fixed 2048."""
    model_dir = resolve_model(None)
    given = engine_args_from_kwargs(
        None,
        {
            "block_size": 8,
            "max_num_seqs": 5,
            "max_num_batched_tokens": 64,
            "enable_prefix_caching": False,
            "seed": 7,
            "scheduling_policy": "priority",
            "max_model_len": 300,
            "num_pages": 40,
        },
    ).engine_config(model_dir)
    assert given == EngineConfig(
        page_size=8,
        num_pages=40,
        max_num_seqs=5,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        seed=7,
        scheduling_policy="priority",
        max_model_len=300,
    )
    assert EngineArgs().engine_config(model_dir).max_model_len == 1024


@pytest.mark.spec("ENG-181")
def test_unknown_and_unsupported_arguments_are_named() -> None:
    """A misspelt argument is a typed error naming it, not a TypeError; a vLLM argument
    pagedkv does not implement is refused with why, unless given vLLM's neutral value."""
    with pytest.raises(UnknownEngineArgument, match="gpu_memory_utilisation"):
        engine_args_from_kwargs(None, {"gpu_memory_utilisation": 0.5})
    with pytest.raises(UnknownEngineArgument, match="bogus, nonsense"):
        LLM(bogus=1, nonsense=2)
    with pytest.raises(UnsupportedEngineArgument, match=r"swap_space=8.*never swaps"):
        engine_args_from_kwargs(None, {"swap_space": 8})
    with pytest.raises(UnsupportedEngineArgument, match="quantization='awq'"):
        LLM(quantization="awq")
    assert engine_args_from_kwargs(None, {"swap_space": 4, "quantization": None}) == EngineArgs()
    with pytest.raises(UnsupportedEngineArgument, match="served_model_name is an argument of"):
        engine_args_from_kwargs(None, {"served_model_name": "m"})
    with pytest.raises(InvalidRequest, match="page_size=4 and block_size=8"):
        engine_args_from_kwargs(None, {"page_size": 4, "block_size": 8})


@pytest.mark.spec("ENG-182")
def test_dtype_takes_vllm_spellings() -> None:
    """half/float16, float/float32, bfloat16, auto and torch dtypes; anything else named."""
    assert [normalize_dtype(d) for d in ("half", "float16", torch.float16)] == ["float16"] * 3
    assert [normalize_dtype(d) for d in ("float", "float32", torch.float32)] == ["float32"] * 3
    assert normalize_dtype(torch.bfloat16) == normalize_dtype("bfloat16") == "bfloat16"
    assert normalize_dtype("auto") == "auto"
    with pytest.raises(InvalidRequest, match="'fp8'"):
        normalize_dtype("fp8")
    assert EngineArgs(dtype="half").dtype == "float16"


@pytest.mark.spec("ENG-185")
def test_gpu_memory_utilization_on_the_cpu_is_ignored_with_a_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU the pool is sized as vLLM's CPU backend sizes it: a given
    gpu_memory_utilization is ignored with a warning naming it; kv_cache_memory_bytes or
    VLLM_CPU_KVCACHE_SPACE size the pool; neither: 512 pages."""
    model_dir = resolve_model(None)
    monkeypatch.delenv(CPU_KVCACHE_SPACE_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="pagedkv.engine"):
        config = EngineArgs(gpu_memory_utilization=0.5).engine_config(model_dir)
    assert config.num_pages == 512
    assert "gpu_memory_utilization=0.5 is ignored on cpu" in caplog.text
    raw = __import__("json").loads((model_dir / "config.json").read_text())
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    page = 2 * raw["num_hidden_layers"] * raw["num_key_value_heads"] * head_dim * 16 * 4
    sized = EngineArgs(kv_cache_memory_bytes=10 * page + 1).engine_config(model_dir)
    assert sized.num_pages == 10
    monkeypatch.setenv(CPU_KVCACHE_SPACE_ENV, "0.01")
    assert EngineArgs().engine_config(model_dir).num_pages == int(0.01 * (1 << 30)) // page
    assert EngineArgs(num_pages=7).engine_config(model_dir).num_pages == 7  # given wins


# -- LLM ------------------------------------------------------------------------------------------


@pytest.mark.spec("ENG-184", "ENG-188")
def test_vllm_arguments_of_llm_and_its_engine(llm: LLM) -> None:
    """trust_remote_code, enforce_eager and gpu_memory_utilization (on the CPU) are
    accepted; llm_engine is the engine; lora_request=None is accepted and a LoRA refused."""
    assert llm.llm_engine is llm.engine
    assert llm.engine_args.trust_remote_code
    assert llm.engine_args.enforce_eager
    (out,) = llm.generate("def f():", GREEDY, use_tqdm=False, lora_request=None)
    assert out.finished
    with pytest.raises(InvalidRequest, match="lora_request"):
        llm.generate("x", GREEDY, use_tqdm=False, lora_request=object())
    with pytest.raises(UnsupportedPriority, match="priority=2"):
        llm.generate(["x"], GREEDY, use_tqdm=False, priority=[2])
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.spec("ENG-184")
def test_seed_seeds_unseeded_requests() -> None:
    """Two engines of one seed sample the same tokens for unseeded requests; another seed
    samples others."""
    sampled = SamplingParams(max_tokens=12, temperature=1.0)

    def run(seed: int) -> list[list[int]]:
        eut = hash_engine(seed=seed)
        return [o.token_ids for o in run_to_completion(eut, [[1, 2, 3], [4, 5]], sampled)]

    assert run(3) == run(3)
    assert run(3) != run(4)


@pytest.mark.spec("ENG-186")
def test_logprobs_have_vllms_shape(llm: LLM) -> None:
    """logprobs[i][token] is a Logprob with logprob, rank and decoded_token; the chosen token
    is in each dict; token ids are lists; prompt_logprobs likewise (None first)."""
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, prompt_logprobs=2)
    (out,) = llm.generate("def add(a, b):", params, use_tqdm=False)
    completion = out.outputs[0]
    assert isinstance(completion.token_ids, list)
    assert isinstance(out.prompt_token_ids, list)
    assert completion.token_ids + [1] == [*completion.token_ids, 1]
    assert completion.logprobs is not None
    assert len(completion.logprobs) == 4
    tokenizer = llm.get_tokenizer()
    for token, position in zip(completion.token_ids, completion.logprobs, strict=True):
        assert isinstance(position, dict)
        assert token in position
        chosen = position[token]
        assert isinstance(chosen, Logprob)
        assert chosen.rank == 1  # greedy picks the most likely
        assert chosen.decoded_token == tokenizer.decode([token])
        ranks = sorted(lp.rank for lp in position.values() if lp.rank is not None)
        assert ranks == [1, 2, 3]
        assert max(position.values(), key=lambda lp: lp.logprob) is chosen
    sampled = SamplingParams(max_tokens=8, temperature=2.0, seed=1, logprobs=1)
    (hot,) = llm.generate("def add(a, b):", sampled, use_tqdm=False)
    assert hot.outputs[0].logprobs is not None
    for token, position in zip(hot.outputs[0].token_ids, hot.outputs[0].logprobs, strict=True):
        chosen = position[token]
        assert chosen.rank is not None  # computed for a sampled token too, as vLLM's
        above = [lp for t, lp in position.items() if t != token and lp.logprob > chosen.logprob]
        assert chosen.rank >= len(above) + 1
        assert (chosen.rank == 1) == (not above)
    (none,) = llm.generate(
        "x", SamplingParams(max_tokens=2, temperature=0.0, logprobs=0), use_tqdm=False
    )
    assert none.outputs[0].logprobs is not None
    assert [len(p) for p in none.outputs[0].logprobs] == [1, 1]
    assert all(
        p[t].rank == 1 for t, p in zip(none.token_ids, none.outputs[0].logprobs, strict=True)
    )
    prompt = out.prompt_logprobs
    assert prompt is not None
    assert prompt[0] is None
    for token, position in zip(out.prompt_token_ids[1:], prompt[1:], strict=True):
        assert position is not None
        assert token in position
        assert position[token].logprob <= 0.0
        assert position[token].rank is not None


@pytest.mark.spec("ENG-187")
def test_max_tokens_none_fills_the_context() -> None:
    """max_tokens=None generates up to max_model_len less the prompt."""
    eut = hash_engine(max_model_len=20)
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    (out,) = run_to_completion(eut, [[1, 2, 3, 4, 5]], params)
    assert len(out.token_ids) == 15
    assert out.finish_reason == "length"


@pytest.mark.spec("ENG-187")
def test_detokenize_and_special_tokens(llm: LLM) -> None:
    """detokenize=False gives no text (same tokens); skip_special_tokens=False keeps a
    special token's text; the fields pagedkv does not implement are refused naming them."""
    tokenizer = llm.get_tokenizer()
    special = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = {"prompt_token_ids": [special, *tokenizer.encode("x = 1")]}
    plain = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    (text,) = llm.generate(prompt, plain, use_tqdm=False)
    (silent,) = llm.generate(
        prompt, SamplingParams(max_tokens=3, temperature=0.0, detokenize=False), use_tqdm=False
    )
    assert silent.outputs[0].text == ""
    assert silent.token_ids == text.token_ids
    bias = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        logit_bias={special: 100.0},
        skip_special_tokens=False,
        ignore_eos=True,  # an EOS that stops leaves its text out (ENG-090)
    )
    (kept,) = llm.generate(prompt, bias, use_tqdm=False)
    assert kept.token_ids == [special]
    assert kept.text == "<|im_end|>"
    skipped = SamplingParams(
        max_tokens=1, temperature=0.0, logit_bias={special: 100.0}, ignore_eos=True
    )
    (gone,) = llm.generate(prompt, skipped, use_tqdm=False)
    assert gone.text == ""
    for name, value in [
        ("allowed_token_ids", [1, 2]),
        ("bad_words", ["x"]),
        ("spaces_between_special_tokens", False),
        ("truncate_prompt_tokens", 4),
        ("logits_processors", [print]),
    ]:
        with pytest.raises(InvalidSamplingParams, match=f"^{name} is not supported"):
            SamplingParams(**{name: value})
    with pytest.raises(InvalidSamplingParams, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
    # structured_outputs is honored (tests/test_structured_outputs.py); a bare dict is not
    # vLLM's StructuredOutputsParams and is refused naming the field
    with pytest.raises(InvalidSamplingParams, match=r"^structured_outputs must be"):
        SamplingParams(structured_outputs={"json": {}})  # type: ignore[arg-type]


@pytest.mark.spec("ENG-188")
def test_chat_takes_vllms_template_arguments(llm: LLM, tmp_path: Path) -> None:
    """add_generation_prompt=False leaves the assistant's turn unopened;
    continue_final_message continues the last message; chat_template replaces the model's,
    per call or for the LLM."""
    tokenizer = llm.get_tokenizer()
    one = [{"role": "user", "content": "hi"}]
    opened = tokenizer.apply_chat_template(one, add_generation_prompt=True, tokenize=False)
    closed = tokenizer.apply_chat_template(one, add_generation_prompt=False, tokenize=False)
    (a,) = llm.chat(one, GREEDY, use_tqdm=False)
    (b,) = llm.chat(one, GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert tokenizer.decode(a.prompt_token_ids) == opened
    assert tokenizer.decode(b.prompt_token_ids) == closed
    partial = [*one, {"role": "assistant", "content": "Hello"}]
    (c,) = llm.chat(
        partial, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True
    )
    assert tokenizer.decode(c.prompt_token_ids).endswith("Hello")
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (d,) = llm.chat(one, GREEDY, use_tqdm=False, chat_template=template)
    assert tokenizer.decode(d.prompt_token_ids) == "[hi]"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    with LLM(chat_template=str(path)) as templated:
        (e,) = templated.chat(one, GREEDY, use_tqdm=False)
    assert e.prompt_token_ids == d.prompt_token_ids


# -- priority scheduling --------------------------------------------------------------------------


def admission_order(eut: LLMEngine, priorities: list[int]) -> list[int]:
    """Queue one request per priority (arrival in list order) and return their arrival
    indexes in the order they got their first token."""
    ids = [
        eut.add_request([10 + i, 20 + i, 30 + i], GREEDY, priority=p)
        for i, p in enumerate(priorities)
    ]
    order: list[str] = []
    while eut.has_unfinished_requests():
        for out in eut.step():
            if out.token_ids and out.request_id not in order:
                order.append(out.request_id)
    assert sorted(order) == sorted(ids)
    return [ids.index(request_id) for request_id in order]


@pytest.mark.spec("ENG-189")
def test_priority_orders_admission() -> None:
    """One sequence per step: requests start lowest priority value first, arrival order among
    equals; under fcfs a non-zero priority is refused and the order is arrival."""
    eut = hash_engine(max_num_seqs=1, scheduling_policy="priority")
    order = admission_order(eut, [5, 0, 5, -1])
    assert order == [3, 1, 0, 2]
    fcfs = hash_engine(max_num_seqs=1)
    with pytest.raises(UnsupportedPriority, match="priority=5"):
        fcfs.add_request([1, 2], GREEDY, priority=5)
    assert not fcfs.has_unfinished_requests()
    assert admission_order(fcfs, [0, 0, 0]) == [0, 1, 2]


@pytest.mark.spec("ENG-189")
def test_priority_preempts_the_least_important_first() -> None:
    """A pool too small for both: the request of higher priority value is preempted, though
    it was admitted first (fcfs would preempt the newest)."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    eut = hash_engine(num_pages=6, scheduling_policy="priority")
    low = eut.add_request(list(range(1, 9)), params, priority=9)
    eut.step()
    high = eut.add_request(list(range(11, 19)), params, priority=0)
    finals: dict[str, RequestOutput] = {}
    while eut.has_unfinished_requests():
        for out in eut.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals[low].metrics.preemptions > 0
    assert finals[high].metrics.preemptions == 0


@pytest.mark.spec("ENG-185")
def test_gpu_memory_utilization_on_cuda_sizes_the_pool_after_the_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA the pool takes the fraction of the device's memory less the weights and the
    activation reserve, in whole pages; a fraction that leaves nothing is refused naming it.
    (The device's size is stood in for: this runs without a GPU.)"""
    from pagedkv.engine import engine_args as module

    model_dir = resolve_model(None)
    total = 8 << 30
    monkeypatch.setattr(module, "cuda_total_bytes", lambda device: total)
    model = module._model_config(model_dir)
    weights = module._weight_bytes(model, "float32")
    page = 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * 16 * 4
    config = EngineArgs(device="cuda", gpu_memory_utilization=0.5).engine_config(model_dir)
    left = int(total * 0.5) - weights - module.ACTIVATION_RESERVE_BYTES
    assert config.num_pages == left // page
    more = EngineArgs(device="cuda", gpu_memory_utilization=0.9).engine_config(model_dir)
    assert more.num_pages > config.num_pages
    with pytest.raises(InvalidRequest, match=r"gpu_memory_utilization=0\.1"):
        EngineArgs(device="cuda", gpu_memory_utilization=0.1).engine_config(model_dir)
