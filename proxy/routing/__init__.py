"""Routing: prompt prefix hashing, the prefix index, and the filter -> scorer -> picker pipeline."""
