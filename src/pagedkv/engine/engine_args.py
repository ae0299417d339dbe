"""vLLM's engine arguments, one table for ``LLM(...)`` and ``pagedkv serve`` (ENG-180).

:data:`ENGINE_ARGS` names every argument once, under vLLM's name, with its type, default and
help; ``LLM``'s keyword arguments are checked against it (:func:`engine_args_from_kwargs`) and
the command line's flags are generated from it
(:func:`pagedkv.entrypoints.cli.engine_args.add_engine_flags`). vLLM arguments pagedkv does not
implement are listed in :data:`UNSUPPORTED_ARGS` with the reason, so giving one is an error
naming it rather than a silent no-op (ENG-181).

torch-free: ``--help`` and argument errors stay fast.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedkv.device import DEFAULT_DEVICE, cuda_total_bytes
from pagedkv.engine.config import CacheMode, EngineConfig, SchedulingPolicy
from pagedkv.engine.runner_options import RunnerOptions
from pagedkv.errors import InvalidRequest

if TYPE_CHECKING:
    from pagedkv.interfaces import Engine

_LOG = logging.getLogger("pagedkv.engine")

#: vLLM's environment variable sizing its CPU backend's KV cache, in GiB.
CPU_KVCACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
#: KV pages when nothing sizes the pool (no ``num_pages``, no memory figure).
DEFAULT_NUM_PAGES = 512
#: Bytes of device memory kept back for activations when ``gpu_memory_utilization`` sizes the
#: pool from what the weights leave (vLLM measures its activation peak in a profiling run;
#: pagedkv keeps this fixed reserve instead, documented as such).
ACTIVATION_RESERVE_BYTES = 1 << 30
#: Bytes of one element of each dtype pagedkv runs.
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: vLLM's dtype spellings, by pagedkv's name (``auto``: the checkpoint's own, ENG-182).
DTYPE_ALIASES = {
    "auto": "auto",
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}


class UnknownEngineArgument(InvalidRequest):
    """A keyword argument that is no engine argument of vLLM's nor of pagedkv's (ENG-181)."""


class UnsupportedEngineArgument(InvalidRequest):
    """A vLLM engine argument pagedkv does not implement, given a value that would change
    something (ENG-181)."""


@dataclass(frozen=True)
class EngineArgs:
    """The engine arguments, by vLLM's names; see :data:`ENGINE_ARGS` for each one's help.

    Attributes beyond vLLM's are pagedkv's own: ``num_pages`` (KV pages; ``None``: sized by
    ``kv_cache_memory_bytes``, ``gpu_memory_utilization`` on CUDA, ``VLLM_CPU_KVCACHE_SPACE``
    on the CPU, else 512), ``mode``, ``device``, ``generation_config``, ``max_step_retries``.
    """

    model: str | None = None
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "float32"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    enforce_eager: bool = False
    chat_template: str | None = None
    trust_remote_code: bool = False
    scheduling_policy: SchedulingPolicy = "fcfs"
    tensor_parallel_size: int = 1
    num_pages: int | None = None
    mode: CacheMode = "v1"
    device: str = DEFAULT_DEVICE
    generation_config: str = "auto"
    max_step_retries: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if not 0 <= self.seed < 2**64:
            raise InvalidRequest(f"seed must be in [0, 2**64 - 1], got {self.seed}")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1:
            raise InvalidRequest(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise InvalidRequest(
                f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}"
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise InvalidRequest(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        if self.tokenizer is not None and not _same_place(self.tokenizer, self.model):
            raise UnsupportedEngineArgument(
                f"tokenizer={self.tokenizer!r}: pagedkv reads the tokenizer from the model "
                "directory; a tokenizer elsewhere is not supported"
            )

    def runner_options(self) -> RunnerOptions:
        """How the model runner runs (ENG-205): ``enforce_eager`` turns CUDA graphs off; left
        ``False``, the runner's default (graphs on where the model is on CUDA)."""
        return RunnerOptions(cuda_graphs=False) if self.enforce_eager else RunnerOptions()

    def engine_config(self, model_dir: Path) -> EngineConfig:
        """The engine configuration these arguments ask for, for the checkpoint in
        ``model_dir`` (its own context length when ``max_model_len`` is left out, ENG-183;
        its K/V width when a memory figure sizes the pool, ENG-185).

        Raises:
            InvalidRequest: a value out of range, named.
            CheckpointError: ``model_dir``'s config.json is unreadable.
        """
        model = _model_config(model_dir)
        max_model_len = self.max_model_len or model.max_positions
        return EngineConfig(
            page_size=self.block_size,
            num_pages=self._num_pages(model),
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            mode=self.mode,
            max_step_retries=self.max_step_retries,
            seed=self.seed,
            scheduling_policy=self.scheduling_policy,
        )

    def _num_pages(self, model: Any) -> int:
        """Pages in the pool (ENG-185): ``num_pages``; else a memory figure over one page's
        bytes; else :data:`DEFAULT_NUM_PAGES`."""
        if self.num_pages is not None:
            return self.num_pages
        dtype = self.dtype if self.dtype != "auto" else "bfloat16"
        page_bytes = (
            2
            * model.num_hidden_layers
            * model.num_key_value_heads
            * model.head_dim
            * self.block_size
            * _DTYPE_BYTES.get(dtype, 4)
        )
        budget = self._kv_bytes(model, dtype)
        if budget is None:
            return DEFAULT_NUM_PAGES
        pages = budget // page_bytes
        if pages < 1:
            raise InvalidRequest(
                f"the KV cache budget of {budget} bytes holds no page of {page_bytes} bytes"
            )
        return int(pages)

    def _kv_bytes(self, model: Any, dtype: str) -> int | None:
        """Bytes for the KV pool, or ``None`` when nothing sizes it."""
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        on_cuda = self.device.startswith("cuda")
        if self.gpu_memory_utilization is not None and not on_cuda:
            _LOG.warning(
                "gpu_memory_utilization=%s is ignored on %s: as on vLLM's CPU backend, the KV "
                "cache is sized by num_pages, kv_cache_memory_bytes or %s (GiB)",
                self.gpu_memory_utilization,
                self.device,
                CPU_KVCACHE_SPACE_ENV,
            )
        if on_cuda and self.gpu_memory_utilization is not None:
            weights = _weight_bytes(model, dtype)
            total = cuda_total_bytes(self.device)
            left = int(total * self.gpu_memory_utilization) - weights - ACTIVATION_RESERVE_BYTES
            if left < 1:
                raise InvalidRequest(
                    f"gpu_memory_utilization={self.gpu_memory_utilization} of {total} bytes "
                    f"leaves nothing for the KV cache after {weights} bytes of weights and a "
                    f"{ACTIVATION_RESERVE_BYTES}-byte activation reserve"
                )
            return left
        space = os.environ.get(CPU_KVCACHE_SPACE_ENV)
        if space and not on_cuda:
            try:
                gib = float(space)
            except ValueError:
                raise InvalidRequest(
                    f"{CPU_KVCACHE_SPACE_ENV}={space!r} is not a number of GiB"
                ) from None
            return int(gib * (1 << 30))
        return None


def _same_place(tokenizer: str, model: str | None) -> bool:
    """Whether ``tokenizer`` names the model's own directory (or hub id)."""
    if model is None:
        return False
    return tokenizer == model or Path(tokenizer).resolve() == Path(model).resolve()


def _model_config(model_dir: Path) -> Any:
    """The checkpoint's parsed ``config.json``."""
    from pagedkv.errors import CheckpointError
    from pagedkv.model.config import ModelConfig

    path = model_dir / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    return ModelConfig.from_dict(raw)


def _weight_bytes(model: Any, dtype: str) -> int:
    """Bytes of the model's parameters in ``dtype`` (dense layers; an estimate for MoE)."""
    hidden = model.hidden_size
    inter = model.intermediate_size
    per_layer = (
        hidden * (model.q_size + 2 * model.kv_size) + model.q_size * hidden + 3 * hidden * inter
    )
    embed = model.vocab_size * hidden * (1 if model.tie_word_embeddings else 2)
    return int((per_layer * model.num_hidden_layers + embed) * _DTYPE_BYTES.get(dtype, 4))


def normalize_dtype(value: object) -> str:
    """pagedkv's name of a dtype given as vLLM takes it: ``auto``, ``half``, ``float16``,
    ``bfloat16``, ``float``, ``float32`` or a torch dtype (ENG-182).

    Raises:
        InvalidRequest: any other value, named.
    """
    name = str(value).removeprefix("torch.") if not isinstance(value, str) else value
    if name in DTYPE_ALIASES:
        return DTYPE_ALIASES[name]
    raise InvalidRequest(
        f"dtype {value!r} is not supported; give one of {', '.join(DTYPE_ALIASES)} "
        "or torch.float32, torch.bfloat16, torch.float16"
    )


@dataclass(frozen=True)
class ArgSpec:
    """One engine argument: how the command line parses it and what ``--help`` says.

    Attributes:
        name: vLLM's name (the flag is ``--`` and the name with dashes).
        parse: turns a flag's text into the value (``None`` for a boolean switch).
        help: what it does; the effective default is appended by the command line.
        metavar: the value's placeholder in ``--help``.
        choices: the values allowed, where a list.
        serve_only: only ``pagedkv serve`` has the flag (the others have no use for it).
    """

    name: str
    parse: Callable[[str], Any] | None
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    serve_only: bool = False


def parse_seed(text: str) -> int:
    """A seed given as text: an integer in ``[0, 2**64 - 1]``, what ``torch.Generator`` and
    the API take (SRV-119).

    Raises:
        ValueError: anything else, named.
    """
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"seed must be an integer, got {text!r}") from None
    if not 0 <= value < 2**64:
        raise ValueError(f"seed must be in [0, 2**64 - 1], got {value}")
    return value


#: Every engine argument, vLLM's first (ENG-180). ``model`` is the positional argument.
ENGINE_ARGS: tuple[ArgSpec, ...] = (
    ArgSpec("tokenizer", str, "the tokenizer's directory: must be the model's", "DIR"),
    ArgSpec(
        "served_model_name",
        str,
        "the model name in responses and /v1/models; a request's 'model' may be absent or "
        "this name",
        "NAME",
        serve_only=True,
    ),
    ArgSpec(
        "dtype",
        str,
        "parameter dtype: auto (the checkpoint's config.json dtype), half/float16, bfloat16, "
        "float/float32",
        choices=tuple(DTYPE_ALIASES),
    ),
    ArgSpec("seed", parse_seed, "seeds the requests that give no seed of their own", "N"),
    ArgSpec(
        "max_model_len",
        int,
        "most positions one sequence may reach, prompt included",
        "N",
    ),
    ArgSpec("block_size", int, "token positions per KV page", "N"),
    ArgSpec("enable_prefix_caching", None, "reuse cached KV pages across requests"),
    ArgSpec("max_num_seqs", int, "most sequences in one step", "N"),
    ArgSpec(
        "max_num_batched_tokens",
        int,
        "most token positions computed in one step; longer prompts are prefilled in chunks",
        "N",
    ),
    ArgSpec(
        "gpu_memory_utilization",
        float,
        "on CUDA, the fraction of the device's memory for weights and KV cache, the pool "
        "taking what the weights leave (1 GiB kept for activations); ignored with a warning "
        f"on the CPU, where the pool is sized by --num-pages, --kv-cache-memory-bytes or "
        f"{CPU_KVCACHE_SPACE_ENV} (GiB), as on vLLM's CPU backend",
        "FRACTION",
    ),
    ArgSpec("kv_cache_memory_bytes", int, "bytes of the KV pool (sizes --num-pages)", "BYTES"),
    ArgSpec(
        "enforce_eager",
        None,
        "run every step eagerly: on CUDA, decode steps are otherwise replayed from CUDA graphs "
        "(captured per padded batch size, ENG-205); elsewhere nothing is captured either way",
    ),
    ArgSpec(
        "chat_template",
        str,
        "a Jinja chat template, or a file holding one, used instead of the model's",
        "TEMPLATE",
    ),
    ArgSpec(
        "trust_remote_code",
        None,
        "accepted for vLLM's scripts and changes nothing: pagedkv never runs code shipped "
        "with a checkpoint",
    ),
    ArgSpec(
        "scheduling_policy",
        str,
        "fcfs: first come first served (a request priority other than 0 is refused); "
        "priority: lowest priority value admitted first and preempted last",
        choices=("fcfs", "priority"),
    ),
    ArgSpec(
        "tensor_parallel_size",
        int,
        "split the model over N ranks: N-1 worker processes on this machine (gloo on cpu, "
        "NCCL on cuda), or the ranks of a torchrun launch",
        "N",
    ),
    ArgSpec("num_pages", int, "KV pages in the pool (pagedkv's own)", "N"),
    ArgSpec("device", str, "torch device, e.g. cpu or cuda:0", "DEVICE"),
    ArgSpec(
        "max_step_retries",
        int,
        "times a request whose step failed with it running alone is run again before it "
        "fails; a failed step of several requests counts against none of them, its requests "
        "being run again in halves to find the cause",
        "N",
    ),
)

#: vLLM engine arguments pagedkv does not implement: the values that change nothing (accepted)
#: and why any other is refused (ENG-181).
UNSUPPORTED_ARGS: Mapping[str, tuple[tuple[object, ...], str]] = {
    "swap_space": ((None, 0, 4), "pagedkv recomputes preempted requests; it never swaps KV"),
    "cpu_offload_gb": ((None, 0), "weights are never offloaded"),
    "quantization": ((None,), "quantized checkpoints are not supported"),
    "kv_cache_dtype": ((None, "auto"), "the KV cache holds the model's dtype"),
    "load_format": ((None, "auto", "safetensors"), "only safetensors checkpoints are read"),
    "revision": ((None,), "a model is read from a directory or the local hub cache as it is"),
    "tokenizer_revision": ((None,), "the tokenizer is the model directory's"),
    "tokenizer_mode": ((None, "auto"), "the model's fast tokenizer is always used"),
    "pipeline_parallel_size": ((None, 1), "pipeline parallelism is not supported"),
    "data_parallel_size": ((None, 1), "data parallelism is not supported"),
    "speculative_config": ((None,), "speculative decoding is not supported"),
    "enable_lora": ((None, False), "LoRA adapters are not supported"),
    "max_loras": ((None,), "LoRA adapters are not supported"),
    "max_lora_rank": ((None,), "LoRA adapters are not supported"),
    "enable_chunked_prefill": ((None, True), "pagedkv always prefills long prompts in chunks"),
    "max_seq_len_to_capture": (
        (None,),
        "CUDA graphs are captured for every context length the KV pool holds",
    ),
    "disable_custom_all_reduce": ((None, False), "pagedkv has no custom all-reduce"),
    "hf_overrides": ((None, {}), "the checkpoint's config.json is read as it is"),
    "limit_mm_per_prompt": ((None, {}), "Qwen3 takes text only"),
    "mm_processor_kwargs": ((None, {}), "Qwen3 takes text only"),
    "compilation_config": ((None, 0, {}), "compilation is a runner option of the backend"),
    "distributed_executor_backend": ((None, "mp"), "tensor parallelism starts its own workers"),
    "rope_scaling": ((None,), "RoPE scaling is read from the checkpoint's config.json"),
    "rope_theta": ((None,), "RoPE theta is read from the checkpoint's config.json"),
    "max_logprobs": ((None, 20), "log-probabilities are limited by each request alone"),
}

#: ``LLM``'s names for engine arguments from before it took vLLM's.
LEGACY_ALIASES = {"page_size": "block_size"}
_FIELDS = frozenset(f.name for f in fields(EngineArgs))


def engine_args_from_kwargs(model: str | Path | None, kwargs: Mapping[str, Any]) -> EngineArgs:
    """The :class:`EngineArgs` of ``LLM(model, **kwargs)`` (ENG-180, ENG-181).

    Raises:
        UnknownEngineArgument: a keyword neither vLLM's nor pagedkv's, all of them named.
        UnsupportedEngineArgument: a vLLM argument pagedkv does not implement, given a value
            that would change something; named with the reason.
        InvalidRequest: two names for one setting that disagree, or a value out of range.
    """
    given = dict(kwargs)
    for old, new in LEGACY_ALIASES.items():
        if old in given:
            value = given.pop(old)
            if given.get(new) is not None and value is not None and given[new] != value:
                raise InvalidRequest(f"{old}={value} and {new}={given[new]} name the same setting")
            if value is not None:
                given[new] = value
    if given.get("block_size") is None:
        given.pop("block_size", None)
    refuse_unsupported(given)
    for spec in ENGINE_ARGS:
        if spec.serve_only and given.get(spec.name) is not None:
            raise UnsupportedEngineArgument(
                f"{spec.name} is an argument of pagedkv serve: LLM has no use for it"
            )
    unknown = sorted(k for k in given if k not in _FIELDS and k not in UNSUPPORTED_ARGS)
    if unknown:
        raise UnknownEngineArgument(
            f"unknown engine argument{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}"
        )
    known = {k: v for k, v in given.items() if k in _FIELDS}
    return EngineArgs(model=None if model is None else str(model), **known)


def refuse_unsupported(given: Mapping[str, Any]) -> None:
    """Raise :class:`UnsupportedEngineArgument` for the first argument of
    :data:`UNSUPPORTED_ARGS` in ``given`` whose value would change something."""
    for name, value in given.items():
        if name in UNSUPPORTED_ARGS:
            neutral, reason = UNSUPPORTED_ARGS[name]
            if value not in neutral:
                raise UnsupportedEngineArgument(f"{name}={value!r} is not supported: {reason}")


def load_engine_from_args(args: EngineArgs) -> Engine:
    """The engine ``args`` describe: the checkpoint resolved (a directory, a cached hub id or
    the embedded model), its engine configuration (ENG-183, ENG-185), the reference backend's
    engine on it, and ``chat_template`` in place of the model's (ENG-180).

    Raises:
        CheckpointError: no such model, or a malformed one.
        InvalidRequest: a value out of range, named.
    """
    from pagedkv.backend import load_engine
    from pagedkv.model_source import resolve_model

    model_dir = resolve_model(args.model)
    engine = load_engine(
        model_dir,
        args.engine_config(model_dir),
        dtype=args.dtype,
        device=args.device,
        generation_config=args.generation_config,
        tensor_parallel_size=args.tensor_parallel_size,
        runner_options=args.runner_options(),
    )
    if args.chat_template is not None:
        if engine.tokenizer is None:
            raise InvalidRequest("chat_template needs a model directory with a tokenizer")
        engine.tokenizer.use_chat_template(args.chat_template)
    return engine
