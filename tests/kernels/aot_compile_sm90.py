"""Compile every kernel ahead of time for sm_90 (H100/H200) without a GPU; run as a script.

The Triton interpreter runs kernels as NumPy code and never exercises the compiler, so type errors
in loops, tl.dot shape rules or lowering failures would otherwise only show on a GPU.
``triton.compile`` with an explicit ``GPUTarget`` lowers to a cubin with the ptxas bundled in
Triton's wheel; no device is needed. Must run with TRITON_INTERPRET unset (the interpreter patches
``triton.language``), hence a separate process (see test_kernels_compile.py).

Exit status: 0 all compiled, 1 a kernel failed, 3 no usable ahead-of-time toolchain (skip).
"""

import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("aot_compile_sm90.py: unset TRITON_INTERPRET")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import triton  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as e:  # pragma: no cover - depends on the Triton build
    print(f"no ahead-of-time compile API: {e}")
    sys.exit(3)

import kernels.paged_decode as paged_decode  # noqa: E402
import kernels.paged_prefill as paged_prefill  # noqa: E402
import kernels.store_kv as store_kv  # noqa: E402

_PTR = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}
_INDEX_PTRS = {"block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
               "slot_ptr": "*i64", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32"}


def compile_sm90(fn, dtype, constexprs: dict, num_warps: int, num_stages: int = 3) -> None:
    """Lower one specialisation of a ``@triton.jit`` kernel to an sm_90 cubin (raises on failure)."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = _INDEX_PTRS.get(name, _PTR[dtype])
        elif name == "qk_scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    src = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    assert compiled.asm.get("cubin"), "no cubin produced"


def cases():
    """(label, thunk) per kernel specialisation: fp32/fp16/bf16 x (head_dim 128, GQA 4), (64, MHA)."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for head_dim, group in ((128, 4), (64, 1)):
            tag = f"{str(dtype).removeprefix('torch.')} head_dim={head_dim} group={group}"
            block_d, block_n, warps, stages = paged_decode._launch_config(head_dim, dtype)
            for direct in (False, True):
                consts = dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=16,
                              BLOCK_N=block_n, BLOCK_D=block_d, IEEE_DOT=dtype == torch.float32, DIRECT_OUT=direct)
                yield (f"decode partial direct={direct} {tag}",
                       lambda c=consts, d=dtype, w=warps, s=stages:
                       compile_sm90(paged_decode._decode_partial_kernel, d, c, w, s))
            yield (f"decode reduce {tag}", lambda d=dtype, b=block_d:
                   compile_sm90(paged_decode._decode_reduce_kernel, d, dict(SPLITS_PAD=8, BLOCK_D=b), 4))
            block_d, block_m, block_n, warps, stages = paged_prefill._launch_config(head_dim, dtype)
            consts = dict(GROUP=group, BLOCK_SIZE=16, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                          IEEE_DOT=dtype == torch.float32)
            yield (f"prefill {tag}", lambda c=consts, d=dtype, w=warps, s=stages:
                   compile_sm90(paged_prefill._prefill_kernel, d, c, w, s))
            yield (f"store_kv {tag}", lambda d=dtype, b=block_d:
                   compile_sm90(store_kv._store_kv_kernel, d, dict(BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=b), 4))


def main() -> int:
    failed = 0
    for label, thunk in cases():
        try:
            thunk()
            print(f"ok    {label}")
        except Exception as e:  # report every failure, not just the first
            if "ptxas" in str(e).lower() and "not found" in str(e).lower():
                print(f"no usable ptxas: {e}")
                return 3
            failed += 1
            print(f"FAIL  {label}: {type(e).__name__}: {str(e)[:2000]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
