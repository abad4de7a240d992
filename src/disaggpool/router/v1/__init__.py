"""Generated from protos/disaggpool/router/v1 by scripts/gen_protos.sh: do not edit."""
