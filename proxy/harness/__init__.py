"""The real routing and telemetry code driven in process, with no sockets and no proxy.

virtual.py         the virtual-time fleet: the real Router over the simulator's scheduler core,
                   stepped by a discrete-event clock (`warmroute demo --virtual`)
routing_cost.py    routing decision time: `python -m proxy.harness.routing_cost`
telemetry_cost.py  telemetry CPU per request: `python -m proxy.harness.telemetry_cost`

This is the one place that joins the proxy's parts to the simulator and the load generator:
`proxy/sim/` and `proxy/bench/` import nothing of routing, telemetry or the app, so each can be
read, run and shipped on its own (docs/architecture.md, "Layers").
"""
