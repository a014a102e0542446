"""Where and at what precision training runs: the device, bf16 autocast, and the allocator setting.

Shared by the loop (transfer/train.py), the LM and classifier code that evaluates with autocast, and the
stages that place a model; kept apart so that those need not import the loop to pick a device.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from pathlib import Path

import torch

from transfer.errors import TransferError

__all__ = ["pick_device", "keep_freed_memory", "cpu_supports_bf16", "autocast", "describe", "resolved_precision"]


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory in the process instead of handing it back to the kernel.

    By default every allocation over 32 MB (an LM's logits and their gradients: 64 x 70 x 16k floats) is a fresh
    mmap, unmapped again when freed, so every training step page-faults all of it back in. Measured on a 2-core VM
    (`python bench/allocator.py`): 400k page faults a step, 44% of the CPU time in the kernel, 3,252 -> 6,559 tok/s
    with the heap kept (16k vocab, 256/512, bs 64 x bptt 70, bf16). Process-wide and idempotent; returns False
    where the C library is not glibc (nothing changed).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # from glibc's malloc.h
    # no mmap'd chunks; trim the heap top only past 2 GB free (2**31 - 1 is the largest an int argument can say)
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


@functools.cache
def cpu_supports_bf16() -> bool:
    """True where the CPU computes bf16 natively (AVX-512 BF16 or AMX); elsewhere it is emulated or missing."""
    if "AMX" in torch.backends.cpu.get_cpu_capability():
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:  # not Linux: no cheap, reliable way to tell
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def describe(device: torch.device | None = None) -> str:
    """What trains: the GPU's name, or the CPU's model name and what it computes natively ('cpu: AMD EPYC ... (AVX2)')."""
    device = device or pick_device()
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    try:
        name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        name = "unknown model"
    return f"cpu: {name} ({torch.backends.cpu.get_cpu_capability()})"


def resolved_precision(precision: str, device: torch.device | None = None) -> str:
    """What `autocast` makes of a precision setting here: 'bf16' or 'fp32'."""
    device = device or pick_device()
    bf16 = precision == "bf16" or (precision == "auto" and (device.type == "cuda" or cpu_supports_bf16()))
    return "bf16" if bf16 else "fp32"


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast when asked ('bf16'), or for 'auto' on CUDA and on bf16-capable CPUs; fp32 otherwise.

    Measured on AVX-512 BF16 (2 cores, 256/512 LM, 300k tokens): 1.55x tokens/s, WikiText-2 ppl within 0.1%.
    Autocast keeps weights and optimizer state in fp32; losses are computed on `.float()` logits.
    """
    if precision == "bf16" and device.type == "cpu" and not cpu_supports_bf16():
        # emulated bf16 would only be slower, and torch's oneDNN LSTM has no bf16 kernel there: it fails mid-step
        raise TransferError(f"precision 'bf16' needs a CPU with native bf16 (AVX-512 BF16 or AMX); this one has "
                            f"{torch.backends.cpu.get_cpu_capability()}: set precision to 'auto' or 'fp32'")
    use_bf16 = precision == "bf16" or (precision == "auto" and (device.type == "cuda" or cpu_supports_bf16()))
    return torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()
