"""The operators' pages: health, readiness, metrics, the model list, the dashboard and its
data. ``api_router``: the routes; ``protocol``: their answer models; ``queries``: the SQL the
dashboard reads."""
