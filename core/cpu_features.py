"""What this CPU runs natively, detected at run time: machines of one kind differ (an AMD EPYC
with AVX-512 bf16, an Intel Xeon with AMX, an older AVX2-only part), so nothing is hard-coded."""
from __future__ import annotations

import functools
from pathlib import Path

import torch

BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo names of the instructions that compute bf16 natively


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The ``flags`` of /proc/cpuinfo (empty where there is none: not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def native_bf16() -> bool:
    """True where the CPU computes bf16 in hardware (AVX512_BF16 or AMX-BF16) and PyTorch dispatches
    its AVX-512 kernels (``ATEN_CPU_CAPABILITY=avx2`` holds them back, and its bf16 attention then
    fails). oneDNN also "supports" bf16 on a plain AVX-512 CPU by emulating it, several times
    slower: that does not count."""
    if "AVX512" not in torch.backends.cpu.get_cpu_capability():
        return False
    flags = cpu_flags()
    if flags:
        return any(flag in flags for flag in BF16_FLAGS)
    try:  # no /proc/cpuinfo: ask PyTorch's own cpuinfo
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:
        return False


def describe_cpu() -> str:
    """One line for error messages and benchmark records: model name, PyTorch's CPU capability, bf16 flags."""
    name = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace").splitlines():
            if line.startswith("model name"):
                name = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    flags = cpu_flags()
    have = [flag for flag in BF16_FLAGS if flag in flags] or ["none"]
    return f"{name}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}, bf16 flags: {', '.join(have)}"


def check_dtype_supported(dtype: torch.dtype, what: str = "the model", kernel_dtypes: tuple[torch.dtype, ...] = ()) -> None:
    """Refuse bfloat16 on a CPU without native bf16 where specdec's C kernels (whose weight dtypes are
    ``kernel_dtypes``) cannot read bf16 weights either, saying which flag is missing and what the CPU has."""
    if dtype == torch.bfloat16 and not native_bf16() and dtype not in kernel_dtypes:
        raise ValueError(f"bfloat16 for {what} needs a CPU with native bf16 (cpuinfo flag {' or '.join(BF16_FLAGS)}) "
                         "or specdec's native kernels (a C compiler and AVX2 with FMA); "
                         f"this one has neither ({describe_cpu()}): use float32")
