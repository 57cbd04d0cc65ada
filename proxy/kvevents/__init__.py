"""Exact cache state from the engines' own KV events (vLLM's ZeroMQ protocol).

wire.py        the messages, byte for byte as vLLM sends them (pure)
view.py        one backend's cached blocks as warmroute's chained block keys (pure)
subscriber.py  SUB (+ replay DEALER) client that keeps a view current (asyncio)
publisher.py   PUB + replay ROUTER, as vLLM's ZmqEventPublisher; `warmroute sim` uses it

docs/kv-events.md explains the protocol and how the keys are rebuilt.
"""

from proxy.kvevents.publisher import KvEventPublisher, offset_endpoint
from proxy.kvevents.subscriber import EventSink, KvEventSubscriber
from proxy.kvevents.view import KvCacheView
from proxy.kvevents.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    Layout,
    WireError,
    decode_batch,
    encode_batch,
)

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventSink",
    "KVEvent",
    "KvCacheView",
    "KvEventPublisher",
    "KvEventSubscriber",
    "Layout",
    "WireError",
    "decode_batch",
    "encode_batch",
    "offset_endpoint",
]
