"""The experiments built on the simulator: what `disaggpool sim paper|prefix|autoscale` run.

Each study is a fixed design (setups, traffic, pools, SLOs, policies, seeds), a run of it through
`sim.runner`, and a report of its JSON document (tables, findings, plots):

* paper, "Calibrate, Then Route": `paper` (the experiments), `paper_config` (sizes),
  `paper_setup` (the llama8b setup), `paper_study` (the study's own configuration),
  `paper_traces`, `paper_report`, `paper_plots`;
* prefix-cache-aware routing: `prefix_study`, `prefix_report`;
* autoscaling: `autoscale_traffic` (time-varying traffic), `autoscale_study`,
  `autoscale_report`.

The simulator (`disaggpool.sim`) never imports a study: what a user runs with `sim run` and
`plan` depends on no experiment's choices.
"""
