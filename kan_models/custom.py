"""``model.family: custom``: any ``nn.Module`` a user's own function builds, trained under every
strategy like the zoo's families.

    model:
      family: custom
      widths: [64, 10]                      # the model's input and output widths, checked against the task
      factory: "my_kans.models:build_kan"   # a module on the Python path and a function in it,
      # factory: "models/my_kan.py:build_kan"   or a file (relative to the working directory)
      options: {hidden: [128, 64], grid: 8}   # keyword arguments of the function
      wrap: {classes: [MyKANLayer]}         # the FSDP units (default: below)

The factory is imported when the experiment is validated, so a wrong name is refused before
anything is launched; it is called with ``options`` on every rank, under the experiment's seed,
and with ``widths=model.widths`` too where it names a ``widths`` parameter (so the widths the task
is checked against are written once). A factory that takes only ``**kwargs`` is not given them:
it may hand its keywords on to a constructor that has no ``widths``.
Importing it runs the user's own module, as ``python -c "import my_kans"`` would: it is code the
user chose to train, not data handed over.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, ValidationInfo, field_validator
from torch import nn

from kan_models.base import ModelConfig
from kanscale.errors import ConfigError


def load_factory(spec: str) -> Callable[..., nn.Module]:
    """The function ``module.path:function`` or ``file.py:function`` names. A ValueError says what
    is wrong, without the field's name: the validator raises it, and the config error that
    reports it names the field (``model.factory: ...``) once."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ValueError(f"{spec!r} is not 'package.module:function' or 'path/to/file.py:function'")
    try:
        module = import_file(Path(where)) if where.endswith(".py") else importlib.import_module(where)
    except SystemExit as err:  # a script that runs itself on import: sys.exit(main())
        raise ValueError(
            f"importing {where} called sys.exit({err.code!r}); run the script's own code only under "
            '`if __name__ == "__main__":`, so that importing it defines the factory'
        ) from None
    except Exception as err:  # whatever the user's module raises while it is imported, not only ImportError
        raise ValueError(f"cannot import {where} ({type(err).__name__}: {err})") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        found = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__)
        close = difflib.get_close_matches(name, found, n=1)
        raise ValueError(
            f"{where} has no function {name!r}"
            + (f" (it has {', '.join(found)})" if found else "")
            + (f"; did you mean '{where}:{close[0]}'?" if close else "")
        )
    return factory


def takes_widths(factory: Callable[..., nn.Module]) -> bool:
    """Whether the factory names a ``widths`` parameter that can be given by keyword."""
    try:
        parameter = inspect.signature(factory).parameters.get("widths")
    except (TypeError, ValueError):  # a callable without a signature Python can read (some builtins)
        return False
    return parameter is not None and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)


def import_file(path: Path):
    """A Python file as a module (cached by its resolved path, so every call gets the same one)."""
    if not path.is_file():
        raise OSError(f"no file {path} (relative paths are from {Path.cwd()})")
    key = f"kanscale_custom_{abs(hash(str(path.resolve())))}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, path)
        if spec is None or spec.loader is None:
            raise OSError(f"{path} cannot be loaded as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[key]
            raise
    return sys.modules[key]


class CustomConfig(ModelConfig):
    """Any nn.Module from a user's function: model.factory and model.options (model.wrap: its FSDP units)."""

    family: Literal["custom"]
    factory: str = Field(description="'package.module:function' or 'path/to/file.py:function' returning an nn.Module")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the factory")

    @field_validator("factory")
    @classmethod
    def _importable(cls, factory: str) -> str:
        load_factory(factory)
        return factory

    @field_validator("options")
    @classmethod
    def _widths_given_once(cls, options: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        factory = info.data.get("factory")  # absent where it was refused
        if "widths" in options and factory and takes_widths(load_factory(factory)):
            raise ValueError(
                f"{factory} is given model.widths as its widths; leave widths out of model.options (set model.widths)"
            )
        return options

    def build(self) -> nn.Module:
        factory = load_factory(self.factory)
        widths = {"widths": list(self.widths)} if takes_widths(factory) else {}
        try:
            model = factory(**widths, **self.options)
        except Exception as err:  # the user's code: say where it failed, keep its traceback
            called = "widths=model.widths, **model.options" if widths else "**model.options"
            raise ConfigError(f"model.factory: {self.factory}({called}) failed: {type(err).__name__}: {err}") from err
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model.factory: {self.factory} returned a {type(model).__name__}, not a torch.nn.Module")
        return model

    def check_shape(self, task: str, inputs: int, outputs: int) -> None:
        """One forward pass of two samples through the model as the factory builds it (on the meta
        device where it allows, else for real on the CPU), its output checked against the task.
        A wrong output width otherwise trained to ``ok`` (a loss that broadcasts), or failed after
        launch (too few class logits). A model with nothing to train is refused too: it failed
        at the first backward, after launch."""
        model = self.sketch()
        if not any(p.requires_grad for p in model.parameters()):
            held = sum(1 for _ in model.parameters())
            why = f"all {held} of its parameters have requires_grad=False" if held else "it has no parameters"
            raise ConfigError(
                f"model.factory: {self.factory} builds a model with no trainable parameter ({why}); "
                "make the factory's model hold at least one parameter that requires grad"
            )
        try:
            out = self._two_samples(model, task, inputs)
        except ConfigError:
            if next((p.device.type for p in model.parameters()), "cpu") != "meta":
                raise
            with torch.random.fork_rng(devices=[]):  # a forward that computes with values meta tensors lack
                out = self._two_samples(self.build(), task, inputs)
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else None
        if shape != (2, outputs):
            got = f"an output of shape {list(shape)}" if shape is not None else f"a {type(out).__name__}"
            raise ConfigError(
                f"model.factory: {self.factory} builds a model that gives {got} for 2 samples, but "
                f"model.widths ends with {self.widths[-1]} and task {task} has {outputs} outputs, so "
                f"[2, {outputs}] was expected; make the factory's model output {outputs} values per "
                "sample (or change the task)"
            )

    def _two_samples(self, model: nn.Module, task: str, inputs: int) -> object:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        try:
            with torch.no_grad():
                return model(torch.zeros(2, inputs, device=device))
        except Exception as err:
            raise ConfigError(
                f"model.factory: {self.factory} builds a model that does not take task {task}'s {inputs} "
                f"inputs (model.widths[0]): {type(err).__name__}: {err}"
            ) from None

    def sketch(self) -> nn.Module:
        """On the meta device where the factory allows it; a factory that computes with its
        tensors while it builds (as pykan does) is built for real, on the CPU."""
        try:
            return super().sketch()
        except ConfigError:
            raise
        except Exception:
            with torch.random.fork_rng(devices=[]):
                return self.build()
