"""The process: the top floor, which builds everything below it and owns its lifetime.

app.py       create_app(config): the app whose lifespan owns every resource
serve.py     `warmroute serve`: the listeners (serving and admin ports) under uvicorn
handlers.py  the small endpoints: models, health, readiness, metrics and the admin views

Nothing below this package imports it (.importlinter's floors contract).
"""
