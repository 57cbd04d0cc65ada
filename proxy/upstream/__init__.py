"""The upstream side: the backends and the HTTP/1.1 client that reaches them.

conn.py      one keep-alive HTTP/1.1 connection to a backend and the response it carries
pool.py      Upstream: the pooled connections per backend (asyncio protocols + httptools)
outlier.py   passive health: outlier ejection with a circuit breaker (pure, time injected)
backends.py  the registry: configured backends, their models, health and load signals
"""
