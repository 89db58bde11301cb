"""The admin family: the routes behind the admin key (``/admin/...``). ``api_router``: policy
versions, learning, evidence, the policies, forget; ``lifecycle_router``: the version lifecycle;
``keys_router``: the API keys; ``protocol``: their request and answer models (one home);
``queries``: the SQL they read."""
