"""The backends: one module per strategy behind the Engine contract (strategies/step/engine.py,
strategies/strategy.py), and what each needs of its own: DeepSpeed's config, Accelerate's launch
files, tensor parallelism's plan, sharded checkpoints."""
