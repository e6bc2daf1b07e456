"""The runtime: loads compiled kernels from the database and launches them. Never imports
cutlass, optuna or the compiler."""
