"""The Kopf operator that turns a `DisaggPool` custom resource into a calibrated, routed P/D pool.

Modules, in data-flow order (docs/operator.md has the picture):

* `spec`     -- the typed spec: parse and validate a CR's ``spec`` (pure; errors name the field);
* `names`    -- object names, common labels, the owner reference and spec hash (pure);
* `render`   -- the pool's workloads from (pool, spec): vLLM Deployments and Services, the router
  (pure, tested with golden files);
* `access`   -- the router's and the probe's RBAC and the pool's NetworkPolicies (pure);
* `gateway`  -- gateway mode (``router.mode: gateway``): the InferencePool, the decode pods'
  pd-proxy container, the router's ext_proc listener (pure; used by `render`);
* `observed` -- pods, profile ConfigMaps and probe Jobs read back, as small views (pure);
* `calibration_plan` -- which pods need a probe, its Job and ConfigMap, what to prune (pure);
* `status`   -- the CR's status and conditions (pure);
* `reconcile` -- one idempotent reconcile pass of a pool, through `disaggpool.kubeclient`;
* `handlers` -- the Kopf wiring: which events trigger a reconcile, coalescing per pool.

`disaggpool operator` runs it (``kopf run`` of `handlers`).
"""
