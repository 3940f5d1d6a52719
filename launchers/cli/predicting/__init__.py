"""Subcommands that predict before training: projection, recommendation, rehearsal."""
