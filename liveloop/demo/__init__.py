"""`liveloop demo` and `liveloop eval`: simulated users, held-out evaluation, the report."""
