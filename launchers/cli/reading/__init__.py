"""Subcommands that read what runs wrote or the suite holds: reports, the paper, the schema, the models."""
