"""HOW a model is trained across ranks: one module per backend behind the :class:`Engine`
interface (strategies/engine.py) and the options base class (strategies/config.py), the
strategy-agnostic training loop, data sharding, checkpoints, failures, and the measurements a
run records."""
