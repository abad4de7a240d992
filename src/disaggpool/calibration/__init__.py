"""The calibration probe: measure one vLLM pod over HTTP (`probe`), fit its profile (`fit`),
deliver it to a file, stdout or a Kubernetes ConfigMap (`sinks`)."""
