"""A rehearsal: one or a few steps of a strategy's own code at a target's world size and mesh, run
here in one process as one of the target's ranks, on torch's fake process group (collectives
issued and counted, nothing sent). What it reports is what that rank would hold and issue:
model state, tensor memory by category at the step's peak, every collective with its group and
bytes, FLOPs and kernels (docs/rehearsal.md)."""
