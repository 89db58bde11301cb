"""The admin family: the routes behind the admin key (``/admin/...``). ``api_router``: policy
versions, learning, evidence, the policies, forget, and ``serving`` their handling;
``lifecycle_router``: the version lifecycle, and ``lifecycle`` its handling; ``keys_router``: the
API keys; ``protocol``: their request and answer models (one home); ``queries``: the SQL they
read."""
