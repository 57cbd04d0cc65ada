"""The HTTP edge: what every request meets before any routing.

limits.py  limits on client connections in the HTTP protocol (headers, bodies, pipelining)
access.py  who may call what: client API keys, the admin token, which listener serves admin
gate.py    the edge itself (raw ASGI): keys, request ids, admission tickets, the tenants'
           priority header, the OpenAI-style refusals

The request's identity it settles (proxy.types.CLIENT, TENANT; proxy.admission.slots.TICKET)
is read by the floors below through those leaves, never through this package.
"""
