"""Starting the ranks: what a run asks for, what it resolves to, the checks before launch, and
each launcher's commands (torchrun, accelerate, deepspeed over ssh, SLURM)."""
