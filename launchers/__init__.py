"""HOW runs are started and driven: the ``kanscale`` CLI (``cli/``: one module per subcommand),
starting the ranks (``launch/``: the request, its resolution and checks, each launcher's commands,
ssh and SLURM), studies and sweeps (``studies/``), and the tools the CLI runs beside them (the
kernel and collective benchmarks, the projection, the end-of-run summary)."""
