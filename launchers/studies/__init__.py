"""Studies and sweeps: a base experiment times a matrix of axes, run point by point."""
