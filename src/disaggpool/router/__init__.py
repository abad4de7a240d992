"""Generated from protos/disaggpool/router by scripts/gen_protos.sh: do not edit."""
