"""The routing sidecar: gRPC `Router` service and OpenAI-compatible prefill/decode front door.

`config` (the file), `state` (live pool view), `scrape` / `collectors` (what keeps it
current), `service` (the decision, shared by both adapters), `grpc_server` and `frontdoor` (the
adapters), `tokens` (exact prompt lengths), `metrics`, `app` (the process). See CONFIG.md.
"""
