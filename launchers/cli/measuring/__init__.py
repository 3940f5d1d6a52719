"""Subcommands that measure this machine: kernels, links, and the fused op's build."""
