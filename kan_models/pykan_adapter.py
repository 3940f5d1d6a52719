"""The published study's model, built by pykan itself: ``KAN(width=[2, W, 1], grid=10, k=3,
seed=...)``, pykan's MultKAN with its defaults (symbolic branch on, activations saved for
plotting, grid on [-1, 1]).

Two pykan habits are contained here: it writes checkpoints into ``./model`` unless told not to
(``auto_save=False``, and its checkpoint path points into a temporary directory in case a pykan
tool saves anyway), and it reseeds Python's, NumPy's and torch's global generators (the
constructor runs under a saved-and-restored RNG state).
"""

from __future__ import annotations

import random
import tempfile
from typing import ClassVar, Literal

import numpy as np
import torch
from pydantic import Field, model_validator
from torch import nn

from kan_models.base import ModelConfig, ParamCount, Seed
from kanscale.extras import require


class PyKANModel(nn.Module):
    """Wraps a pykan ``MultKAN`` so it behaves like the rest of the zoo."""

    def __init__(
        self,
        widths: list[int],
        grid: int,
        k: int,
        seed: int,
        grid_range: tuple[float, float],
        symbolic_enabled: bool,
        save_act: bool,
    ) -> None:
        super().__init__()
        from kan import KAN  # imported here: pykan's import pulls in sympy, sklearn and matplotlib

        self._ckpt_dir = tempfile.TemporaryDirectory(prefix="kanscale-pykan-")
        py_state, np_state = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[]):
            self.kan = KAN(
                width=list(widths),
                grid=grid,
                k=k,
                seed=seed,
                grid_range=list(grid_range),
                symbolic_enabled=symbolic_enabled,
                save_act=save_act,
                auto_save=False,
                ckpt_path=self._ckpt_dir.name,
            )
        random.setstate(py_state)
        np.random.set_state(np_state)

    @property
    def blocks(self) -> list[nn.Module]:
        return list(self.kan.act_fun)

    supports_grid_update = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kan(x)

    @torch.no_grad()
    def update_grid(self, x: torch.Tensor) -> None:
        self.kan.update_grid(x)


class PyKANConfig(ModelConfig):
    """pykan's own MultKAN (the published study's model), for reference runs."""

    family: Literal["pykan"]
    identity: ClassVar[tuple[str, ...]] = ("grid", "k")
    resolution: ClassVar[dict[str, str]] = {"grid": "grid", "order": "k"}
    grid: int = Field(10, ge=1, le=1000, description="number of grid intervals")
    k: int = Field(3, ge=1, le=5, description="spline order")
    seed: Seed | None = Field(
        None, description="pykan's seed (0 <= seed < 2^32); default: the experiment's training.seed"
    )
    grid_range: tuple[float, float] = (-1.0, 1.0)
    symbolic_enabled: bool = Field(True, description="pykan default; the symbolic branch costs time")
    save_act: bool = Field(True, description="pykan default; keeps activations for plotting")

    @model_validator(mode="after")
    def _installed(self) -> PyKANConfig:
        require("pykan", "model.family: pykan")
        return self

    def parameter_count(self) -> ParamCount:
        # pykan fits its initial splines by least squares while it builds, which the meta device
        # cannot run. Its layer holds a B-spline layer's parameters and more (the symbolic
        # branch, node scales): the B-spline count is a lower bound, enough to refuse a model
        # that cannot fit.
        from kan_models.bspline import BSplineConfig  # pykan's layer is this one's superset

        return BSplineConfig(family="bspline", widths=self.widths, grid=self.grid, k=self.k).parameter_count()

    def refits_grids(self) -> bool:
        return True  # pykan's own update_grid (a sketch on the meta device cannot be built, above)

    def build(self) -> PyKANModel:
        seed = self.seed if self.seed is not None else torch.initial_seed()
        return PyKANModel(self.widths, self.grid, self.k, seed, self.grid_range, self.symbolic_enabled, self.save_act)
