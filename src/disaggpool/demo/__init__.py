"""`disaggpool demo`: the whole product on one machine, no cluster, no GPU, a few minutes.

1. **Pool.** Four emulators (`disaggpool emulate`, each its own process) timed by hidden *true*
   profiles the router never sees: the built-in A40 Llama-3-8B profile on boards at different
   speeds (`BOARDS`: 1.0, 1.0, 0.55 and 1.25, two nominal boards, a throttled one and a faster
   one), 64 sequences each, prefix caching off (every policy replays the same prompts on the same
   pods; cached, the later replays would prefill nothing). Which boards prefill and which decode
   is chosen as the paper run chooses its split (`placed_pool`, `sim.placement`): for every
   assignment of the boards to the two roles that gives each role at least two of them
   (`--min-pods-per-role`: a role with one pod has no routing decision to make, and the demo
   compares routing), the simulator finds the rate at which round-robin attains 0.85 goodput on
   the demo's trace, and the assignment carrying the most traffic runs (ties to more decode
   pods). It is chosen on the true profiles before any pod starts, without
   looking at any other policy: a pool fixed in advance can be the wrong one for the trace (1
   prefill + 3 decode of these boards is prefill-bound on it and carries 2.5 times less).
   `DemoConfig.prefill_speeds`/`decode_speeds` fix a pool instead.
   With `--trace mooncake`: two prefill pods (1.0 and 1.6) and two decode pods (1.0 and 0.55),
   prefix caching on as in vLLM, every pod's cache emptied between policies (vLLM's
   `POST /reset_prefix_cache`, the emulators started with `VLLM_SERVER_DEV_MODE=1`), and every
   sidecar keeping its prefix index (`prefix_index: true`).
2. **Calibration.** `disaggpool calibrate` probes every pod over HTTP, as the operator's Job does
   (decode pods with the prefill pod as KV peer), and writes the fitted profiles; a fit that
   comes out poor is probed again, up to the operator's default number of attempts, as the
   operator does (`localpool.probe`).
3. **Operating point.** The trace is the embedded Azure 2023 conversation trace
   (`formats.embedded`; lengths clipped to 2048/256 tokens) with bursty Gamma arrivals (CV 3),
   or with `--trace mooncake` a contiguous slice of the embedded Mooncake conversation trace
   (its own arrivals and prefix blocks; prompts clipped to 7,680 tokens, outputs to 64);
   its SLO class is derived from unloaded latency (`sim.capacity.slo_targets`: TTFT x4, TPOT x2
   of the p90 request on the nominal board), and its rate is the one at which round-robin
   attains 0.85 goodput on the chosen pool in the simulator (`sim.operating_point`, the search
   `sim paper` uses): the regime where routing decisions matter.
4. **Replay.** For each policy a fresh sidecar process (`disaggpool sidecar`) fronts the pool and
   `loadgen.replay` sends the trace through its front door.
5. **Prediction.** The simulator runs the same trace, the same policies, the true profiles as the
   engines' timing and the fitted ones as the router's belief, with `DemoConfig.sim_seeds` seeds
   of the engines' step jitter; the table puts the mean (and its spread) next to the
   measurement. On a bursty trace of a few hundred requests that spread is a point or two,
   so a single measured run can only agree with the simulator within that noise.
6. **Told apart?** Each measured goodput comes with its 95% bootstrap interval over requests,
   and the first policy (calibrated) is compared with each other one request by request on the
   same trace (`core.stats.bootstrap_paired_difference_interval`); the output says which
   differences this run cannot tell from 0. `--duration 120` narrows them.

`--json FILE` writes ``{"policies": [{"policy", "goodput_measured", "goodput_ci95",
"vs_first_ci95", "goodput_simulated", "requests", "errors", "ttft_p99_s", "tpot_p99_s",
"cached_share", ...}], "setup": {...}}``: the setup holds the rate, the placements searched
(`placements_rps`), the trace, the SLO class, and per pod its true and its fitted speed;
`cached_share` is the share of prompt tokens the prefill pods found cached during the policy's
replay (`vllm:prefix_cache_hits` / `_queries`; null with prefix caching off), next to the
simulator's (`cached_share_simulated`).

Modules: `design` (the pool, the trace, the rate, the simulator's runs: everything chosen before
a process starts), `run` (the measurement, on processes `disaggpool.localpool` starts), `output`
(what it prints) and `cli` (the subcommand).
"""
