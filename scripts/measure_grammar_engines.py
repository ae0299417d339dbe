"""Per-step mask cost of llguidance and xgrammar on a Qwen3-sized vocabulary.

Why this script: structured outputs need one engine that turns a grammar state into the set of
allowed tokens every decode step. The choice between llguidance and xgrammar (both used by
vLLM) is made on what each costs on Qwen3's 151,936-row logits.

No Qwen3 tokenizer can be downloaded here, so the vocabulary is a byte-level BPE of Qwen3's
size trained on Python sources (``--tokenizer`` takes a ``tokenizer.json``, e.g. the real one
where it exists). For each engine and grammar it reports the compile time and the median and
p99 per-step mask time while walking a valid JSON document (or a regex match) token by token.

    python scripts/measure_grammar_engines.py --tokenizer tokenizer.json --vocab 151936
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "email", "tags", "address", "role"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps(
    {
        "name": "Ada Lovelace",
        "age": 36,
        "email": "ada@example.com",
        "tags": ["math", "engines", "poetry"],
        "address": {"city": "London", "zip": "W1"},
        "role": "admin",
    },
    separators=(",", ":"),
)


def _stats(times: list[float]) -> str:
    ordered = sorted(times)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return f"median {statistics.median(ordered) * 1e6:8.1f} us  p99 {p99 * 1e6:8.1f} us"


def llguidance_run(tokenizer_json: str, vocab: int, eos: int, tokens: list[int]) -> None:
    import llguidance
    import torch

    start = time.perf_counter()
    tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
    print(f"llguidance tokenizer build      {time.perf_counter() - start:8.3f} s")
    options: Any = {"whitespace_flexible": False}
    for name, grammar in (
        ("json schema", llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=options)),
        ("json object", llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})),
    ):
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(tok, grammar)
        compiled = time.perf_counter() - start
        mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
        times = []
        for token in tokens:
            start = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            times.append(time.perf_counter() - start)
            assert matcher.consume_token(token), matcher.get_error()
        print(f"llguidance {name:12s} compile {compiled * 1e3:8.2f} ms  mask {_stats(times)}")


def xgrammar_run(tokenizer_json: str, vocab: int, eos: int, tokens: list[int]) -> None:
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=_tokenizer(tokenizer_json))
    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    print(f"xgrammar tokenizer build        {time.perf_counter() - start:8.3f} s")
    for name, build in (
        (
            "json schema",
            lambda: compiler.compile_json_schema(
                json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
            ),
        ),
        ("json object", lambda: compiler.compile_builtin_json_grammar()),
    ):
        start = time.perf_counter()
        compiled = build()
        compile_s = time.perf_counter() - start
        matcher = xgrammar.GrammarMatcher(compiled)
        mask = xgrammar.allocate_token_bitmask(1, vocab)
        times = []
        for token in tokens:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            times.append(time.perf_counter() - start)
            assert matcher.accept_token(token)
        print(f"xgrammar   {name:12s} compile {compile_s * 1e3:8.2f} ms  mask {_stats(times)}")


def _tokenizer(tokenizer_json: str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="a tokenizer.json")
    parser.add_argument("--vocab", type=int, default=151_936, help="the model's logit rows")
    parser.add_argument("--eos", default="<|endoftext|>", help="the EOS token's text")
    args = parser.parse_args()
    text = Path(args.tokenizer).read_text(encoding="utf-8")
    tok = _tokenizer(text)
    eos = tok.token_to_id(args.eos)
    tokens = tok.encode(DOCUMENT).ids
    print(
        f"vocabulary {tok.get_vocab_size()} tokens, logits {args.vocab}; "
        f"document {len(tokens)} tokens"
    )
    llguidance_run(text, args.vocab, eos, tokens)
    xgrammar_run(text, args.vocab, eos, tokens)


if __name__ == "__main__":
    main()
