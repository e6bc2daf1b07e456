"""The test and benchmark harness: fp32 references of every kernel (reference, fp8), random
inputs and stage-by-stage checks against them (verify), the CUDA-graph timer (measure). Plain
torch on top of the runtime, for the tests, `moe-aot verify`, the tuner's measuring side and
tools/; the runtime and the integrations' GPU paths never import it."""
