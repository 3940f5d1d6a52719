"""The optional parts of kanscale (pyproject.toml's extras) and the one check a feature makes
before it imports one of them.

A plain ``pip install kanscale`` trains every strategy on the zoo's own families and tasks; what
only some users need (pykan and the study's reference model, scikit-learn's bundled datasets,
Parquet files, Accelerate's DeepSpeed plugin) is an extra. A feature that needs one calls
:func:`require` where its config is validated, so a missing package is named with the line that
installs it before any process starts, rather than as a ModuleNotFoundError on every rank.
"""

from __future__ import annotations

import importlib.util

from kanscale.errors import ConfigError

# extra -> {module it imports: distribution that provides it}; tests/test_extras.py checks that
# pyproject.toml's extras list these distributions and that `all` holds every extra.
EXTRAS: dict[str, dict[str, str]] = {
    # pykan imports scikit-learn (and matplotlib, a dependency of the report) without declaring it
    "pykan": {"kan": "pykan", "sklearn": "scikit-learn"},
    "sklearn": {"sklearn": "scikit-learn"},
    "parquet": {"pyarrow": "pyarrow"},
    # Accelerate's DeepSpeed plugin hands its config to Transformers' HfDeepSpeedConfig
    "hf": {"transformers": "transformers"},
    # tracking.report_to: the trackers' own libraries write what they read
    "tensorboard": {"tensorboard": "tensorboard"},
    "mlflow": {"mlflow": "mlflow-skinny"},
}


def installed(module: str) -> bool:
    """Whether ``module`` (a top-level name) can be imported here, without importing it: pykan's
    import alone takes seconds."""
    return importlib.util.find_spec(module) is not None


def install_line(extra: str) -> str:
    return f"pip install 'kanscale[{extra}]'"


def require(extra: str, feature: str) -> None:
    """Raise ConfigError naming ``feature``, the missing distributions and the line that installs
    ``extra``, unless every module of the extra can be imported."""
    missing = [dist for module, dist in EXTRAS[extra].items() if not installed(module)]
    if missing:
        raise ConfigError(
            f"{feature} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not installed: "
            f"{install_line(extra)} (in a checkout, make install installs every extra)"
        )
