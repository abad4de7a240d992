"""Routing policies behind one interface (`base.Policy`); `registry.make_policy` builds them."""
