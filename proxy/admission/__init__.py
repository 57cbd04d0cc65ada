"""Who goes next when requests wait: the proxy's own slots and the backends' bounds.

slots.py          Admission: a bound on the requests the proxy works on at once, a short
                  queue fair among tenants (weighted fair queuing in tokens), priority
                  classes, deadlines; the Ticket each admitted request carries
backend_queue.py  requests whose every backend is at its in-flight bound, waiting for a slot

Pure of I/O but for the asyncio events that wake a waiter; read by the edge, the forwarding
path, telemetry and the admin views.
"""
