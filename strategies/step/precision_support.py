"""Whether this machine can compute in ``training.precision`` the way a backend does, asked
before launch as the backend asks when it starts.

Backends check their hardware only once they run: DeepSpeed's engine raises "Type fp16 is not
supported on your device." inside ``deepspeed.initialize``, after its C++ ops are built (minutes on
a cold cache), and CUDA autocast in bf16 on a GPU without it warns and computes in float32 while
the record would say bf16. The two answers here are the backends' own, asked without starting
them; each strategy class says which applies to it (``StrategyConfig.missing_precision_support``):

- :func:`autocast_lacks`: ``torch.autocast`` and FSDP's mixed precision (single, DDP, FSDP1/2, TP,
  Accelerate without its DeepSpeed plugin) compute bf16 and fp16 on any CPU; on CUDA, bf16 needs
  the GPU's support.
- :func:`deepspeed_lacks`: DeepSpeed's CPU accelerator (``CPU_Accelerator.is_fp16_supported``) runs
  fp16 only where oneDNN has fp16 kernels (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``:
  AVX512-FP16 or AMX-FP16 on x86, Intel Sapphire Rapids and later; AMD EPYC has neither), bf16
  always; its CUDA accelerator takes fp16 from compute capability 7.0 and bf16 where
  ``torch.cuda.is_bf16_supported()``.

A CUDA run checked on a machine without GPUs (a SLURM login node) is not refused here: every rank
asks again on its own node. ``tests/test_precision.py`` checks that :func:`cpu_fp16_supported`
answers as DeepSpeed does.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from kanscale.errors import ConfigError
from kanscale.machine import cpu_model


def cpu_fp16_supported() -> bool:
    """Whether oneDNN has fp16 kernels on this CPU: what DeepSpeed's CPU accelerator asks."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False


def _gpu() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"this GPU ({torch.cuda.get_device_name()}, compute capability {major}.{minor})"


def autocast_lacks(precision: str, device_type: str) -> str | None:
    """What this machine lacks for ``precision`` under autocast or FSDP's mixed precision, in words; None: nothing."""
    if (
        precision == "bf16"
        and device_type == "cuda"
        and torch.cuda.is_available()
        and not torch.cuda.is_bf16_supported()
    ):
        return f"{_gpu()} has no bf16 support (torch.cuda.is_bf16_supported() is False)"
    return None


def deepspeed_lacks(precision: str, device_type: str) -> str | None:
    """What this machine lacks for ``precision`` under DeepSpeed's own fp16/bf16 engine; None: nothing."""
    if precision == "fp16" and device_type == "cpu" and not cpu_fp16_supported():
        return (
            f"DeepSpeed's CPU accelerator runs fp16 only on CPUs with oneDNN fp16 kernels (AVX512-FP16 or "
            f"AMX-FP16), which this CPU ({cpu_model()}) lacks"
        )
    if (
        precision == "fp16"
        and device_type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability()[0] < 7
        and os.environ.get("DS_ALLOW_DEPRECATED_FP16") != "1"
    ):
        return f"DeepSpeed runs fp16 from compute capability 7.0, which {_gpu()} is below"
    return autocast_lacks(precision, device_type)


def precision_problem(
    precision: str, device_type: str, backend: str, lacks: Callable[[str, str], str | None]
) -> str | None:
    """The one-line refusal of ``precision`` under ``backend`` where ``lacks`` says this machine
    cannot compute in it: what is missing and what to use instead; None where it can."""
    lack = None if precision == "fp32" else lacks(precision, device_type)
    if lack is None:
        return None
    instead = "bf16" if precision != "bf16" and lacks("bf16", device_type) is None else "fp32"
    return (
        f"training.precision: {precision} under {backend} cannot run on this {device_type} machine: {lack}; set "
        f"training.precision={instead}" + (" (or fp32)" if instead != "fp32" else "")
    )


def check_precision_support(
    precision: str, device_type: str, backend: str, lacks: Callable[[str, str], str | None]
) -> None:
    """Raise :func:`precision_problem`'s refusal as a ConfigError, where there is one."""
    problem = precision_problem(precision, device_type, backend, lacks)
    if problem is not None:
        raise ConfigError(problem)
