"""Train the small default Qwen3-architecture model shipped with pagedkv.

The model is a tiny ``Qwen3ForCausalLM`` (about 5.8M parameters) trained from scratch on the
Python standard library's own ``.py`` sources, taken from the running interpreter (PSF License
Version 2). Everything it needs is available offline: the corpus is the stdlib of the Python
that runs this script, the tokenizer is trained here with the ``tokenizers`` library, and the
model is trained here on the CPU with a single thread.

Pipeline:

1. Collect the stdlib ``.py`` files in sorted relative-path order, skipping tests, ``idlelib``,
   ``site-packages``, the generated ``encodings`` codec tables, ``pydoc_data`` and the
   build-specific ``_sysconfigdata*`` module.
2. Split deterministically by file: a file is held out when the first 8 hex digits of the
   SHA-256 of its relative path, read as an integer, are ``< 3%`` of ``2**32``.
3. Train a byte-level BPE tokenizer (Qwen2-style pre-tokenisation regex, vocabulary 4096, special
   tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``) on the training files only.
4. Pack the training files into one token stream (each file followed by ``<|endoftext|>``), cut it
   into non-overlapping windows of ``seq_len + 1`` tokens and visit them in a seeded random order.
   About 3% of the word starts that follow a space are tokenised non-canonically (a lone space
   token, then the word; see :func:`encode_text`) so that prompts ending in a space, such as
   ``"def "``, continue sensibly. The held-out stream is always tokenised canonically.
5. Train with AdamW, linear warm-up and cosine decay, under bfloat16 autocast (fp32 master
   weights), then store the weights as bfloat16 and report the held-out loss of the stored
   weights.

Reproduce the shipped checkpoint (Python 3.11.7, torch 2.13.0 CPU, transformers 5.24.0,
tokenizers 0.23.3; seed 0, all other options at their defaults) with::

    python scripts/train_default_model.py --out build/default_model --steps 1000 --seed 0

and copy the output folder into ``src/pagedkv/assets/default_model/``. With one thread on a
2-core x86-64 machine (AVX-512 with BF16) that run took 1636 s = 27.3 minutes of wall time
in total (1610 s of process CPU time; about 1.6 s per optimizer step of 16 x 256 tokens),
including tokenizer training, encoding, 1000 steps, the final evaluation and saving. It prints
``HELD-OUT LOSS (stored bf16 weights): 3.4557 nats/token, ppl 31.68``. Two runs with the same
seed on the same machine produce byte-identical ``model.safetensors`` files. Other Python
versions ship a different stdlib and therefore produce a different model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import shutil
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import processors as tk_processors
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]

# The pre-tokenisation regex used by Qwen2/Qwen3 tokenizers (digits are split one by one).
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idlelib", "site-packages", "__pycache__", "encodings", "pydoc_data"}
)
HELD_OUT_PERCENT = 3
WORD_AFTER_SPACE = re.compile(r"(?<= )(?=\S)")
SAMPLE_PROMPTS = ["def ", "import os\n", "class "]


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one training run."""

    out: Path
    steps: int
    seed: int
    vocab_size: int
    seq_len: int
    batch_size: int
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    space_split_prob: float
    log_every: int
    eval_every: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    max_position_embeddings: int


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Parse the command line into a :class:`TrainConfig`."""
    p = argparse.ArgumentParser(description="Train the default pagedkv model.")
    p.add_argument("--out", type=Path, required=True, help="output folder (created/replaced)")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument(
        "--space-split-prob",
        type=float,
        default=0.03,
        help="probability of a non-canonical cut before a word that follows a space",
    )
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=6)
    p.add_argument("--intermediate-size", type=int, default=768)
    p.add_argument("--max-position-embeddings", type=int, default=1024)
    a = p.parse_args(argv)
    return TrainConfig(
        out=a.out,
        steps=a.steps,
        seed=a.seed,
        vocab_size=a.vocab_size,
        seq_len=a.seq_len,
        batch_size=a.batch_size,
        lr=a.lr,
        min_lr_ratio=a.min_lr_ratio,
        warmup_steps=a.warmup_steps,
        weight_decay=a.weight_decay,
        grad_clip=a.grad_clip,
        space_split_prob=a.space_split_prob,
        log_every=a.log_every,
        eval_every=a.eval_every,
        hidden_size=a.hidden_size,
        num_layers=a.num_layers,
        intermediate_size=a.intermediate_size,
        max_position_embeddings=a.max_position_embeddings,
    )


def log(msg: str) -> None:
    """Print a progress line immediately."""
    print(msg, flush=True)


# --------------------------------------------------------------------------- data


def collect_stdlib_files(stdlib: Path) -> list[str]:
    """Relative paths (POSIX style, sorted) of the stdlib ``.py`` files used as corpus."""
    paths: list[str] = []
    for path in stdlib.rglob("*.py"):
        rel = path.relative_to(stdlib)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("_sysconfigdata") or rel.parts[0].startswith("config-"):
            continue
        if not path.is_file():
            continue
        paths.append(rel.as_posix())
    return sorted(paths)


def is_held_out(rel_path: str) -> bool:
    """Deterministic ~3% file-level held-out split keyed on the relative path."""
    h = int(hashlib.sha256(rel_path.encode("utf-8")).hexdigest()[:8], 16)
    return h < (HELD_OUT_PERCENT * 2**32) // 100


def read_text(path: Path) -> str:
    """Read a source file as UTF-8 (replacing undecodable bytes) with LF newlines."""
    return path.read_bytes().decode("utf-8", errors="replace").replace("\r\n", "\n")


# ----------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer with Qwen-style pre-tokenisation."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = tk_processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def special_id(tok: Tokenizer, token: str) -> int:
    """Id of a special token that must exist in the vocabulary."""
    token_id = tok.token_to_id(token)
    if token_id is None:
        raise KeyError(token)
    return int(token_id)


def encode_text(
    tok: Tokenizer, text: str, rng: random.Random | None, split_prob: float
) -> list[int]:
    """Token ids of ``text``; with ``rng``, some word starts get a non-canonical tokenisation.

    The pre-tokenizer attaches a space to the word that follows it (``"def foo"`` is
    ``def`` + `` foo``), so a prompt ending in a space (``"def "``) ends in a lone-space token the
    model would otherwise never see before a word. With probability ``split_prob`` per
    position that follows a space and starts a non-space character, the text is cut there and
    the pieces are encoded separately (``def`` + `` `` + ``foo``), teaching the model to
    continue such prompts. Held-out text is always encoded canonically (``rng=None``).
    """
    if rng is None or split_prob <= 0.0:
        return list(tok.encode(text, add_special_tokens=False).ids)
    cuts = [m.start() for m in WORD_AFTER_SPACE.finditer(text) if rng.random() < split_prob]
    ids: list[int] = []
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        ids.extend(tok.encode(text[start:end], add_special_tokens=False).ids)
    return ids


def encode_stream(
    tok: Tokenizer,
    texts: list[str],
    eos_id: int,
    rng: random.Random | None = None,
    split_prob: float = 0.0,
) -> torch.Tensor:
    """Concatenate the token ids of all texts, each followed by ``<|endoftext|>``."""
    ids: list[int] = []
    for text in texts:
        ids.extend(encode_text(tok, text, rng, split_prob))
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int64)


def to_windows(stream: torch.Tensor, length: int) -> torch.Tensor:
    """Cut a 1-D stream into non-overlapping rows of ``length`` tokens (tail dropped)."""
    n = stream.numel() // length
    return stream[: n * length].view(n, length)


def save_tokenizer(tok: Tokenizer, out: Path, model_max_length: int) -> None:
    """Write ``tokenizer.json`` plus the transformers side files."""
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }
    special_tokens_map = {
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
    }
    for name, obj in (
        ("tokenizer_config.json", tokenizer_config),
        ("special_tokens_map.json", special_tokens_map),
    ):
        (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------- model


def build_model(cfg: TrainConfig, eos_id: int, im_end_id: int) -> Qwen3ForCausalLM:
    """A freshly initialised tiny Qwen3 model with tied embeddings and GQA."""
    config = Qwen3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        hidden_act="silu",
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=False,
        attention_dropout=0.0,
        use_cache=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    config._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=eos_id,
        eos_token_id=[eos_id, im_end_id],
        pad_token_id=eos_id,
        do_sample=False,
    )
    return model


def add_legacy_config_keys(path: Path) -> None:
    """Also write the pre-5.x spellings ``rope_theta`` and ``torch_dtype`` into config.json.

    transformers 5 stores RoPE settings under ``rope_parameters`` and the weight dtype as
    ``dtype``; older transformers releases (and simple config readers) look for the top-level
    ``rope_theta`` / ``torch_dtype`` keys. transformers 5 accepts and ignores the duplicates.
    """
    config = json.loads(path.read_text())
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    config["torch_dtype"] = config["dtype"]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``cfg.lr`` then cosine decay to ``cfg.lr * cfg.min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def batch_loss(model: Qwen3ForCausalLM, rows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over a batch of ``seq_len + 1`` windows."""
    logits = model(input_ids=rows[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(
    model: Qwen3ForCausalLM, windows: torch.Tensor, batch_size: int, autocast: bool
) -> float:
    """Token-weighted mean loss over all ``windows`` (every row has the same length)."""
    model.eval()  # type: ignore[no-untyped-call]
    total = 0.0
    for start in range(0, windows.shape[0], batch_size):
        rows = windows[start : start + batch_size]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            total += batch_loss(model, rows).item() * rows.shape[0]
    model.train()
    return total / windows.shape[0]


@torch.no_grad()
def greedy_samples(model: Qwen3ForCausalLM, tok: Tokenizer, new_tokens: int) -> list[str]:
    """Greedy continuations of :data:`SAMPLE_PROMPTS`."""
    model.eval()  # type: ignore[no-untyped-call]
    outs: list[str] = []
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False).ids])
        gen = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
        outs.append(tok.decode(gen[0].tolist(), skip_special_tokens=False))
    model.train()
    return outs


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    """Run the whole pipeline and write the Hugging Face folder to ``--out``."""
    cfg = parse_args(argv)
    t0 = time.monotonic()
    cpu0 = time.process_time()
    # One CPU thread everywhere: torch intra/inter-op pools and the tokenizers Rayon pool.
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.seed)

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rel_paths = collect_stdlib_files(stdlib)
    train_paths = [p for p in rel_paths if not is_held_out(p)]
    held_paths = [p for p in rel_paths if is_held_out(p)]
    train_texts = [read_text(stdlib / p) for p in train_paths]
    held_texts = [read_text(stdlib / p) for p in held_paths]
    log(
        f"python {sys.version.split()[0]} stdlib: {len(rel_paths)} files; "
        f"train {len(train_paths)} files / {sum(map(len, train_texts))} chars; "
        f"held-out {len(held_paths)} files / {sum(map(len, held_texts))} chars"
    )
    log("held-out files: " + ", ".join(held_paths))

    tok = train_tokenizer(train_texts, cfg.vocab_size)
    eos_id = special_id(tok, EOS_TOKEN)
    im_end_id = special_id(tok, IM_END)
    train_stream = encode_stream(
        tok, train_texts, eos_id, random.Random(cfg.seed), cfg.space_split_prob
    )
    held_stream = encode_stream(tok, held_texts, eos_id)
    chars_per_token = sum(map(len, train_texts)) / train_stream.numel()
    log(
        f"tokenizer: vocab {tok.get_vocab_size()}; train {train_stream.numel()} tokens "
        f"({chars_per_token:.2f} chars/token); held-out {held_stream.numel()} tokens "
        f"[{time.monotonic() - t0:.0f}s]"
    )

    window = cfg.seq_len + 1
    train_windows = to_windows(train_stream, window)
    held_windows = to_windows(held_stream, window)
    # A fixed slice of held-out windows for cheap periodic evaluation.
    probe_windows = held_windows[torch.randperm(held_windows.shape[0])[:64]]

    model = build_model(cfg, eos_id, im_end_id)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params} parameters (tied embeddings)")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    order = torch.randperm(train_windows.shape[0])
    cursor = 0
    epoch = 0
    model.train()
    t_train = time.monotonic()
    running = 0.0
    for step in range(cfg.steps):
        if cursor + cfg.batch_size > order.numel():
            epoch += 1
            order = torch.randperm(train_windows.shape[0])
            cursor = 0
        rows = train_windows[order[cursor : cursor + cfg.batch_size]]
        cursor += cfg.batch_size
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = batch_loss(model, rows)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        running += loss.item()
        if (step + 1) % cfg.log_every == 0:
            elapsed = time.monotonic() - t_train
            log(
                f"step {step + 1}/{cfg.steps} epoch {epoch} lr {lr:.2e} "
                f"train_loss {running / cfg.log_every:.4f} "
                f"[{elapsed:.0f}s, {elapsed / (step + 1):.2f}s/step]"
            )
            running = 0.0
        if (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
            probe = evaluate(model, probe_windows, 32, autocast=True)
            log(f"step {step + 1} held-out probe loss {probe:.4f}")

    log(f"training done in {time.monotonic() - t_train:.0f}s")
    held_fp32 = evaluate(model, held_windows, 32, autocast=False)
    log(f"held-out loss (fp32 weights): {held_fp32:.4f} (ppl {math.exp(held_fp32):.2f})")

    # Store as bfloat16, then measure the stored weights (upcast to fp32 for the evaluation).
    model = model.bfloat16()
    model.config.dtype = torch.bfloat16
    if cfg.out.exists():
        shutil.rmtree(cfg.out)
    cfg.out.mkdir(parents=True)
    model.save_pretrained(cfg.out)
    add_legacy_config_keys(cfg.out / "config.json")
    save_tokenizer(tok, cfg.out, cfg.max_position_embeddings)
    model = model.float()  # type: ignore[no-untyped-call]
    held = evaluate(model, held_windows, 32, autocast=False)
    log(
        f"HELD-OUT LOSS (stored bf16 weights): {held:.4f} nats/token, ppl {math.exp(held):.2f} "
        f"over {held_windows.numel() - held_windows.shape[0]} predicted tokens"
    )
    for sample in greedy_samples(model, tok, 40):
        log("SAMPLE " + json.dumps(sample))
    wall = time.monotonic() - t0
    cpu = time.process_time() - cpu0
    log(f"total wall time {wall:.0f}s ({wall / 60:.1f} min), process CPU time {cpu:.0f}s")


if __name__ == "__main__":
    main()
