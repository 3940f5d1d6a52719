"""HOW a model is trained across ranks: one module per backend behind the :class:`Engine`
interface, the strategy-agnostic training loop, and the measurements it records."""
