"""One module per group of HTTP routes; each has ``register(app, ctx)``, and ``create_app`` calls them all."""
