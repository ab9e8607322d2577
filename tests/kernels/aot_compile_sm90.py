"""Compile every kernel ahead of time for sm_90 (H100/H200) without a GPU; run as a script.

The Triton interpreter runs kernels as NumPy code and never exercises the compiler, so type errors
in loops, tl.dot shape rules or lowering failures would otherwise only show on a GPU.
``triton.compile`` with an explicit ``GPUTarget`` lowers to a cubin with the ptxas bundled in
Triton's wheel; no device is needed. Each cubin's resource usage is then read with the cuobjdump
bundled next to it (``--dump-resource-usage``): registers are printed, and a kernel with register
spills (a non-zero ``STACK`` or ``LOCAL`` frame) fails, since the launch configs are chosen to avoid
them. Shapes: the served models' heads (SmolLM2-135M: 9 query / 3 KV heads at head_dim 64; an 8B
Llama-3-class model: 32 / 8 at 128) in fp32/fp16/bf16, with the reduce kernel at 2 and 64 splits (its
narrowest and widest). GQA groups up to 16 share one tile shape in the decode kernel (the group is padded to
16 rows), so group 3 also stands for multi-head attention at head_dim 64. Must run with TRITON_INTERPRET
unset (the interpreter patches ``triton.language``), hence a separate process (see
test_kernels_compile.py).

Exit status: 0 all compiled without spills, 1 a kernel failed or spills, 3 no usable ahead-of-time
toolchain (skip).
"""

import os
import re
import subprocess
import sys
import tempfile

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
# (num_q_heads, num_kv_heads, head_dim)
SHAPES = {"135m": (9, 3, 64), "8b": (32, 8, 128)}
_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)")


def _cuobjdump() -> str | None:
    """Path of the cuobjdump bundled with Triton's NVIDIA backend, or None."""
    try:
        path = triton.knobs.nvidia.cuobjdump.path
    except (AttributeError, RuntimeError):
        return None
    return path if path and os.path.isfile(path) else None


def resources(cubin: bytes, cuobjdump: str) -> tuple[int, int, int]:
    """``(registers, stack bytes, local bytes)`` per thread of the one kernel in ``cubin``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True, timeout=60).stdout
    found = _RESOURCES.findall(text)
    if len(found) != 1:
        raise RuntimeError(f"expected one function's resource usage from cuobjdump, got:\n{text}")
    return tuple(int(x) for x in found[0])  # type: ignore[return-value]


def compile_sm90(fn, dtype, constexprs: dict, num_warps: int, num_stages: int = 3) -> bytes:
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
    cubin = compiled.asm.get("cubin")
    assert cubin, "no cubin produced"
    return cubin


def cases():
    """(label, thunk returning a cubin) per kernel specialisation, with the constexprs the wrappers pass."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for shape, (num_q_heads, num_kv_heads, head_dim) in SHAPES.items():
            group = num_q_heads // num_kv_heads
            tag = f"{str(dtype).removeprefix('torch.')} {shape} (Hq={num_q_heads} Hkv={num_kv_heads} D={head_dim})"
            block_d, block_n, warps, stages = paged_decode._launch_config(head_dim, dtype)
            for direct in (False, True):
                consts = dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=16,
                              BLOCK_N=block_n, BLOCK_D=block_d, IEEE_DOT=dtype == torch.float32, DIRECT_OUT=direct)
                yield (f"decode partial direct={direct} {tag}",
                       lambda c=consts, d=dtype, w=warps, s=stages:
                       compile_sm90(paged_decode._decode_partial_kernel, d, c, w, s))
            for splits_pad in (2, triton.next_power_of_2(paged_decode._MAX_SPLITS)):
                yield (f"decode reduce splits<={splits_pad} {tag}", lambda d=dtype, b=block_d, p=splits_pad:
                       compile_sm90(paged_decode._decode_reduce_kernel, d, dict(SPLITS_PAD=p, BLOCK_D=b), 4))
            block_d, block_m, block_n, warps, stages = paged_prefill._launch_config(head_dim, dtype)
            consts = dict(GROUP=group, BLOCK_SIZE=16, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                          IEEE_DOT=dtype == torch.float32)
            yield (f"prefill {tag}", lambda c=consts, d=dtype, w=warps, s=stages:
                   compile_sm90(paged_prefill._prefill_kernel, d, c, w, s))
            consts = dict(BLOCK_SIZE=16, BLOCK_H=triton.next_power_of_2(num_kv_heads),
                          BLOCK_D=triton.next_power_of_2(head_dim))
            yield (f"store_kv {tag}", lambda c=consts, d=dtype: compile_sm90(store_kv._store_kv_kernel, d, c, 4))


def main() -> int:
    cuobjdump = _cuobjdump()
    if cuobjdump is None:
        print("no cuobjdump in Triton's NVIDIA backend: cannot read register use")
        return 3
    failed = 0
    for label, thunk in cases():
        try:
            regs, stack, local = resources(thunk(), cuobjdump)
        except Exception as e:  # report every failure, not just the first
            if "ptxas" in str(e).lower() and "not found" in str(e).lower():
                print(f"no usable ptxas: {e}")
                return 3
            failed += 1
            print(f"FAIL  {label}: {type(e).__name__}: {str(e)[:2000]}")
            continue
        if stack or local:
            failed += 1
            print(f"FAIL  {label}: spills: {regs} registers, stack {stack} B, local {local} B per thread")
        else:
            print(f"ok    {label}: {regs} registers, no spills")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
