"""The calibration probe: measure one vLLM pod over HTTP (`probe`, orchestrating `client` and
`stages`), fit its profile (`fit`, `assemble`), deliver it to a file, stdout or a Kubernetes
ConfigMap (`sinks`); `common` holds the data they share."""
