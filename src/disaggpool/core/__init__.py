"""The pure core: profiles, contracts, the cost model, routing policies, output-length predictors.

No I/O and no clock (enforced by `lint-imports`, docs/architecture.md): the simulator, the sidecar
and the demo call the very same objects with `now` and a seeded random generator as arguments.
"""
