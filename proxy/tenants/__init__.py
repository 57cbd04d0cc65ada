"""Tenants of a shared fleet: per-key budgets that hold across replicas (docs/tenants.md).

gcra.py is the pure core (the rate arithmetic, shared by Redis's script and the local
fallback, and the headers OpenAI's clients read); store.py keeps the buckets in Redis or in
memory; budgets.py decides per request and charges what was served."""
