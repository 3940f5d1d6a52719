"""``kanscale recommend``: measure briefly here (probe), place the training on a target (target),
lay out and rank the strategies (advise), print and write the answer (report), and check the
picks against real runs (validate)."""
