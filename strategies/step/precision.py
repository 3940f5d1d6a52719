"""``training.precision`` as each backend runs it.

One setting, ``fp32 | bf16 | fp16``, and each strategy maps it to its own mechanism (the table is
in docs/precision.md): single and DDP run the forward pass under ``torch.autocast`` (with a
GradScaler for fp16), FSDP1 and FSDP2 gather their parameters in the low dtype (``MixedPrecision``,
``MixedPrecisionPolicy``), DeepSpeed keeps the module in the low dtype with fp32 master copies
(its ``bf16``/``fp16`` blocks), Accelerate autocasts (``mixed_precision``). In every case the
parameters the optimizer updates stay float32 and the loss is computed in float32.

:class:`Amp` is the part engines run themselves: the autocast context and the gradient scaler.
"""

from __future__ import annotations

import contextlib
from typing import Any, overload

import torch

from strategies.sections import TrainingConfig

LOW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def low_dtype(training: TrainingConfig) -> torch.dtype | None:
    """The dtype mixed precision computes in; None for full precision."""
    return LOW_DTYPES.get(training.precision)


@overload
def dtype_name(dtype: torch.dtype) -> str: ...
@overload
def dtype_name(dtype: torch.dtype | None) -> str | None: ...
def dtype_name(dtype: torch.dtype | None) -> str | None:
    """``bfloat16`` for ``torch.bfloat16``; None for no dtype."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


class Amp:
    """Autocast (``dtype`` None: off) and a gradient scaler (None: off), as torch.amp runs them.
    With neither it does nothing, so every engine holds one."""

    def __init__(self, device_type: str = "cpu", dtype: torch.dtype | None = None, scaler: Any = None) -> None:
        self.device_type, self.dtype, self.scaler = device_type, dtype, scaler

    @classmethod
    def autocast(cls, training: TrainingConfig, device_type: str) -> Amp:
        """Autocast in the experiment's low dtype, with a GradScaler for fp16 (whose narrow
        exponent range lets small gradients underflow unless the loss is scaled up first)."""
        scaler = torch.amp.GradScaler(device_type) if training.precision == "fp16" else None
        return cls(device_type, low_dtype(training), scaler)

    @classmethod
    def sharded_scaler(cls, training: TrainingConfig, device_type: str) -> Amp:
        """No autocast (the backend casts its parameters itself), but for fp16 a scaler that agrees
        over ranks whether any shard's gradient overflowed, so every rank skips the same steps."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return cls(device_type, None, ShardedGradScaler(device=device_type) if training.precision == "fp16" else None)

    def context(self) -> contextlib.AbstractContextManager:
        return (
            torch.autocast(self.device_type, dtype=self.dtype) if self.dtype is not None else contextlib.nullcontext()
        )

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Before clipping: the gradients in their true units."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step; with a scaler, skipped where a gradient overflowed, and the scale adjusted."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def describe(self, cast: str | None = None) -> str:
        """The mechanism in words: ``cast``, how the backend casts (else this autocast), and the scaler."""
        if cast is None and self.dtype is not None:
            cast = f"torch.autocast({dtype_name(self.dtype)})"
        parts = [cast] if cast else []
        parts += [type(self.scaler).__name__] if self.scaler is not None else []
        return " + ".join(parts) or "none"
