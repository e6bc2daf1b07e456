"""The runtime: loads compiled kernels from the database and launches them. Never imports
cutlass, optuna, the compiler or the test and benchmark harness (moe_aot.harness)."""
