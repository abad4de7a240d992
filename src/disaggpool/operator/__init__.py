"""The Kopf operator that turns a `DisaggPool` custom resource into a calibrated, routed P/D pool.

Modules, in data-flow order (docs/operator.md has the picture):

* `spec`     -- the typed spec: parse and validate a CR's ``spec`` (pure; errors name the field);
* `render`   -- pure functions from (pool, spec) to Kubernetes objects and from observed objects to
  the CR's status (tested with golden files);
* `kube`     -- the only module that talks to the Kubernetes API (async REST over aiohttp);
* `reconcile` -- one idempotent reconcile pass of a pool, written against `kube`;
* `handlers` -- the Kopf wiring: which events trigger a reconcile, coalescing per pool.

`disaggpool operator` runs it (``kopf run`` of `handlers`).
"""
