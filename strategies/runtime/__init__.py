"""Where the ranks are: the process group, the device mesh, and the samples each rank trains on."""
