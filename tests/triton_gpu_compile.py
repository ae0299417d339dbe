"""Compile every Triton kernel of ``pagedkv.accel.cuda`` for a CUDA GPU, without one.

Run as a script in a process of its own (``TRITON_INTERPRET`` unset or 0: the kernels must be
defined for a GPU, not for the interpreter the test process uses). Triton's compiler lowers
each kernel, with the tile sizes and dtypes the launch wrappers pass for Qwen3-0.6B's heads (16
query heads on 8 KV heads of 128 channels), through its MLIR passes to PTX and ptxas's cubin
for the target given (``sm_90``, an H100/H200, by default): what the interpreter never
checks (``tl.dot`` tiles of at least 16, operands of one dtype, compile-time arguments, control
flow the GPU code generator takes) fails here. Prints one line per kernel compiled.
"""

from __future__ import annotations

import sys

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from pagedkv.accel.cuda import (
    decode_kernel,
    norm_kernel,
    prefill_kernel,
    store_kernel,
    swiglu_kernel,
)
from pagedkv.accel.cuda.kernel_shapes import DECODE_BLOCK_N, MAX_DECODE_SPLITS, block_of

I32 = "i32"
HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 16, 8, 128, 16
#: The 0.6B model's hidden size (a power of two) and a width that is none, for the norms.
HIDDEN_SIZES = (1024, 1000)
GROUP = HEADS // KV_HEADS


def build(
    kernel: object, pointers: dict[str, str], constants: dict[str, object], arch: int
) -> None:
    """Compile ``kernel`` with ``pointers`` typed as given, every other runtime argument an
    ``i32`` (strides, sizes) or ``fp32`` (``scale``, ``eps``), and ``constants`` for its
    compile-time ones."""
    names: list[str] = kernel.arg_names  # type: ignore[attr-defined]
    signature = {}
    for name in names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in ("scale", "eps") else I32
    compiled = compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constants),
        target=GPUTarget("cuda", arch, 32),
    )
    name = getattr(kernel, "__name__", "?")
    print(f"{name} sm_{arch}: {len(compiled.asm['cubin'])} bytes of cubin")


def main(arch: int) -> None:
    if store_kernel.runs_interpreted():
        raise SystemExit("TRITON_INTERPRET is set: the kernels are defined for the interpreter")
    block_d = block_of(HEAD_DIM)
    for dtype in ("bf16", "fp32"):
        pool = f"*{dtype}"
        if dtype == "bf16":  # the store kernel copies bits: one dtype shows it compiles
            build(
                store_kernel._store_kv_kernel,
                {n: pool for n in ("key_ptr", "value_ptr", "key_pool_ptr", "value_pool_ptr")}
                | {"slots_ptr": "*i64"},
                {"KV_HEADS": KV_HEADS, "HEAD_DIM": HEAD_DIM, "BLOCK_H": 8, "BLOCK_D": block_d},
                arch,
            )
        ints = {n: "*i32" for n in ("page_tables_ptr", "context_lens_ptr", "rows_ptr", "seqs_ptr")}
        build(
            decode_kernel._decode_split_kernel,
            {n: pool for n in ("query_ptr", "key_pool_ptr", "value_pool_ptr")}
            | ints
            | {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"},
            {
                "GROUP": GROUP,
                "HEAD_DIM": HEAD_DIM,
                "PAGE_SIZE": PAGE_SIZE,
                "NUM_SPLITS": MAX_DECODE_SPLITS,
                "BLOCK_H": block_of(GROUP),
                "BLOCK_D": block_d,
                "BLOCK_N": DECODE_BLOCK_N,
                "EMPTY_LSE": decode_kernel.EMPTY_LSE,
            },
            arch,
        )
        # The merge reads float32 parts: its output dtype is all that varies, and one split
        # (a tile of one) is its edge.
        for splits in (1, MAX_DECODE_SPLITS) if dtype == "bf16" else ():
            build(
                decode_kernel._decode_merge_kernel,
                {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "rows_ptr": "*i32"}
                | {"out_ptr": pool},
                {"HEAD_DIM": HEAD_DIM, "NUM_SPLITS": splits, "BLOCK_D": block_d},
                arch,
            )
        group_block = block_of(GROUP, 1)
        block_m = max(prefill_kernel.BLOCK_M, group_block)
        build(
            prefill_kernel._prefill_kernel,
            {n: pool for n in ("query_ptr", "key_pool_ptr", "value_pool_ptr", "out_ptr")}
            | {n: "*i32" for n in ("page_tables_ptr", "context_lens_ptr", "query_start_ptr")}
            | {"seqs_ptr": "*i32"},
            {
                "GROUP": GROUP,
                "GROUP_BLOCK": group_block,
                "HEAD_DIM": HEAD_DIM,
                "PAGE_SIZE": PAGE_SIZE,
                "BLOCK_Q": block_m // group_block,
                "BLOCK_M": block_m,
                "BLOCK_D": block_d,
                "BLOCK_N": prefill_kernel.BLOCK_N,
                "PRECISION": "ieee" if dtype == "fp32" else "tf32",
                "UPCAST": False,
            },
            arch,
        )

    fused(arch)


def fused(arch: int) -> None:
    """The fused kernels of ``fused_ops="triton"`` in each dtype they take: the norm with and
    without its residual, the norm with the rotation, the SwiGLU activation."""
    for dtype in ("bf16", "fp16", "fp32"):
        pointer = f"*{dtype}"
        norm_pointers = ("x_ptr", "residual_ptr", "total_ptr", "out_ptr", "weight_ptr")
        for hidden in HIDDEN_SIZES:
            build(
                norm_kernel._rms_norm_kernel,
                dict.fromkeys(norm_pointers, pointer),
                {"HAS_RESIDUAL": hidden == HIDDEN_SIZES[0], "BLOCK": block_of(hidden, 1)},
                arch,
            )
        build(
            norm_kernel._rms_norm_rope_kernel,
            dict.fromkeys(("x_ptr", "out_ptr", "weight_ptr", "cos_ptr", "sin_ptr"), pointer),
            {"HEAD_DIM": HEAD_DIM, "BLOCK_D": block_of(HEAD_DIM, 1)},
            arch,
        )
        build(
            swiglu_kernel._swiglu_kernel,
            dict.fromkeys(("gate_up_ptr", "out_ptr"), pointer),
            {"BLOCK": swiglu_kernel.BLOCK},
            arch,
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
