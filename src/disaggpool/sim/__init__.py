"""The discrete-event simulator of a prefill/decode pool, and the tools that run it.

`cluster` runs one pool over one trace with a `core.policies` object, exactly the one the sidecar
runs; `workload` and `prefix_workload` make traces, `pools` and `capacity` size pools, `runner`
fans runs out to processes, `metrics` scores them, `operating_point` and `placement` search load
and roles, `elastic` scales the decode pool as it runs. `scenario` (`sim run`) and `plan` run the
user's own description. The experiments built on it are `disaggpool.studies`.
"""
