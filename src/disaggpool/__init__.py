"""disaggpool: a calibrated router for prefill/decode-disaggregated vLLM serving.

Package map: `core` is the pure scorer (contracts, cost model, policies, predictor); `engine` is the
pure engine model of one vLLM instance; `sim` the discrete-event simulator that drives both;
`formats` reads and writes profile, trace and scenario files; `cli` is the `disaggpool` command.
"""

__version__ = "0.1.0"
