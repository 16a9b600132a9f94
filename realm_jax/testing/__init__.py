"""Small configs and synthetic batches shared by tests, benchmarks and demos."""
