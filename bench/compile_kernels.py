"""Compile every Triton kernel for a CUDA target (sm_90 by default) on a machine without a GPU.

Triton's interpreter forgives what the compiler refuses (loop-carried types, scalar/block mixes,
unsupported casts); this lowers each kernel through TTIR -> TTGIR -> LLVM -> PTX -> cubin with the
wheel's own ptxas, for every constexpr variant we launch, so a kernel that passes the interpreter
tests also builds on the GPU machine.

    TRITON_INTERPRET=0 python bench/compile_kernels.py [--arch 90]
"""
from __future__ import annotations

import argparse
import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("run with TRITON_INTERPRET=0: the interpreter replaces kernels with Python functions")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pdserve.kernels import kv_quant, paged_attention, spec_verify  # noqa: E402

VERIFY_SIG = {
    "logits_ptr": "*fp32", "draft_ids_ptr": "*i64", "num_draft_ptr": "*i32", "draft_probs_ptr": "*fp32",
    "temp_ptr": "*fp32", "log_min_p_ptr": "*fp32", "top_k_ptr": "*i32", "top_p_ptr": "*fp32",
    "uniform_ptr": "*fp32", "noise_ptr": "*fp32",
    "out_ptr": "*i64", "num_accepted_ptr": "*i32", "K": "i32", "V": "i32",
    "HAS_DRAFT_PROBS": "constexpr", "PER_POSITION_NOISE": "constexpr", "COUPLED": "constexpr",
    "BLOCK_V": "constexpr", "BLOCK_K": "constexpr",
}
_STRIDES = {"s_block": "i32", "s_kv": "i32", "s_head": "i32", "s_tok": "i32", "s_dim": "i32",
            "HEADS": "i32", "HEAD_DIM": "i32", "GROUP": "i32"}
WIRE = {"int8": "*i8", "fp8": "*fp8e4nv"}


def paged_attention_sig(dt: str) -> dict:
    return {
        "q_ptr": f"*{dt}", "kv_ptr": f"*{dt}", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
        "query_start_ptr": "*i32", "out_ptr": f"*{dt}", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
        "part_acc_ptr": "*fp32", "sinks_ptr": "*fp32", "scale": "fp32", "softcap": "fp32", "S": "i32", "T": "i32",
        "Q_HEADS": "i32", "SPLIT_LEN": "i32", "WINDOW": "i32",
        **{name: "i32" for name in ("s_qt", "s_qh", "s_ot", "s_oh", "s_block", "s_kv", "s_head", "s_tok", "s_bt")},
        **{name: "constexpr" for name in ("HEAD_DIM", "HEAD_DIM_PAD", "GROUP", "GROUP_PAD", "BLOCK_Q", "BLOCK_N",
                                          "BLOCK_SIZE", "FP32_DOTS", "NUM_SPLITS", "HAS_WINDOW", "HAS_SINKS",
                                          "HAS_SOFTCAP")},
    }


def variants():
    for has_q in (False, True):
        for per_position in (False, True):
            yield (f"spec_verify has_q={has_q} per_position_noise={per_position}", spec_verify._spec_verify_kernel,
                   VERIFY_SIG, {"HAS_DRAFT_PROBS": has_q, "PER_POSITION_NOISE": per_position,
                                "COUPLED": per_position and not has_q, "BLOCK_V": 2048, "BLOCK_K": 16}, 8)
    # one variant per dtype and shape family we launch (the float32 one, FMA dots, is the slowest to build)
    # (window, sinks, softcap): plain; GPT-OSS's sliding layers; Gemma 2's capped sliding layers
    for dt, head_dim, group, block_size, splits, (window, sinks, cap) in (
            ("fp32", 64, 1, 16, 1, (False, False, False)), ("bf16", 128, 4, 16, 1, (False, False, False)),
            ("fp16", 128, 8, 32, 1, (False, False, False)), ("bf16", 80, 6, 16, 1, (False, False, False)),
            ("bf16", 128, 4, 16, 8, (False, False, False)), ("bf16", 64, 8, 16, 1, (True, True, False)),
            ("bf16", 256, 2, 16, 1, (True, False, True))):
        group_pad = 1 << (group - 1).bit_length()
        yield (f"paged_attention {dt} head_dim={head_dim} group={group} block_size={block_size} splits={splits} "
               f"window={window} sinks={sinks} softcap={cap}",
               paged_attention._paged_attention_kernel, paged_attention_sig(dt),
               {"HEAD_DIM": head_dim, "HEAD_DIM_PAD": 1 << (head_dim - 1).bit_length(), "GROUP": group,
                "GROUP_PAD": group_pad, "BLOCK_Q": max(1, 64 // group_pad), "BLOCK_N": 64,
                "BLOCK_SIZE": block_size, "FP32_DOTS": dt == "fp32", "NUM_SPLITS": splits,
                "HAS_WINDOW": window, "HAS_SINKS": sinks, "HAS_SOFTCAP": cap}, 4)
    for fmt in ("int8", "fp8"):
        for dt in ("fp32", "bf16", "fp16"):
            pack_sig = {"kv_ptr": f"*{dt}", "block_ids_ptr": "*i64", "payload_ptr": WIRE[fmt], "scales_ptr": "*fp32",
                        **_STRIDES, "QMAX": "constexpr", "IS_FP8": "constexpr", "BLOCK": "constexpr"}
            yield (f"kv pack {fmt} {dt}", kv_quant._pack_kernel, pack_sig,
                   {"QMAX": kv_quant.QMAX[fmt], "IS_FP8": fmt == "fp8", "BLOCK": 1024}, 4)
            unpack_sig = {"payload_ptr": WIRE[fmt], "scales_ptr": "*fp32", "kv_ptr": f"*{dt}", "block_ids_ptr": "*i64",
                          **_STRIDES, "OUT_BF16": "constexpr", "BLOCK": "constexpr"}
            yield (f"kv unpack {fmt} {dt}", kv_quant._unpack_kernel, unpack_sig, {"OUT_BF16": dt == "bf16", "BLOCK": 1024}, 4)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    args = ap.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    failed = 0
    for name, fn, sig, constexprs, warps in variants():
        try:
            compiled = triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=target, options={"num_warps": warps, "enable_fp_fusion": False})
            print(f"ok      {name}  ({len(compiled.asm['cubin'])} bytes of sm_{args.arch} cubin)")
        except Exception as e:  # noqa: BLE001 - report every variant, then fail
            failed += 1
            print(f"FAILED  {name}: {type(e).__name__}: {str(e)[:2000]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
