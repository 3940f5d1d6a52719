"""A run's life outside its steps: the checks before launch, checkpoints and resume, the run lock, failures, export."""
