"""One training step's parts every backend shares: the engine, its optimizer, the learning-rate
schedule, precision and the compiled step."""
