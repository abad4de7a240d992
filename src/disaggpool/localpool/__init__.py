"""A pool of the product's own processes on one machine: emulated vLLM pods, the probe, sidecars.

What the demo, the benches and the end-to-end tests share to run the real commands (`disaggpool
emulate`, `calibrate`, `sidecar`) as child processes on loopback:

* `processes`: free ports, the command line, readiness waits, teardown;
* `pods`: emulated pods started from profiles, their gauges read, their prefix caches emptied;
* `probe`: every pod calibrated by `disaggpool calibrate`, as the operator's Job does;
* `sidecar`: a routing sidecar in front of the pods, and what it routed where;
* `envoy`: a real Envoy in front of a sidecar's endpoint picker (binary given by the caller).

It runs those commands and never imports them, so what runs is what a user runs.
"""
