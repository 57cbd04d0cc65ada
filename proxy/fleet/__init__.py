"""Fleet membership: engines that join and leave while the proxy runs.

Sources (the config file on SIGHUP, the admin API, DNS, Kubernetes EndpointSlices) report
their whole set of engines; `members.Membership` turns reports into changes (pure);
`reconciler.Reconciler` applies them to the backend registry and to everything kept per
backend (docs/deployment.md, Elastic fleets).
"""
