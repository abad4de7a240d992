"""The decode-side P/D proxy (`disaggpool pd-proxy`): beside each decode pod's vLLM under a gateway.

The gateway sends a request to a decode pod and names its prefill pod in ``x-prefiller-host-port``
(llm-d's contract); this proxy runs vLLM's prefill leg there, then the decode leg against the
local vLLM with the prefill answer's ``kv_transfer_params``, as the front door does (the legs'
mechanics are `sidecar.upstream`, shared with it). `hosts` (the header), `proxy` (the two legs and
the fallbacks), `forward` (`/health` and every other path, passed to the local vLLM), `metrics`,
`config` (its options), `app` (the process), `cli`. docs/pd-proxy.md says what it does and why.
"""
