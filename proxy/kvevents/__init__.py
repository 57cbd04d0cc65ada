"""Exact cache state from the engines' own KV events (vLLM's ZeroMQ protocol).

wire.py        the messages, byte for byte as vLLM sends them (pure)
view.py        one backend's cached blocks as warmroute's chained block keys (pure)
subscriber.py  SUB (+ replay DEALER) client that keeps a view current (asyncio)
publisher.py   PUB + replay ROUTER, as vLLM's ZmqEventPublisher; `warmroute sim` uses it

docs/kv-events.md explains the protocol and how the keys are rebuilt. Import the modules
themselves: the simulator imports wire.py and publisher.py without loading view.py (which
reads the router's block keys) or the subscriber.
"""
