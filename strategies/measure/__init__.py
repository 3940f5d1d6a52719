"""What a run measures the same way under every strategy: step timing, the compute-only baseline,
exposed communication, memory, the environment, and the record built from them."""
