"""``task.name: sklearn``: the small datasets that ship inside scikit-learn (no download), named.

task: {name: sklearn, dataset: digits}      # 1,797 8x8 images flattened: 64 inputs, 10 classes
"""

from __future__ import annotations

from functools import cache
from typing import Literal

import numpy as np
from pydantic import Field

from kan_models.tasks.data import DataTask, Table, as_classes
from kanscale.extras import require

Dataset = Literal["digits", "wine", "breast_cancer", "iris", "diabetes"]
# dataset -> (scikit-learn's loader, whether its target is a class)
BUNDLED: dict[Dataset, tuple[str, bool]] = {
    "digits": ("load_digits", True),  # 1,797 x 64 pixel intensities, 10 classes
    "wine": ("load_wine", True),  # 178 x 13, 3 classes
    "breast_cancer": ("load_breast_cancer", True),  # 569 x 30, 2 classes
    "iris": ("load_iris", True),  # 150 x 4, 3 classes
    "diabetes": ("load_diabetes", False),  # 442 x 10, disease progression (regression)
}


class SklearnTask(DataTask):
    name: Literal["sklearn"]
    dataset: Dataset = Field(description="digits, wine, breast_cancer, iris (classification), diabetes (regression)")

    @property
    def label(self) -> str:
        return f"sklearn {self.dataset}"

    def table(self) -> Table:
        return load_bundled(self.dataset)


@cache
def load_bundled(dataset: Dataset) -> Table:
    require("sklearn", "task.name: sklearn")
    import sklearn.datasets

    loader, is_class = BUNDLED[dataset]
    x, y = getattr(sklearn.datasets, loader)(return_X_y=True)
    if is_class:
        labels, classes = as_classes(y, dataset)
        return Table(x.astype(np.float64), labels, classes)
    return Table(x.astype(np.float64), y.astype(np.float64))
