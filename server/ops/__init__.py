"""The operators' pages: health, readiness, metrics, the model list, the dashboard and its
data. ``api_router``: the routes; ``protocol``: their answer models; ``serving``: what the
dashboard shows of the learner and the guard; ``queries``: the SQL it reads."""
