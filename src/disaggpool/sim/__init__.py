"""The discrete-event simulator of a prefill/decode pool and the experiments built on it.

`cluster` runs one pool over one trace with a `core.policies` object, exactly the one the sidecar
runs; `runner` fans runs out to processes; `paper` and `scenario` are the two commands' experiments.
"""
