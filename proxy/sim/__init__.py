"""A simulated LLM engine with vLLM's HTTP API and the serving physics of docs/physics.md.

from proxy.sim import SimConfig, create_sim_app, serve
cfg = SimConfig.from_preset("l40s", "8b", "bf16", time_scale=10)
app = create_sim_app(cfg)                        # an ASGI app; lifespan runs the engine
await serve([cfg, cfg.replace()], "127.0.0.1", [8001, 8002])   # until cancelled
"""

from proxy.sim.config import Faults, SimConfig
from proxy.sim.fleet import SimFleet, serve
from proxy.sim.server import SimApp, create_sim_app

__all__ = ["Faults", "SimApp", "SimConfig", "SimFleet", "create_sim_app", "serve"]
