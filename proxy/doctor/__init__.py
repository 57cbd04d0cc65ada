"""`warmroute doctor`: from the proxy's own measurements to a diagnosis, per backend and model.

The modules, from the bottom up:
  model      the vocabulary: request samples, gauge samples, windows, findings, the report
  stats      percentiles and a robust line fit
  hardware   declared device/params/dtype -> the decode ceiling (the simulator's tables)
  timeline   decode as a timeline: gaps beside long prefills, context in flight, the ceiling
  analysis   one window's measurements: TTFT split, cache predicted vs reported, gauges
  report     those measurements as the report shows them, and notes on what is missing
  diagnose   the rules: measurements in, findings with evidence and a change out (pure)
  collector  the running proxy's windows, fed once per finished request
  virtual    windows from the virtual-time fleet (tests, `warmroute demo --virtual`)
  render     the report as text (a table per backend, colours on a terminal)
  http       GET /admin/doctor and the warmroute.doctor.findings gauge
  cli        `warmroute doctor --url ...`

Thresholds and the physics behind them: docs/doctor.md.
"""

from proxy.doctor.diagnose import Thresholds, diagnose
from proxy.doctor.model import FINDING_IDS, SCHEMA, Finding, Report, Window

__all__ = ["FINDING_IDS", "SCHEMA", "Finding", "Report", "Thresholds", "Window", "diagnose"]
