"""The forwarding path: one request from its body to its last byte.

intake → route → attempt(s) → relay, in this order:
  exchange.py         one client request as it moves through the proxy (the path's data)
  ports.py            the small protocols the path's collaborators satisfy
  state.py            the app's resources as the path sees them (routing, fleet, recorder)
  intake.py, validate.py   the body read within its limit, parsed once, checked
  budget_gate.py      the tenants' budgets at the front of a request, settled at its end
  forward.py          ProxyEndpoint: the steps in order, routing, the refusals
  attempts.py         the attempt step: backends tried in turn, one leg each, to an answer
  pdflow.py           the prefill/decode flows: a variant of the attempt step
  retry.py            which failures are retried, where, after how long
  request_headers.py  what a backend is sent besides the body
  relay.py            one backend's response to the client, metered as it arrives
  meter.py            the sans-I/O stream meter (timestamps in, TTFT/ITL/TPOT facts out)
"""
