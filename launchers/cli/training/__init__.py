"""Subcommands that train: one run, a launch, a sweep, and a run's export."""
