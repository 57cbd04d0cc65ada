"""`warmroute demo`: a simulated fleet, the proxy and a workload, end to end (a tool, apart
from the serving path).

run.py     the demo: one table per policy, on real sockets or in virtual time
disagg.py  `--scenario disagg`: the prefill/decode decider on a simulated fleet
stack.py   start and stop a local stack (simulated engines, proxies) as child processes
"""
