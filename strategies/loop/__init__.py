"""The strategy-agnostic training loop: the trainer, its batches (the suite's split or a DataLoader), progress."""
