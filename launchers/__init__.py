"""HOW runs are started and driven: the ``kanscale`` CLI (one module per subcommand), the
launcher command builders, SLURM scripts, studies and sweeps, and the benchmarks the CLI runs."""
