"""The pure core: profiles, contracts, the router, the cost model, routing policies, predictors.

`router` is what happens to one request at the router (predict, look up the prefix index, decide,
book, bind the decode pod late, learn from the end), over `pods` (the pool as last observed, and
the books of `ledger`); `policies` decide, with `costmodel`'s prices. No I/O and no clock
(enforced by `lint-imports`, docs/architecture.md): the simulator, the sidecar and the demo call
the very same objects with `now` and a seeded random generator as arguments.
"""
