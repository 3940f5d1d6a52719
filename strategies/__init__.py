"""HOW a model is trained across ranks. At the top, the contract every backend meets: the
:class:`Engine` (engine.py), the strategy options base class (strategy.py), the registry, the
experiment and its sections, the process group, precision, the optimizer and the compiled step.
Below it, one folder per role: ``backends/`` (one module per strategy), ``loop/`` (the
strategy-agnostic training loop), ``measure/`` (timing, baseline, communication, memory, the
record) and ``lifecycle/`` (checks before launch, checkpoints, resume, failures, export)."""
